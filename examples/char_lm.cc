// char_lm: a character-level language model trained across two workers
// (what `./dev demo` runs).
//
//   build/bin/tandem-run --nproc-per-node 2 build/bin/char_lm [--steps 400] [--corpus FILE]
//       [--checkpoint char_lm.ckpt] [--checkpoint-every 100] [--resume] [--seed 0] [--lr 0.006]
//   build/bin/tandem-run --nproc-per-node 3 build/bin/char_lm --mode hybrid [...]
//   build/bin/tandem-run --nproc-per-node 2 build/bin/char_lm --mode pipeline [...]
//
// The last worker (worker1 of two) is a parameter server: it only serves. worker0 trains
//   Embedding(V, 32) -> LSTM(32, 128) -> Linear(128, V) -> cross-entropy
// where the embedding and the decoder are RemoteModules living on worker1 and
// the LSTM is an ordinary torch::nn::LSTM on the trainer. Every step runs in a
// distributed autograd context: the forward hops trainer -> worker1 ->
// trainer -> worker1, backward() comes back through both, and one
// DistributedOptimizer (Adam) over the remote modules' parameters and the
// LSTM's clips the global gradient norm and steps every owner at once.
//
// --mode hybrid (data and model parallelism together) runs N - 1 trainers on
// N processes, sharing the parameter server's embedding and decoder (worker0
// makes them and hands their references to the others). Each trainer's LSTM
// is wrapped in DistributedDataParallel over a process group of the
// trainers, so every backward averages the LSTM's gradients among them
// while the remote modules' gradients go to the server; each trainer steps
// the shared modules with its own optimizer, as in PyTorch's DDP + RPC
// tutorial, but never while another trainer's forward or backward uses
// them (the trainers meet before and after stepping). Gradients are not
// clipped in this mode (see the training loop). Trainer r trains on the batches of steps s * (N - 1) + r, so the
// trainers read different text. The shared modules take the trainers' steps
// in no fixed order, so a hybrid run is not reproducible to the bit and
// writes no checkpoint (--resume is refused); at the end the trainers check
// that their LSTMs are identical.
//
// The text is, by default, every regular file in /usr/share/common-licenses
// (sorted by name; the symbolic links there only repeat other files), so the
// demo runs on any Debian machine; --corpus takes any other file. The
// vocabulary is the distinct bytes of the text.
//
// --mode pipeline trains the same model as a pipeline (pipeline/pipe.h) of
// two stages: Embedding + LSTM on worker0, the decoder on worker1; each
// batch goes through in 4 micro-batches by the 1F1B schedule, the stages'
// gradients land in the distributed autograd context and one
// DistributedOptimizer (Adam, clipped) steps both. It starts from the same
// parameters and batches as single mode, so its losses follow single
// mode's (to float rounding). It writes no checkpoint; the sample feeds the
// last 64 characters through the pipe for each new one.
//
// Determinism: step s trains on a batch drawn from a generator seeded by
// (seed, s) alone, and the initial parameters come from at::manual_seed(seed)
// on the trainer (the remote modules get theirs with load_state_dict), so a
// run resumed from a checkpoint prints exactly the losses of an uninterrupted
// one (the last line's loss is printed with %.6f to compare).
//
// The checkpoint is ONE file (torch::serialize archive, written to PATH.tmp
// and renamed over PATH), with these keys:
//   step, seed          int: steps done, and the seed they were drawn with
//   corpus_fnv, vocab   int, string: FNV-1a hash of the text and its vocabulary;
//                       resuming on another text is refused
//   lstm, embedding, decoder
//                       archives of named tensors: the trainer's LSTM and the
//                       two RemoteModules' state_dict()
//   optim               the DistributedOptimizer's state_dict() as
//                       optim::state_to_bytes gives it (a uint8 tensor)
//
// Errors in the flags, the corpus or the checkpoint are found before
// training; the trainer still joins the world and shuts down so that the
// parameter server exits too, then exits with code 2.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <set>

#include "examples/flags.h"
#include "examples/launch.h"
#include "examples/replicas.h"
#include "tandem/autograd/autograd.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/pipeline/pipe.h"
#include "tandem/remote_module/remote_module.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rref.h"

