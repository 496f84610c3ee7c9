// The drivers' training loop (examples/gpt/train.h).
#include "examples/gpt/train.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "examples/gpt/batches.h"
#include "examples/progress.h"
#include "tandem/autograd/autograd.h"
#include "tandem/checkpoint/job.h"
#include "tandem/mesh/mesh.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/optim/lr_scheduler.h"
#include "tandem/parallel/collectives.h"
#include "tandem/pipeline/partition.h"
#include "tandem/pipeline/pipe.h"

namespace gpt {

namespace dist = tandem::autograd;
namespace optim = tandem::optim;
namespace pipeline = tandem::pipeline;

int64_t stage_count(const Config& cfg) {
  return cfg.schedule == "interleaved" ? 2 * cfg.pp : cfg.pp;
}

namespace {

// Layers per stage: measured on rank 0 (pipeline::balance_by_time, one
// micro-batch) and sent to the other drivers, so that every replica cuts
// the model alike; a resumed run of as many stages keeps its checkpoint's.
std::vector<int64_t> stage_counts(const Job& job, const std::vector<c10::IValue>& layers,
                                  Batches& batches) {
  const int64_t stages = stage_count(job.cfg);
  if (job.resume && static_cast<int64_t>(job.resume->counts.size()) == stages) {
    return job.resume->counts;
  }
  at::Tensor counts = at::zeros({stages}, at::kLong);
  if (job.mesh.rank() == 0) {
    const int64_t micro = std::max<int64_t>(1, job.cfg.batch / job.cfg.dp / job.cfg.chunks);
    at::Tensor sample = batches.at_step(0).first.narrow(0, 0, micro);
    const auto c = pipeline::balance_by_time(layers, static_cast<int>(stages), sample, 3);
    for (int64_t s = 0; s < stages; ++s) counts[s] = c[static_cast<size_t>(s)];
  }
  if (job.mesh.size("dp") > 1) job.mesh.group("dp")->broadcast(counts, 0);
  // (then from each replica's first tp rank to its others)
  if (job.mesh.size("tp") > 1) job.mesh.group("tp")->broadcast(counts, 0);
  std::vector<int64_t> out(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + stages);
  return out;
}

// fingerprint() of this pipe's stages' values (replica 0's: every
// replica's are the same). Collective over the tp drivers.
std::pair<double, double> stage_fingerprint(const std::vector<tandem::nn::RemoteModule>& stages,
                                            const std::vector<int64_t>& first_layer,
                                            const Named& whole, tandem::Mesh& mesh) {
  Named mine;
  for (size_t s = 0; s < stages.size(); ++s) {
    const auto part = stages[s].state_dict();
    add_stage_part(mine, Named(part.begin(), part.end()), first_layer[s]);
  }
  return fingerprint(mine, whole, mesh);
}

}  // namespace

std::pair<double, double> fingerprint(const Named& mine, const Named& whole, tandem::Mesh& mesh) {
  const int tp = mesh.size("tp"), tp_rank = mesh.coordinate("tp");
  at::Tensor sums = at::zeros({2}, at::kDouble);  // the squares, the dot product
  for (const auto& [name, value] : mine) {
    if (!tp_split(name) && tp_rank != 0) continue;
    at::Tensor r = at::randn(whole.at(name).sizes(),
                             at::detail::createCPUGenerator(examples::fnv1a(name)),
                             at::TensorOptions(at::kDouble));
    if (tp > 1) r = tp_piece(name, r, tp_rank, tp);
    const at::Tensor v = value.to(at::kDouble);
    sums[0] += v.pow(2).sum();
    sums[1] += (v * r).sum();
  }
  if (tp > 1) mesh.group("tp")->all_reduce(sums, tandem::ddp::ReduceOp::kSum);
  return {std::sqrt(sums[0].item<double>()), sums[1].item<double>()};
}

double lr_factor(const Config& cfg, int64_t step) {
  const double warmup = static_cast<double>(cfg.warmup), total = static_cast<double>(cfg.steps);
  const double s = static_cast<double>(step);
  if (s < warmup) return (s + 1) / warmup;
  const double t = std::min(1.0, (s - warmup) / std::max(1.0, total - warmup));
  return 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * t));
}

