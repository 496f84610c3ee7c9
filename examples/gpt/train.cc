// The drivers' training loop (examples/gpt/train.h).
#include "examples/gpt/train.h"

#include <ATen/ops/arange.h>
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
  std::vector<int64_t> out(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + stages);
  return out;
}

}  // namespace

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
  auto stages = pipeline::partition(layers, devices, per_stage);
  const Named whole = initial_parameters(cfg, V);
  std::vector<int64_t> first_layer;  // of each stage
  for (size_t s = 0, first = 0; s < stages.size(); first += per_stage[s], ++s) {
    stages[s].load_state_dict(stage_part(whole, static_cast<int64_t>(first), per_stage[s]));
    first_layer.push_back(static_cast<int64_t>(first));
  }

  pipeline::PipeOptions po;
  po.chunks = static_cast<int>(cfg.chunks);
  po.schedule = cfg.schedule;
  po.loss = kLoss;
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
  const int replica = mesh.coordinate("dp");
  const bool writes = replica == 0 || cfg.zero == 1;
  std::string vocab = job.corpus.vocab;
  tandem::checkpoint::JobState state(replica);
  for (size_t s = 0; s < stages.size(); ++s) {
    state.remote_module("model", stages[s], first_layer[s], /*write=*/replica == 0);
  }
  state.distributed_optimizer("adam", opt, names, writes).record("vocab", &vocab);
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
    std::printf(
        "gpt: %s, %zu bytes, vocabulary %lld; %lld parameters (%lld blocks of %lld, %lld "
        "heads, context %lld); %lld x %lld (pp x dp), %s, %lld micro-batches of %lld; layers "
        "per stage",
        job.corpus.name.c_str(), job.corpus.text.size(), static_cast<long long>(V),
        static_cast<long long>(parameter_count(whole)), static_cast<long long>(cfg.layers),
        static_cast<long long>(cfg.dim), static_cast<long long>(cfg.heads),
        static_cast<long long>(cfg.context), static_cast<long long>(cfg.pp),
        static_cast<long long>(cfg.dp), cfg.schedule.c_str(), static_cast<long long>(cfg.chunks),
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
    if (cfg.zero == 1 && cfg.dp > 1) {
      tandem::MeshOptions mo;
      mo.name = "gpt-checkpoints";
      mo.ranks = mesh.ranks_along("dp");
      mo.timeout = std::chrono::minutes(2);
      savers.emplace(tandem::Mesh::Shape{{"dp", static_cast<int>(cfg.dp)}}, mo);
      save_options.group = savers->group("dp");
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
      const double norm = opt.clip_grad_norm(ctx.id(), cfg.clip);
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
  if (speak) {
    std::printf("%s\n", saver->summary().c_str());
    examples::report_skipped(guard);
    std::printf("final step %lld loss %.6f\n", static_cast<long long>(last), loss);
    if (cfg.sample > 0 && last == cfg.steps) {
      // Each new character: the last `context` ones through every stage.
      std::vector<int64_t> seen;
      auto next = [&](const at::Tensor& ids) {
        for (int64_t i = 0; i < ids.numel(); ++i) seen.push_back(ids.view(-1)[i].item<int64_t>());
        const size_t from =
            seen.size() > static_cast<size_t>(cfg.context) ? seen.size() - cfg.context : 0;
        std::vector<int64_t> window(seen.begin() + static_cast<std::ptrdiff_t>(from), seen.end());
        return pipe.forward(at::tensor(window).view({1, -1}))[0][-1];
      };
      std::printf("sample: %s\n",
                  examples::generate(next, job.corpus, "The ", static_cast<int>(cfg.sample), 0.8,
                                     static_cast<uint64_t>(cfg.seed) + 1)
                      .c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace gpt