namespace {

namespace rpc = tandem::rpc;
namespace dist = tandem::autograd;
namespace optim = tandem::optim;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int64_t kBatch = 32;
constexpr int64_t kWindow = 64;  // characters predicted per sequence (+1 read)
constexpr int64_t kEmbed = 32;
constexpr int64_t kHidden = 128;
constexpr const char* kDefaultCorpus = "/usr/share/common-licenses";
using ModuleRef = rpc::RRef<c10::IValue>;
using DdpLstm = tandem::ddp::DistributedDataParallel<torch::nn::LSTMImpl>;

struct Config {
  int64_t steps = 400;
  int64_t checkpoint_every = 100;
  int64_t seed = 0;
  int64_t log_every = 25;
  double lr = 6e-3;
  std::string corpus;  // empty: kDefaultCorpus
  std::string checkpoint = "char_lm.ckpt";
  std::string mode = "single";  // or "hybrid", "pipeline"
  std::string schedule = "1f1b";  // --mode pipeline's
  std::string losses;  // --losses: each progress line also goes there as CSV
  bool resume = false;
  bool hybrid() const { return mode == "hybrid"; }
  bool pipeline() const { return mode == "pipeline"; }
};

// Where the processes are: trainers 0..trainers-1, then the parameter server.
struct Place {
  int rank = 0;
  int trainers = 1;
  std::string server() const { return "worker" + std::to_string(trainers); }
};

// --mode hybrid: worker0's references to the shared modules, for the other
// trainers' "shared_module" calls (answered once worker0 made them).
struct Shared {
  std::mutex mu;
  std::optional<rpc::Promise<ModuleRef>> embedding{rpc::Promise<ModuleRef>()};
  std::optional<rpc::Promise<ModuleRef>> decoder{rpc::Promise<ModuleRef>()};
};

using examples::UsageError;

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw UsageError("cannot read '" + p.string() + "'");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Corpus {
  std::string name;
  std::string text;
  std::string vocab;  // the distinct bytes, in order
  at::Tensor tokens;  // int64, each byte's index in vocab
  uint64_t fingerprint = 0;
};

Corpus load_corpus(const std::string& flag) {
  Corpus c;
  if (flag.empty()) {
    std::error_code ec;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(kDefaultCorpus, ec)) {
      if (e.is_regular_file() && !e.is_symlink()) files.push_back(e.path());
    }
    if (ec || files.empty()) {
      throw UsageError(std::string("no text in ") + kDefaultCorpus + "; pass --corpus FILE");
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) c.text += read_file(f);
    c.name = std::string(kDefaultCorpus) + "/* (" + std::to_string(files.size()) + " files)";
  } else {
    std::error_code ec;
    if (!fs::exists(flag, ec)) throw UsageError("corpus file '" + flag + "' does not exist");
    if (fs::is_directory(flag, ec)) throw UsageError("corpus '" + flag + "' is a directory");
    c.text = read_file(flag);
    c.name = flag;
  }
  if (c.text.empty()) throw UsageError("corpus '" + c.name + "' is empty");
  if (static_cast<int64_t>(c.text.size()) < kWindow + 1) {
    throw UsageError("corpus '" + c.name + "' has " + std::to_string(c.text.size()) +
                     " bytes; at least " + std::to_string(kWindow + 1) + " are needed");
  }
  std::set<unsigned char> bytes(c.text.begin(), c.text.end());
  c.vocab.assign(bytes.begin(), bytes.end());
  int64_t index[256] = {};
  for (size_t i = 0; i < c.vocab.size(); ++i) index[static_cast<unsigned char>(c.vocab[i])] = i;
  c.tokens = at::empty({static_cast<int64_t>(c.text.size())}, at::kLong);
  auto* t = c.tokens.data_ptr<int64_t>();
  for (size_t i = 0; i < c.text.size(); ++i) t[i] = index[static_cast<unsigned char>(c.text[i])];
  c.fingerprint = fnv1a(c.text);
  return c;
}

// The batch of step `step`: a function of (seed, step) alone, so that a
// resumed run draws exactly the batches an uninterrupted one would.
struct Batch {
  at::Tensor x, y;  // [B, T] int64: inputs and the characters that follow them
};
Batch batch_at(const Corpus& c, int64_t seed, int64_t step) {
  // splitmix64 of (seed, step): neighbouring steps get unrelated streams.
  uint64_t z = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step) +
               0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(z);
  const int64_t n = c.tokens.size(0);
  at::Tensor starts = at::randint(0, n - kWindow, {kBatch, 1}, gen, at::kLong);
  at::Tensor windows = c.tokens.index_select(0, (starts + at::arange(kWindow + 1)).reshape(-1))
                           .view({kBatch, kWindow + 1});
  return {windows.narrow(1, 0, kWindow), windows.narrow(1, 1, kWindow)};
}

