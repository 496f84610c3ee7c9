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
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/optim/lr_scheduler.h"
#include "tandem/optim/reshard.h"
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

// Which parameters each stage worker's optimizer steps, in its order, when
// the model is cut into `counts` stages over `workers` workers (stage s on
// worker s % workers): the layout a checkpoint's optimizer state is cut by.
std::vector<optim::OwnerLayout> owner_layouts(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& order,
    const std::vector<int64_t>& counts, int64_t workers) {
  std::vector<optim::OwnerLayout> out(static_cast<size_t>(workers));
  for (int64_t w = 0; w < workers; ++w) out[static_cast<size_t>(w)].rank = static_cast<int>(w);
  int64_t first = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    optim::OwnerLayout& o = out[s % static_cast<size_t>(workers)];
    for (const auto& [name, shape] : order) {
      const int64_t layer = std::stoll(name.substr(0, name.find('.')));
      if (layer >= first && layer < first + counts[s]) {
        o.names.push_back(name);
        o.shapes.push_back(shape);
      }
    }
    first += counts[s];
  }
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
  const Named whole = job.resume ? job.resume->model : initial_parameters(cfg, V);
  for (size_t s = 0, first = 0; s < stages.size(); first += per_stage[s], ++s) {
    stages[s].load_state_dict(stage_part(whole, static_cast<int64_t>(first), per_stage[s]));
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
  int64_t start = 0;
  if (job.resume) {
    // Replica 0's state, its parts given to this replica's stage workers;
    // cut again by parameter names where this job places the layers on
    // other stages or workers than the checkpoint's.
    optim::OptimizerState state = job.resume->optim;
    const int64_t saved_workers = static_cast<int64_t>(state.parts.size());
    if (job.resume->counts != counts || saved_workers != cfg.pp) {
      const auto order = parameter_order(cfg, V);
      state = optim::reshard_state(state, owner_layouts(order, job.resume->counts, saved_workers),
                                   owner_layouts(order, counts, cfg.pp), oo);
      if (mesh.rank() == 0) {
        std::printf(
            "gpt: the checkpoint's optimizer state (%lld stages on %lld workers) cut "
            "again for %zu stages on %lld\n",
            static_cast<long long>(job.resume->counts.size()),
            static_cast<long long>(saved_workers), counts.size(), static_cast<long long>(cfg.pp));
      }
    }
    for (auto& part : state.parts) {
      const int stage_worker = part.rank;
      part.rank = mesh.rank_at({{"pp", stage_worker}});
      part.worker = mesh.worker_at({{"pp", stage_worker}});
    }
    opt.load_state_dict(state);
    start = job.resume->step;
    sched.load_state({start, cfg.lr});
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
  std::optional<Saver> saver;
  if (speak) saver.emplace(cfg.checkpoint, cfg.checkpoint_sync);
  auto save = [&](int64_t done, optim::OptimizerState state) {
    Checkpoint ck = checkpoint_at(job, done);
    ck.counts = counts;
    for (size_t s = 0, first = 0; s < stages.size(); first += per_stage[s], ++s) {
      add_stage_part(ck.model, stages[s].state_dict(), static_cast<int64_t>(first));
    }
    ck.optim = std::move(state);
    // Each owner's rank becomes its index among this replica's stage workers.
    const std::vector<int> stage_workers = mesh.ranks_along("pp");
    for (auto& part : ck.optim.parts) {
      part.rank = static_cast<int>(
          std::find(stage_workers.begin(), stage_workers.end(), part.rank) - stage_workers.begin());
    }
    saver->save(ck);
  };
  const int64_t last = cfg.stop_at > 0 ? cfg.stop_at : cfg.steps;
  for (int64_t step = start; step < last; ++step) {
    auto [x, y] = batches.at_step(step);
    {
      dist::Context ctx;
      loss = pipe.step(ctx.id(), x, y);
      opt.clip_grad_norm(ctx.id(), cfg.clip);
      opt.step(ctx.id());
    }
    sched.step();
    if (dp) {  // the mean over the replicas: the global batch's loss
      at::Tensor l = at::tensor({loss}, at::kDouble);
      dp->all_reduce(l, tandem::ddp::ReduceOp::kAvg);
      loss = l.item<double>();
    }
    const bool saving = (step + 1) % cfg.checkpoint_every == 0 || step + 1 == last;
    // Sharded, the state is gathered by every replica at once (it lands on
    // replica 0's, which writes the file).
    optim::OptimizerState state;
    if (saving && speak) saver->begin();  // (gathering the state is part of the copy)
    if (saving && (speak || cfg.zero == 1)) state = opt.state_dict();
    if (speak) {
      progress.add(step + 1, loss);
      if (saving) save(step + 1, std::move(state));
    }
  }
  if (speak) {
    saver->finish();
    std::printf("%s\n", saver->summary().c_str());
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
