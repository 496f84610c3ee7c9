// --mode single and --mode hybrid (examples/char_lm/train.h).
#include <ATen/ops/cross_entropy_loss.h>
#include <c10/core/GradMode.h>

#include <cstdio>
#include <stdexcept>

#include "examples/char_lm/model.h"
#include "examples/char_lm/train.h"
#include "examples/progress.h"
#include "examples/replicas.h"
#include "tandem/autograd/autograd.h"
#include "tandem/checkpoint/job.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/optim/nonfinite.h"

namespace char_lm {

namespace rpc = tandem::rpc;
namespace dist = tandem::autograd;
namespace optim = tandem::optim;

namespace {

// The remote modules: made on the server by worker0, the other trainers'
// views of them in --mode hybrid.
std::pair<tandem::nn::RemoteModule, tandem::nn::RemoteModule> remote_modules(const Place& at,
                                                                             int64_t V) {
  if (at.rank == 0) {
    return {tandem::nn::RemoteModule(at.server() + "/cpu", "Embedding", {V, kEmbed}),
            tandem::nn::RemoteModule(at.server() + "/cpu", "Linear", {kHidden, V})};
  }
  return {
      tandem::nn::RemoteModule(rpc::rpc_sync<ModuleRef>("worker0", "shared_module", int64_t(0))),
      tandem::nn::RemoteModule(rpc::rpc_sync<ModuleRef>("worker0", "shared_module", int64_t(1)))};
}

// The trainers' process group for the life of a hybrid run.
struct TrainerGroup {
  explicit TrainerGroup(const Place& at) {
    tandem::ddp::init_process_group("gloo", "env://", at.trainers, at.rank);
  }
  ~TrainerGroup() { tandem::ddp::destroy_process_group(); }
};

}  // namespace

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

  // The job's state (checkpoint.h), each piece saved and loaded where it
  // lives: the LSTM here, the remote modules and their Adam state on the
  // parameter server.
  std::vector<std::string> names;
  for (const auto& [prefix, module] : std::vector<std::pair<std::string, const torch::nn::Module*>>{
           {"embedding", init.embedding.get()},
           {"lstm", lstm.get()},
           {"decoder", init.decoder.get()}}) {
    for (const auto& p : module->named_parameters()) names.push_back(prefix + "." + p.key());
  }
  std::string vocab = corpus.vocab;
  tandem::checkpoint::JobState state;
  state.module("lstm", *lstm)
      .remote_module("embedding", m.embedding)
      .remote_module("decoder", m.decoder)
      .distributed_optimizer("adam", opt, names)
      .record("vocab", &vocab);
  if (resume && !cfg.hybrid()) {
    if (resume->step >= cfg.steps) {
      // A restart after the last step was saved (a worker failed at the end).
      std::printf("char_lm: the checkpoint is at step %lld, the last: done\n",
                  static_cast<long long>(resume->step));
      return 0;
    }
    state.load(tandem::checkpoint::Reader(resume->path));
    start = resume->step;
  }
  tandem::checkpoint::SaveOptions save_options;
  save_options.meta = {{"seed", std::to_string(cfg.seed)},
                       {"corpus_fnv", std::to_string(corpus.fingerprint)},
                       {"program", "char_lm"}};
  auto checkpoint = [&](int64_t step) {
    if (cfg.hybrid()) return;
    tandem::checkpoint::save_job(cfg.checkpoint, step, state, save_options);
  };

  const bool speak = at.rank == 0;
  if (speak) {
    std::printf(
        "char_lm: %s, %zu bytes, vocabulary %lld; embedding and decoder on %s, "
        "LSTM(%lld->%lld) %s; %s steps %lld..%lld\n",
        corpus.name.c_str(), corpus.text.size(), static_cast<long long>(V), at.server().c_str(),
        static_cast<long long>(kEmbed), static_cast<long long>(kHidden),
        cfg.hybrid() ? ("on each of " + std::to_string(at.trainers) + " DDP trainers").c_str()
                     : "here",
        start > 0 ? "resuming," : "training", static_cast<long long>(start + 1),
        static_cast<long long>(cfg.steps));
    std::fflush(stdout);
  }

  double loss_value = 0;
  // Tokens of all trainers (they step together); worker0's loss.
  examples::Progress progress{cfg.steps,          cfg.log_every, cfg.losses,
                              resume.has_value(), started,       kBatch * kWindow * at.trainers};
  // Hybrid trainers agree over their group: each has a loss of its own.
  optim::NonFiniteGuard guard(optim::non_finite_from_string(cfg.on_nonfinite),
                              cfg.hybrid() ? tandem::ddp::default_group_ptr() : nullptr);
  for (int64_t step = start; step < cfg.steps; ++step) {
    Batch b = batch_at(corpus, cfg.seed, step * at.trainers + at.rank);
    poison_if_asked(cfg.nan_at, step, b);
    {
      dist::Context ctx;
      at::Tensor logits = m.forward(b.x).first;
      at::Tensor loss = char_loss(logits.reshape({-1, V}), b.y);
      dist::backward(ctx.id(), {loss});
      // Clipping scales every gradient of the context by one factor, from
      // the norm of all of them; hybrid trainers' remote gradients differ, so
      // their factors would too, and their LSTMs drift apart: not clipped
      // (their loss alone is checked).
      const double norm = cfg.hybrid() ? 0.0 : opt.clip_grad_norm(ctx.id(), 1.0);
      loss_value = loss.item<double>();
      const bool take = guard.check(step + 1, loss_value, norm);
      // Hybrid: no trainer steps the shared modules while another one's
      // backward still needs their values (autograd saved the decoder's and
      // the embedding's weights; a step in between fails that backward with
      // "modified by an inplace operation"), nor before another one's
      // forward has read them.
      if (cfg.hybrid()) tandem::ddp::barrier();
      if (take) opt.step(ctx.id());
      if (cfg.hybrid()) tandem::ddp::barrier();
    }
    const int64_t done = step + 1;
    if (speak) progress.add(done, loss_value);
    if (done % cfg.checkpoint_every == 0 || done == cfg.steps) checkpoint(done);
  }
  if (speak) examples::report_skipped(guard);
  if (cfg.hybrid()) {
    // Every trainer's LSTM against worker0's; and no trainer still steps
    // the shared modules while worker0 samples from them.
    const bool same =
        examples::same_on_every_rank(lstm->parameters(), tandem::ddp::default_group());
    if (!same) throw std::runtime_error("the trainers' LSTMs differ after training");
    if (!speak) return 0;
    std::printf("trainers' LSTMs identical\nfinal step %lld loss %.6f\n",
                static_cast<long long>(cfg.steps), loss_value);
  } else {
    std::printf("final step %lld loss %.6f  (checkpoint %s)\n", static_cast<long long>(cfg.steps),
                loss_value, cfg.checkpoint.c_str());
  }
  m.ddp = nullptr;  // sampling needs no gradients averaged
  std::printf(
      "sample: %s\n",
      generate(stateful(m), corpus, "The ", 200, 0.8, static_cast<uint64_t>(cfg.seed) + 1).c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace char_lm