// ---- checkpoint ------------------------------------------------------------

using Named = std::map<std::string, at::Tensor>;

struct Checkpoint {
  int64_t step = 0;
  int64_t seed = 0;
  uint64_t corpus_fnv = 0;
  std::string vocab;
  Named lstm, embedding, decoder;
  optim::OptimizerState optim;
};

void write_named(torch::serialize::OutputArchive& out, const std::string& key, const Named& m) {
  torch::serialize::OutputArchive sub;
  for (const auto& [name, t] : m) sub.write(name, t.detach().clone(), /*is_buffer=*/true);
  out.write(key, sub);
}

Named read_named(torch::serialize::InputArchive& in, const std::string& key) {
  torch::serialize::InputArchive sub;
  in.read(key, sub);
  Named m;
  for (const auto& name : sub.keys()) {
    at::Tensor t;
    sub.read(name, t, /*is_buffer=*/true);
    m[name] = t;
  }
  return m;
}

void save_checkpoint(const Checkpoint& ck, const std::string& path) {
  torch::serialize::OutputArchive out;
  out.write("step", c10::IValue(ck.step));
  out.write("seed", c10::IValue(ck.seed));
  out.write("corpus_fnv", c10::IValue(static_cast<int64_t>(ck.corpus_fnv)));
  out.write("vocab", c10::IValue(ck.vocab));
  write_named(out, "lstm", ck.lstm);
  write_named(out, "embedding", ck.embedding);
  write_named(out, "decoder", ck.decoder);
  // The optimizer's own bytes (checked by a hash), as a byte tensor.
  const std::string optim_bytes = optim::state_to_bytes(ck.optim);
  at::Tensor bytes = at::empty({static_cast<int64_t>(optim_bytes.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), optim_bytes.data(), optim_bytes.size());
  out.write("optim", bytes, /*is_buffer=*/true);
  // A crash mid-write leaves the old checkpoint whole.
  const std::string tmp = path + ".tmp";
  out.save_to(tmp);
  fs::rename(tmp, path);
}

Checkpoint load_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw UsageError("--resume: no checkpoint at '" + path + "' (set it with --checkpoint)");
  }
  Checkpoint ck;
  try {
    torch::serialize::InputArchive in;
    in.load_from(path);
    c10::IValue v;
    in.read("step", v);
    ck.step = v.toInt();
    in.read("seed", v);
    ck.seed = v.toInt();
    in.read("corpus_fnv", v);
    ck.corpus_fnv = static_cast<uint64_t>(v.toInt());
    in.read("vocab", v);
    ck.vocab = v.toStringRef();
    ck.lstm = read_named(in, "lstm");
    ck.embedding = read_named(in, "embedding");
    ck.decoder = read_named(in, "decoder");
    at::Tensor bytes;
    in.read("optim", bytes, /*is_buffer=*/true);
    ck.optim = optim::state_from_bytes(
        std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel()),
        "the optimizer state in '" + path + "'");
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  } catch (const c10::Error& e) {
    // LibTorch's message carries a C++ backtrace; its first line says enough.
    std::string what = e.what_without_backtrace();
    throw UsageError("'" + path + "' is not a char_lm checkpoint (" +
                     what.substr(0, what.find('\n')) + ")");
  }
  return ck;
}

Named named_parameters(const torch::nn::Module& m) {
  Named out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  return out;
}

// ---- the model -------------------------------------------------------------

struct Model {
  tandem::nn::RemoteModule embedding;  // on the parameter server
  torch::nn::LSTM lstm;                // here
  tandem::nn::RemoteModule decoder;    // on the parameter server
  DdpLstm* ddp = nullptr;              // --mode hybrid: the LSTM, data-parallel

  // Logits [B, T, V] and the LSTM's state after the last character.
  std::pair<at::Tensor, std::tuple<at::Tensor, at::Tensor>> forward(
      const at::Tensor& x, c10::optional<std::tuple<at::Tensor, at::Tensor>> state = {}) {
    at::Tensor e = embedding.forward(x);
    auto [h, hc] = ddp ? ddp->forward(e, state) : lstm->forward(e, state);
    return {decoder.forward(h), hc};
  }
};