Checkpoint checkpoint_at(const Job& job, int64_t done) {
  const Config& cfg = job.cfg;
  Checkpoint ck;
  ck.step = done;
  ck.seed = cfg.seed;
  ck.corpus_fnv = job.corpus.fingerprint;
  ck.vocab = job.corpus.vocab;
  ck.shape = {cfg.layers, cfg.dim, cfg.heads, cfg.context};
  return ck;
}

int drive(const Job& job) {
  const Config& cfg = job.cfg;
  tandem::Mesh& mesh = job.mesh;
  const int64_t V = static_cast<int64_t>(job.corpus.vocab.size());
  const auto layers = layer_specs(cfg, V);
  Batches batches(job);
  const std::vector<int64_t> counts = stage_counts(job, layers, batches);

  // This replica's stages: stage s on the worker at pp = s % pp.
  std::vector<std::string> devices;
  std::vector<int> per_stage;
  for (size_t s = 0; s < counts.size(); ++s) {
    devices.push_back(mesh.worker_at({{"pp", static_cast<int>(s % static_cast<size_t>(cfg.pp))}}) +
                      "/cpu");
    per_stage.push_back(static_cast<int>(counts[s]));
  }
  // With --tp, each tp rank's driver runs a pipe of its own over the stage
  // workers of its tp coordinate, their layers split over each stage's tp
  // group: the tp pipes run the same schedule on the same batches, so each
  // stage's tp ranks run the same passes in the same order and meet in
  // their collectives; each sends its activations and gradients to its own
  // peer in the next stage (each gradient counted once, by its own pipe).
  const int tp = static_cast<int>(cfg.tp), tp_rank = mesh.coordinate("tp");
  const std::string tp_group = tp > 1 ? mesh.group_name("tp") : "";
  auto stages = pipeline::partition(layer_specs(cfg, V, tp_group), devices, per_stage);
  const Named whole = initial_parameters(cfg, V);
  std::vector<int64_t> first_layer;  // of each stage
  for (size_t s = 0, first = 0; s < stages.size(); first += per_stage[s], ++s) {
    const Named part = stage_part(whole, static_cast<int64_t>(first), per_stage[s]);
    stages[s].load_state_dict(tp > 1 ? tp_part(part, tp_rank, tp) : part);
    first_layer.push_back(static_cast<int64_t>(first));
  }

  pipeline::PipeOptions po;
  po.chunks = static_cast<int>(cfg.chunks);
  po.schedule = cfg.schedule;
  po.loss = tp > 1 ? tp_loss_name(tp_group, V) : kLoss;
  po.data_parallel_group = mesh.group_name("dp");
  pipeline::Pipe pipe(stages, po);
  optim::Options oo;
  oo.lr = cfg.lr;
  // --zero 1: each stage's state sharded over its replicas (the stage
  // workers of one pipeline stage form its dp group).
  optim::DistributedOptions sharding;
  if (cfg.zero == 1) sharding.shard_group = mesh.group_name("dp");
  optim::DistributedOptimizer opt(optim::Kind::kAdam, pipe.parameters(), oo, sharding);
  optim::LambdaLR sched(opt, [&cfg](int64_t step) { return lr_factor(cfg, step); });

  // The job's state, each piece saved and loaded where it lives and by the
  // whole model's names (checkpoint.h): the stages' layers by their stage
  // workers, Adam's state by the owners of its parameters (pipe.parameters()
  // is the model's parameters in order). One replica's copy is the job's;
  // sharded (--zero 1), every replica's owners write their share.
  std::vector<std::string> names;
  for (const auto& [name, shape] : parameter_order(cfg, V)) names.push_back(name);
  if (names.size() != pipe.parameters().size()) {
    throw std::logic_error("gpt: " + std::to_string(names.size()) + " parameter names for " +
                           std::to_string(pipe.parameters().size()) + " parameters");
  }
  // With --tp, each tp rank's stage workers write its slices of the split
  // parameters (and of their Adam state) under the whole ones' names
  // (checkpoint/placement.h), tp rank 0's the replicated ones, so a step
  // loads into any other split, or none.
  const int replica = mesh.coordinate("dp");
  const bool writes = replica == 0 || cfg.zero == 1;
  std::string vocab = job.corpus.vocab;
  tandem::checkpoint::JobState state(replica * tp + tp_rank);
  for (size_t s = 0; s < stages.size(); ++s) {
    state.remote_module("model", stages[s], first_layer[s], /*write=*/replica == 0);
  }
  state.distributed_optimizer("adam", opt, names, writes).record("vocab", &vocab);
  // Global-norm clipping over the whole model: with --tp each driver's
  // optimizer steps its slices of the split parameters and a copy of the
  // replicated ones; the norm sums the slices over the tp drivers and counts
  // a replicated parameter on tp rank 0 only.
  optim::DistributedOptimizer::ClipOptions clip;
  if (tp > 1) {
    clip.group = mesh.group("tp");
    for (const auto& name : names) clip.counted.push_back(tp_split(name) || tp_rank == 0);
  }
  int64_t start = 0;
  if (job.resume) {
    tandem::checkpoint::Reader reader(job.resume->path);
    state.load(reader);
    start = job.resume->step;
    sched.load_state({start, cfg.lr});
    if (mesh.rank() == 0) {
      std::printf(
          "gpt: step %lld restored where it lives: %zu stages' layers and their Adam state "
          "loaded by name (saved in %d parts, %lld stages)\n",
          static_cast<long long>(start), stages.size(), reader.world_size(),
          static_cast<long long>(job.resume->counts.size()));
    }
  }

  const bool speak = mesh.rank() == 0;
  if (speak) {
    const std::string layout =
        std::to_string(cfg.pp) + " x " + std::to_string(cfg.dp) +
        (tp > 1 ? " x " + std::to_string(tp) + " (pp x dp x tp)" : " (pp x dp)");
    std::printf(
        "gpt: %s, %zu bytes, vocabulary %lld; %lld parameters (%lld blocks of %lld, %lld "
        "heads, context %lld); %s%s, %s, %lld micro-batches of %lld; layers per stage",
        job.corpus.name.c_str(), job.corpus.text.size(), static_cast<long long>(V),
        static_cast<long long>(parameter_count(whole)), static_cast<long long>(cfg.layers),
        static_cast<long long>(cfg.dim), static_cast<long long>(cfg.heads),
        static_cast<long long>(cfg.context), layout.c_str(),
        cfg.recompute ? ", blocks recomputed in backward" : "", cfg.schedule.c_str(),
        static_cast<long long>(cfg.chunks),
        static_cast<long long>(cfg.batch / cfg.dp / cfg.chunks));
    for (int64_t c : counts) std::printf(" %lld", static_cast<long long>(c));
    std::printf("; steps %lld..%lld\n", static_cast<long long>(start + 1),
                static_cast<long long>(cfg.steps));
    std::fflush(stdout);
  }

  examples::Progress progress{cfg.steps,   cfg.log_every,
                              cfg.losses,  job.resume.has_value(),
                              job.started, cfg.batch * cfg.context};
  const auto dp = mesh.size("dp") > 1 ? mesh.group("dp") : nullptr;
  double loss = 0;
  // The drivers that save: replica 0's, or (--zero 1) every replica's,
  // together over a group of their own (its collectives run on the saver's
  // thread, beside training's).
  std::optional<Saver> saver;
  std::optional<tandem::Mesh> savers;
  tandem::checkpoint::SaveOptions save_options;
  if (writes) {
    Checkpoint meta = checkpoint_at(job, 0);
    meta.counts = counts;
    save_options.meta = checkpoint_meta(meta);
    // (the drivers that write: replica 0's tp ranks, or with --zero 1
    // every replica's, in the order of their JobState ranks)
    const int replicas = cfg.zero == 1 ? static_cast<int>(cfg.dp) : 1;
    if (replicas * tp > 1) {
      tandem::MeshOptions mo;
      mo.name = "gpt-checkpoints";
      for (int d = 0; d < replicas; ++d) {
        for (int t = 0; t < tp; ++t) mo.ranks.push_back(mesh.rank_at(std::vector<int>{0, d, t}));
      }
      mo.timeout = std::chrono::minutes(2);
      savers.emplace(tandem::Mesh::Shape{{"savers", replicas * tp}}, mo);
      save_options.group = savers->group("savers");
    }
    saver.emplace(cfg.checkpoint, cfg.checkpoint_sync);
  }
  const int64_t last = cfg.stop_at > 0 ? cfg.stop_at : cfg.steps;
  // Every replica decides alike: on the loss averaged over the replicas and
  // the norm of their averaged gradients.
  tandem::optim::NonFiniteGuard guard(tandem::optim::non_finite_from_string(cfg.on_nonfinite));
  for (int64_t step = start; step < last; ++step) {
    auto [x, y] = batches.at_step(step);
    poison_if_asked(cfg, step, x);
    {
      dist::Context ctx;
      loss = pipe.step(ctx.id(), x, y);
      const double norm = opt.clip_grad_norm(ctx.id(), cfg.clip, clip);
      if (dp) {  // the mean over the replicas: the global batch's loss
        at::Tensor l = at::tensor({loss}, at::kDouble);
        dp->all_reduce(l, tandem::ddp::ReduceOp::kAvg);
        loss = l.item<double>();
      }
      // (a skipped step's gradients go with its context)
      if (guard.check(step + 1, loss, norm)) opt.step(ctx.id());
    }
    // The rate is a function of the step (what a resumed run restores), so
    // it moves on past a skipped step too.
    sched.step();
    const bool saving = (step + 1) % cfg.checkpoint_every == 0 || step + 1 == last;
    if (saving && saver) saver->save(step + 1, state, save_options);
    if (speak) progress.add(step + 1, loss);
  }
  if (saver) saver->finish();
  std::pair<double, double> print;
  if (replica == 0) print = stage_fingerprint(stages, first_layer, whole, mesh);
  // With --tp the sample takes replica 0's tp drivers together: each
  // pipe's forward meets the others' in its collectives, and each gives
  // its words' logits, gathered here.
  const bool samples = cfg.sample > 0 && last == cfg.steps && (tp > 1 ? replica == 0 : speak);
  std::string sample;
  if (samples) {
    for (const auto& s : stages) s.eval();  // (no dropout)
    // Each new character: the last `context` ones through every stage.
    std::vector<int64_t> seen;
    // (all_gather takes one size: the largest piece, rank 0's)
    const int64_t most = tandem::parallel::range_of(V, 0, tp).length;
    auto next = [&](const at::Tensor& ids) {
      for (int64_t i = 0; i < ids.numel(); ++i) seen.push_back(ids.view(-1)[i].item<int64_t>());
      const size_t from =
          seen.size() > static_cast<size_t>(cfg.context) ? seen.size() - cfg.context : 0;
      std::vector<int64_t> window(seen.begin() + static_cast<std::ptrdiff_t>(from), seen.end());
      const int64_t length = static_cast<int64_t>(window.size());
      // (with --sequence-parallel, padded at the end to a length the tp
      // ranks split: causal attention keeps the padding from the others)
      if (cfg.sequence_parallel) window.resize(static_cast<size_t>((length + tp - 1) / tp * tp), 0);
      at::Tensor mine = pipe.forward(at::tensor(window).view({1, -1}))[0][length - 1];
      if (tp == 1) return mine;
      const at::Tensor padded = at::zeros({most}, mine.options());
      padded.narrow(0, 0, mine.size(0)).copy_(mine);
      const auto pieces = mesh.group("tp")->all_gather(padded);
      std::vector<at::Tensor> words;
      for (int r = 0; r < tp; ++r) {
        words.push_back(pieces[static_cast<size_t>(r)].narrow(0, 0, tandem::parallel::range_of(V, r, tp).length));
      }
      return at::cat(words);
    };
    sample = examples::generate(next, job.corpus, "The ", static_cast<int>(cfg.sample), 0.8,
                                static_cast<uint64_t>(cfg.seed) + 1);
  }
  if (speak) {
    std::printf("%s\n", saver->summary().c_str());
    examples::report_skipped(guard);
    std::printf("final step %lld loss %.6f\n", static_cast<long long>(last), loss);
    std::printf("parameters: norm %.9g projection %.9g\n", print.first, print.second);
    if (samples) std::printf("sample: %s\n", sample.c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace gpt