// Feeds new characters [1, k] to a model and answers the logits [V] that
// follow the last of them (the model keeps what it needs of the earlier ones).
using NextLogits = std::function<at::Tensor(const at::Tensor& ids)>;

// The split model's next logits: the LSTM's state carried over.
NextLogits stateful(Model& m) {
  auto state = std::make_shared<c10::optional<std::tuple<at::Tensor, at::Tensor>>>();
  return [&m, state](const at::Tensor& ids) {
    auto [logits, hc] = m.forward(ids, *state);
    *state = hc;
    return logits[0][-1];
  };
}

// `n` characters after `prompt`, sampled at `temperature`. No autograd
// context: the remote forwards record nothing outside one.
std::string generate(const NextLogits& model, const Corpus& c, std::string prompt, int n,
                     double temperature, uint64_t seed) {
  c10::NoGradGuard no_grad;
  std::vector<int64_t> ids;
  std::string kept;
  for (char ch : prompt) {
    auto pos = c.vocab.find(ch);
    if (pos != std::string::npos) {
      ids.push_back(static_cast<int64_t>(pos));
      kept += ch;
    }
  }
  if (ids.empty()) {  // a corpus without those letters: start from its first byte
    ids.push_back(c.tokens[0].item<int64_t>());
    kept = c.vocab.substr(ids[0], 1);
  }
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor logits = model(at::tensor(ids).view({1, -1}));
  std::string out = kept;
  for (int i = 0; i < n; ++i) {
    at::Tensor next = at::multinomial(at::softmax(logits / temperature, 0), 1, false, gen);
    out += c.vocab[next.item<int64_t>()];
    logits = model(next.view({1, 1}));
  }
  // One line on the terminal: each run of white space as one blank (the
  // licences are full of indentation), other control bytes as '?'.
  std::string line;
  for (char ch : out) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == ' ' || ch == '\n' || ch == '\t' || ch == '\r') {
      if (line.empty() || line.back() != ' ') line += ' ';
    } else {
      line += (u < 0x20 || u == 0x7f) ? '?' : ch;
    }
  }
  return line;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The progress lines: the mean loss since the last one, every log_every
// steps, after the first and after the last.
struct Progress {
  const Config& cfg;
  Clock::time_point started;
  int64_t tokens_per_step;  // of all trainers
  double sum = 0;
  int64_t since = 0;
  int64_t csv_rows = 0;
  Clock::time_point last_line = Clock::now();

  void add(int64_t done, double loss) {
    sum += loss;
    ++since;
    if (done % cfg.log_every != 0 && done != cfg.steps && done != 1) return;
    const double dt = seconds_since(last_line);
    std::printf("step %lld/%lld  loss %.3f  tokens/s %.0f  elapsed %.1fs\n",
                static_cast<long long>(done), static_cast<long long>(cfg.steps), sum / since,
                since * tokens_per_step / dt, seconds_since(started));
    std::fflush(stdout);
    if (!cfg.losses.empty()) {
      // Written afresh by a run from step 1, appended to by a resumed one.
      const bool fresh = csv_rows == 0 && !cfg.resume;
      if (FILE* f = std::fopen(cfg.losses.c_str(), fresh ? "w" : "a")) {
        if (fresh) std::fprintf(f, "step,loss,tokens_per_s,elapsed_s\n");
        std::fprintf(f, "%lld,%.6f,%.0f,%.3f\n", static_cast<long long>(done), sum / since,
                     since * tokens_per_step / dt, seconds_since(started));
        std::fclose(f);
        ++csv_rows;
      }
    }
    sum = 0;
    since = 0;
    last_line = Clock::now();
  }
};

// The remote modules: made on the server by worker0, the other trainers'
// views of them in --mode hybrid.
std::pair<tandem::nn::RemoteModule, tandem::nn::RemoteModule> remote_modules(const Place& at,
                                                                             int64_t V) {
  if (at.rank == 0) {
    return {tandem::nn::RemoteModule(at.server() + "/cpu", "Embedding", {V, kEmbed}),
            tandem::nn::RemoteModule(at.server() + "/cpu", "Linear", {kHidden, V})};
  }
  return {tandem::nn::RemoteModule(rpc::rpc_sync<ModuleRef>("worker0", "shared_module", int64_t(0))),
          tandem::nn::RemoteModule(rpc::rpc_sync<ModuleRef>("worker0", "shared_module", int64_t(1)))};
}

// The trainers' process group for the life of a hybrid run.
struct TrainerGroup {
  explicit TrainerGroup(const Place& at) {
    tandem::ddp::init_process_group("gloo", "env://", at.trainers, at.rank);
  }
  ~TrainerGroup() { tandem::ddp::destroy_process_group(); }
};

// Every parameter's first value, drawn here from the seed in one fixed
// order, whatever the mode: the remote modules are overwritten with it (or
// the checkpoint), so a run depends on no other worker's generator, and the
// modes start from the same parameters.
struct Initial {
  torch::nn::Embedding embedding;
  torch::nn::LSTM lstm;
  torch::nn::Linear decoder;
};
Initial initial_parameters(const Config& cfg, int64_t vocab) {
  at::manual_seed(static_cast<uint64_t>(cfg.seed));
  torch::nn::Embedding embedding(vocab, kEmbed);
  torch::nn::LSTM lstm(torch::nn::LSTMOptions(kEmbed, kHidden).batch_first(true));
  torch::nn::Linear decoder(kHidden, vocab);
  return {embedding, lstm, decoder};
}

// --mode pipeline, stage 0: the embedding and the LSTM (its output only).
struct FrontImpl : torch::nn::Module {
  explicit FrontImpl(int64_t vocab)
      : embedding(register_module("embedding", torch::nn::Embedding(vocab, kEmbed))),
        lstm(register_module(
            "lstm", torch::nn::LSTM(torch::nn::LSTMOptions(kEmbed, kHidden).batch_first(true)))) {}
  at::Tensor forward(at::Tensor x) { return std::get<0>(lstm->forward(embedding->forward(x))); }
  torch::nn::Embedding embedding;
  torch::nn::LSTM lstm;
};

// Registered on every process (each may hold a stage): the front, and the
// loss over every character of the micro-batch.
const bool kPipelineParts = [] {
  tandem::nn::register_module("char_lm_front",
                              [](int64_t vocab) { return std::make_shared<FrontImpl>(vocab); });
  tandem::pipeline::register_loss("char_lm", [](const at::Tensor& logits, const at::Tensor& y) {
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), y.reshape(-1));
  });
  return true;
}();

// --mode pipeline: the same model as two pipeline stages, Embedding + LSTM
// on worker0 and the decoder on the server, each batch in 4 micro-batches
// by --schedule (1F1B unless told); Adam with clipping as in single mode,
// from the same initial parameters. No checkpoint.
int train_pipeline(const Config& cfg, const Corpus& corpus, Clock::time_point started,
                   const Place& at) {
  (void)kPipelineParts;
  const int64_t V = static_cast<int64_t>(corpus.vocab.size());
  const Initial init = initial_parameters(cfg, V);
  std::vector<tandem::nn::RemoteModule> stages = {
      tandem::nn::RemoteModule("worker0/cpu", "char_lm_front", {V}),
      tandem::nn::RemoteModule(at.server() + "/cpu", "Linear", {kHidden, V})};
  Named front;
  for (const auto& [name, t] : named_parameters(*init.embedding)) front["embedding." + name] = t;
  for (const auto& [name, t] : named_parameters(*init.lstm)) front["lstm." + name] = t;
  stages[0].load_state_dict(front);
  stages[1].load_state_dict(named_parameters(*init.decoder));

  tandem::pipeline::PipeOptions po;
  po.chunks = 4;
  po.schedule = cfg.schedule;
  po.loss = "char_lm";
  tandem::pipeline::Pipe pipe(stages, po);
  optim::Options o;
  o.lr = cfg.lr;
  optim::DistributedOptimizer opt(optim::Kind::kAdam, pipe.parameters(), o);
  std::printf("char_lm: %s, %zu bytes, vocabulary %lld; pipeline: Embedding + LSTM(%lld->%lld) "
              "on worker0, decoder on %s; %d micro-batches a step (%s); training steps 1..%lld\n",
              corpus.name.c_str(), corpus.text.size(), static_cast<long long>(V),
              static_cast<long long>(kEmbed), static_cast<long long>(kHidden),
              at.server().c_str(), po.chunks, po.schedule.c_str(),
              static_cast<long long>(cfg.steps));
  std::fflush(stdout);

  double loss_value = 0;
  Progress progress{cfg, started, kBatch * kWindow};
  for (int64_t step = 0; step < cfg.steps; ++step) {
    Batch b = batch_at(corpus, cfg.seed, step);
    {
      dist::Context ctx;
      loss_value = pipe.step(ctx.id(), b.x, b.y);
      opt.clip_grad_norm(ctx.id(), 1.0);
      opt.step(ctx.id());
    }
    progress.add(step + 1, loss_value);
  }
  std::printf("final step %lld loss %.6f\n", static_cast<long long>(cfg.steps), loss_value);
  // Sampling feeds the last kWindow characters through both stages each time.
  std::vector<int64_t> seen;
  auto next = [&](const at::Tensor& ids) {
    for (int64_t i = 0; i < ids.numel(); ++i) seen.push_back(ids.view(-1)[i].item<int64_t>());
    const size_t from = seen.size() > static_cast<size_t>(kWindow) ? seen.size() - kWindow : 0;
    std::vector<int64_t> window(seen.begin() + static_cast<std::ptrdiff_t>(from), seen.end());
    return pipe.forward(at::tensor(window).view({1, -1}))[0][-1];
  };
  std::printf("sample: %s\n",
              generate(next, corpus, "The ", 200, 0.8, static_cast<uint64_t>(cfg.seed) + 1).c_str());
  std::fflush(stdout);
  return 0;
}

int train(const Config& cfg, const Corpus& corpus, const std::optional<Checkpoint>& resume,
          Clock::time_point started, const Place& at, Shared& shared) {
  const int64_t V = static_cast<int64_t>(corpus.vocab.size());
  const Initial init = initial_parameters(cfg, V);
  torch::nn::LSTM lstm = init.lstm;  // trained here
  auto [embedding, decoder] = remote_modules(at, V);
  Model m{std::move(embedding), lstm, std::move(decoder)};
  std::optional<TrainerGroup> group;
  std::optional<DdpLstm> ddp_lstm;

  int64_t start = 0;
  if (cfg.hybrid()) {
    // The others' "shared_module" calls wait for these.
    if (at.rank == 0) {
      m.embedding.load_state_dict(named_parameters(*init.embedding));
      m.decoder.load_state_dict(named_parameters(*init.decoder));
      std::lock_guard<std::mutex> lock(shared.mu);
      shared.embedding->set_value(m.embedding.get_module_rref());
      shared.decoder->set_value(m.decoder.get_module_rref());
    }
    // Every trainer takes worker0's LSTM here, and averages its gradients.
    group.emplace(at);
    ddp_lstm.emplace(lstm);
    m.ddp = &*ddp_lstm;
    // Every trainer has its references by now (DDP's construction met them all).
    std::lock_guard<std::mutex> lock(shared.mu);
    shared.embedding.reset();
    shared.decoder.reset();
  } else if (resume) {
    m.embedding.load_state_dict(resume->embedding);
    m.decoder.load_state_dict(resume->decoder);
    c10::NoGradGuard no_grad;
    for (auto& p : lstm->named_parameters()) {
      auto it = resume->lstm.find(p.key());
      if (it == resume->lstm.end() || !it->second.sizes().equals(p.value().sizes())) {
        throw UsageError("checkpoint '" + cfg.checkpoint + "': LSTM parameter '" + p.key() +
                         "' is missing or has another shape");
      }
      p.value().copy_(it->second);
    }
    start = resume->step;
  } else {
    m.embedding.load_state_dict(named_parameters(*init.embedding));
    m.decoder.load_state_dict(named_parameters(*init.decoder));
  }

  // One optimizer over all three modules; the LSTM's parameters are local
  // RRefs, stepped here without RPC.
  std::vector<rpc::RRef<at::Tensor>> params = m.embedding.remote_parameters();
  for (auto& p : lstm->parameters()) params.emplace_back(p);
  for (auto& p : m.decoder.remote_parameters()) params.push_back(p);
  optim::Options o;
  o.lr = cfg.lr;
  optim::DistributedOptimizer opt(optim::Kind::kAdam, params, o);
  if (resume) opt.load_state_dict(resume->optim);

  auto checkpoint = [&](int64_t step) {
    if (cfg.hybrid()) return;
    Checkpoint ck;
    ck.step = step;
    ck.seed = cfg.seed;
    ck.corpus_fnv = corpus.fingerprint;
    ck.vocab = corpus.vocab;
    ck.lstm = named_parameters(*lstm);
    ck.embedding = m.embedding.state_dict();
    ck.decoder = m.decoder.state_dict();
    ck.optim = opt.state_dict();
    save_checkpoint(ck, cfg.checkpoint);
  };

  const bool speak = at.rank == 0;
  if (speak) {
    std::printf("char_lm: %s, %zu bytes, vocabulary %lld; embedding and decoder on %s, "
                "LSTM(%lld->%lld) %s; %s steps %lld..%lld\n",
                corpus.name.c_str(), corpus.text.size(), static_cast<long long>(V),
                at.server().c_str(), static_cast<long long>(kEmbed),
                static_cast<long long>(kHidden),
                cfg.hybrid() ? ("on each of " + std::to_string(at.trainers) +
                                " DDP trainers").c_str()
                             : "here",
                resume ? "resuming," : "training", static_cast<long long>(start + 1),
                static_cast<long long>(cfg.steps));
    std::fflush(stdout);
  }

  double loss_value = 0;
  // Tokens of all trainers (they step together); worker0's loss.
  Progress progress{cfg, started, kBatch * kWindow * at.trainers};
  for (int64_t step = start; step < cfg.steps; ++step) {
    Batch b = batch_at(corpus, cfg.seed, step * at.trainers + at.rank);
    {
      dist::Context ctx;
      at::Tensor logits = m.forward(b.x).first;
      at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, V}), b.y.reshape(-1));
      dist::backward(ctx.id(), {loss});
      // Clipping scales every gradient of the context by one factor, from
      // the norm of all of them; hybrid trainers' remote gradients differ, so
      // their factors would too, and their LSTMs drift apart: not clipped.
      if (!cfg.hybrid()) opt.clip_grad_norm(ctx.id(), 1.0);
      // Hybrid: no trainer steps the shared modules while another one's
      // backward still needs their values (autograd saved the decoder's and
      // the embedding's weights; a step in between fails that backward with
      // "modified by an inplace operation"), nor before another one's
      // forward has read them.
      if (cfg.hybrid()) tandem::ddp::barrier();
      opt.step(ctx.id());
      if (cfg.hybrid()) tandem::ddp::barrier();
      loss_value = loss.item<double>();
    }
    const int64_t done = step + 1;
    if (speak) progress.add(done, loss_value);
    if (done % cfg.checkpoint_every == 0 || done == cfg.steps) checkpoint(done);
  }
  if (cfg.hybrid()) {
    // Every trainer's LSTM against worker0's; and no trainer still steps
    // the shared modules while worker0 samples from them.
    const bool same = examples::same_on_every_rank(lstm->parameters(), tandem::ddp::default_group());
    if (!same) throw std::runtime_error("the trainers' LSTMs differ after training");
    if (!speak) return 0;
    std::printf("trainers' LSTMs identical\nfinal step %lld loss %.6f\n",
                static_cast<long long>(cfg.steps), loss_value);
  } else {
    std::printf("final step %lld loss %.6f  (checkpoint %s)\n", static_cast<long long>(cfg.steps),
                loss_value, cfg.checkpoint.c_str());
  }
  m.ddp = nullptr;  // sampling needs no gradients averaged
  std::printf("sample: %s\n",
              generate(stateful(m), corpus, "The ", 200, 0.8, static_cast<uint64_t>(cfg.seed) + 1)
                  .c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

static int job_main(int argc, char** argv) {
  const Clock::time_point started = Clock::now();
  try {
    const rpc::WorldEnv env = rpc::world_from_env();
    if (env.world_size >= 2 && env.rank == env.world_size - 1) {
      // The parameter server: serves the remote modules (and its part of
      // the optimizers) until the trainers are done. It reads no flags.
      rpc::init(std::make_shared<rpc::Registry>());
      rpc::shutdown();
      return 0;
    }

    Config cfg;
    examples::Flags flags("char_lm");
    flags.add("--steps", &cfg.steps, 1, "total training steps")
        .add("--corpus", &cfg.corpus, "text file to train on (default: /usr/share/common-licenses/*)")
        .add("--checkpoint", &cfg.checkpoint, "checkpoint file")
        .add("--checkpoint-every", &cfg.checkpoint_every, 1, "write the checkpoint every N steps")
        .add_switch("--resume", &cfg.resume, "continue from --checkpoint up to --steps")
        .add("--seed", &cfg.seed, 0, "seed of the initial parameters, batches and sample")
        .add("--lr", &cfg.lr, "Adam's learning rate")
        .add("--log-every", &cfg.log_every, 1, "print the mean loss every N steps")
        .add("--losses", &cfg.losses, "also write each progress line to this CSV file")
        .add_choice("--mode", &cfg.mode, {"single", "hybrid", "pipeline"},
                    "one trainer (2 processes); N - 1 DDP trainers sharing the parameter "
                    "server (N >= 3 processes); or the model pipelined over 2 processes")
        .add_choice("--schedule", &cfg.schedule, {"gpipe", "1f1b", "zero-bubble"},
                    "--mode pipeline's schedule");
    std::string error = flags.parse(argc, argv);
    const Place at{env.rank, env.world_size - 1};
    if (error.empty() && env.world_size >= 2) {
      if (cfg.hybrid() && at.trainers < 2) {
        error = "--mode hybrid needs 3 or more processes (trainers and a parameter server): "
                "tandem-run --nproc-per-node 3";
      } else if (!cfg.hybrid() && at.trainers > 1) {
        error = "--mode " + cfg.mode + " runs on 2 processes; pass --mode hybrid for " +
                std::to_string(at.trainers) + " data-parallel trainers";
      } else if (cfg.hybrid() && cfg.resume) {
        error = "--resume is for --mode single: hybrid trainers step the shared modules in no "
                "fixed order, so a hybrid run writes no checkpoint";
      } else if (!cfg.pipeline() && cfg.schedule != "1f1b") {
        error = "--schedule is for --mode pipeline";
      } else if (cfg.pipeline() && cfg.resume) {
        error = "--resume is for --mode single: a pipeline run writes no checkpoint";
      }
    }
    std::optional<Corpus> corpus;
    std::optional<Checkpoint> resume;
    if (error.empty() && !flags.help()) {
      try {
        corpus = load_corpus(cfg.corpus);
        if (cfg.resume) {
          resume = load_checkpoint(cfg.checkpoint);
          if (resume->corpus_fnv != corpus->fingerprint || resume->vocab != corpus->vocab) {
            throw UsageError("checkpoint '" + cfg.checkpoint +
                             "' was trained on another corpus; pass the same --corpus");
          }
          if (resume->seed != cfg.seed) {
            throw UsageError("checkpoint '" + cfg.checkpoint + "' was trained with --seed " +
                             std::to_string(resume->seed));
          }
          if (resume->step >= cfg.steps) {
            throw UsageError("checkpoint '" + cfg.checkpoint + "' is at step " +
                             std::to_string(resume->step) + "; pass a larger --steps");
          }
        }
      } catch (const UsageError& e) {
        error = e.what();
      }
    }
    if (env.rank < 0 || env.world_size < 2) {
      return examples::outside_world(
          flags, error, "start me with 2 workers: build/bin/tandem-run --nproc-per-node 2 "
                        "build/bin/char_lm");
    }

    // Join the world even when there is nothing to train, so that the
    // parameter server's shutdown() returns and it exits on its own.
    Shared shared;
    auto registry = std::make_shared<rpc::Registry>();
    registry->def("shared_module", [&shared](int64_t which) {
      std::lock_guard<std::mutex> lock(shared.mu);
      auto& promise = which == 0 ? shared.embedding : shared.decoder;
      if (!promise) throw std::logic_error("the shared modules were handed out already");
      return promise->future();
    });
    rpc::init(registry);
    const int rc = examples::run_worker(flags, error, /*speak=*/at.rank == 0, [&] {
      if (cfg.pipeline()) return train_pipeline(cfg, *corpus, started, at);
      return train(cfg, *corpus, resume, started, at, shared);
    });
    rpc::shutdown();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "char_lm: %s\n", e.what());
    return 1;
  }
}

int main(int argc, char** argv) {
  // examples/launch.h: under tandem-run, or started alone. --mode hybrid is
  // a job of 3 (two trainers and the parameter server); the others of 2.
  int nprocs = 2;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--mode") == 0 && std::strcmp(argv[i + 1], "hybrid") == 0) nprocs = 3;
  }
  return examples::launch("char_lm", nprocs, argc, argv, job_main);
}
