// gpt's sharded data-parallel path (examples/gpt/train.h): --zero 2 or 3
// with --pp 1. Every rank holds the whole model (a Sequential of the
// layers, model.h) and trains on its share of each step's global batch:
//   --zero 2: DistributedDataParallel with sharded gradients and a
//             ZeroRedundancyOptimizer (Adam) over the dp group;
//   --zero 3: FullyShardedDataParallel over the dp group, each block a
//             unit (the embeddings and the head the root unit), LibTorch's
//             Adam over the shards.
// (The model is model.h's StackImpl: its layers run by their factories'
// forwards, so FSDP runs it through forward(fn) and run().) The same Adam,
// clipping, schedule and batches as the pipeline's path, so
// the losses are that path's (to float rounding). Checkpoints are a
// checkpoint::JobState, every rank its part: with --zero 2 the model once
// (rank 0) and each rank its share of Adam's state; with --zero 3 each rank
// the slices of every parameter its shards hold, and their Adam state. Both
// hold the pipeline's names, so each resumes on any number of ranks, in
// either stage, or as a pipeline (checkpoint.h). With --tp, each tp rank's
// replicas shard that rank's split of the model over its dp group (the
// loss vocabulary-parallel, clipping summed over the tp group too), and
// its parts hold its pieces as slices of the whole parameters.
#include <ATen/ops/tensor.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "examples/gpt/batches.h"
#include "examples/gpt/checkpoint.h"
#include "examples/gpt/model.h"
#include "examples/progress.h"
#include "tandem/checkpoint/job.h"
#include "tandem/checkpoint/placement.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/ddp/fully_sharded.h"
#include "tandem/optim/zero_redundancy_optimizer.h"

namespace gpt {

namespace ddp = tandem::ddp;
namespace optim = tandem::optim;

int drive_data_parallel(const Job& job) {
  const Config& cfg = job.cfg;
  tandem::Mesh& mesh = job.mesh;
  const int64_t V = static_cast<int64_t>(job.corpus.vocab.size());
  Batches batches(job);
  const std::shared_ptr<ddp::ProcessGroup> group = mesh.group("dp");
  // With --tp, each tp rank's replicas shard its split of the model over
  // dp: the model is that rank's pieces (tp_part), its layers split over
  // the mesh's tp group.
  const int tp = static_cast<int>(cfg.tp), tp_rank = mesh.coordinate("tp");
  const std::string tp_group = tp > 1 ? mesh.group_name("tp") : "";
  const Named initial = initial_parameters(cfg, V);
  std::shared_ptr<StackImpl> model =
      whole_model(cfg, V, tp > 1 ? tp_part(initial, tp_rank, tp) : initial, tp_group);
  // Global-norm clipping over the whole model: with --tp the squares are
  // summed over the tp group too, a replicated parameter counted by its
  // copy 0 only (checkpoint::replica_of).
  ddp::ClipOptions clip;
  if (tp > 1) {
    clip.group = mesh.group("tp");
    clip.counted = [](const at::Tensor& p) { return tandem::checkpoint::replica_of(p) == 0; };
  }

  // --zero 2
  std::unique_ptr<optim::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<ddp::DistributedDataParallel<StackImpl>> ddp_model;
  // --zero 3
  std::unique_ptr<ddp::FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::Adam> adam;
  if (cfg.zero == 2) {
    optim::Options oo;
    oo.lr = cfg.lr;
    optim::ZeroOptions zo;
    zo.group = group;
    zero = std::make_unique<optim::ZeroRedundancyOptimizer>(model->parameters(), optim::Kind::kAdam,
                                                            oo, zo);
    ddp::DDPOptions d;
    d.gradient_owner = zero->gradient_owner();
    ddp_model = std::make_unique<ddp::DistributedDataParallel<StackImpl>>(model, d, group);
  } else {
    ddp::FSDPOptions fo;
    for (int64_t b = 1; b <= cfg.layers; ++b) fo.units.push_back(std::to_string(b));
    fsdp = std::make_unique<ddp::FullyShardedDataParallel>(model, fo, group);
    adam =
        std::make_unique<torch::optim::Adam>(fsdp->parameters(), torch::optim::AdamOptions(cfg.lr));
  }
  auto set_lr = [&](double lr) {
    if (zero) {
      zero->set_lr(lr);
    } else {
      for (auto& g : adam->param_groups()) g.options().set_lr(lr);
    }
  };

  const bool speak = mesh.rank() == 0;
  if (speak) {
    std::printf(
        "gpt: %s, %zu bytes, vocabulary %lld; %lld blocks of %lld, %lld heads, context %lld; "
        "%lld ranks data-parallel%s, %s; steps 1..%lld\n",
        job.corpus.name.c_str(), job.corpus.text.size(), static_cast<long long>(V),
        static_cast<long long>(cfg.layers), static_cast<long long>(cfg.dim),
        static_cast<long long>(cfg.heads), static_cast<long long>(cfg.context),
        static_cast<long long>(cfg.dp),
        tp > 1 ? (" x " + std::to_string(tp) + " tensor-parallel").c_str() : "",
        cfg.zero == 2 ? "ZeRO stage 2 (sharded optimizer state and gradients)"
                      : "ZeRO stage 3 (FullyShardedDataParallel, a unit a block)",
        static_cast<long long>(cfg.steps));
    std::fflush(stdout);
  }
  examples::Progress progress{cfg.steps,   cfg.log_every,
                              cfg.losses,  job.resume.has_value(),
                              job.started, cfg.batch * cfg.context};
  // Every rank writes its own part of each step, in the background, over a
  // group of the saver's own (its collectives run beside training's): with
  // --zero 2 the model once and its share of Adam's state, with --zero 3 its
  // shards' slices of each parameter and of its state. A resumed or
  // restarted run loads it back by names, on any number of ranks.
  std::string vocab = job.corpus.vocab;
  // (a part a rank of the mesh; with --tp each tp rank's pieces under the
  // whole model's names: checkpoint/placement.h)
  tandem::checkpoint::JobState state(mesh.rank());
  if (zero) {
    std::vector<std::string> names;
    for (const auto& p : model->named_parameters()) names.push_back(p.key());
    state.module("model", *model, /*write=*/group->rank() == 0).optimizer("adam", *zero, names);
  } else {
    state.module("model", *fsdp).optimizer("adam", *adam, *fsdp);
  }
  state.record("vocab", &vocab);
  ddp::ProcessGroupOptions go;
  go.group_name = "gpt-checkpoints";
  go.timeout = std::chrono::minutes(2);  // as the mesh's: a dead peer fails a save loudly
  tandem::checkpoint::SaveOptions so;
  so.group = ddp::ProcessGroup::create(go);
  Checkpoint meta = checkpoint_at(job, 0);
  meta.counts = {cfg.layers + 2};
  meta.mode = zero ? "zero2" : "zero3";
  so.meta = checkpoint_meta(meta);
  int64_t start = 0;
  if (job.resume) {
    // (the step main.cc chose and checked: the newest whole one)
    tandem::checkpoint::Reader reader(job.resume->path);
    state.load(reader);
    start = reader.step();
    if (speak) {
      std::printf("gpt: resumed from step %lld, %s\n", static_cast<long long>(start),
                  zero ? "each rank's share of Adam's state by name"
                       : "each rank's shards from the parameters' slices by name");
    }
  }
  check_directory(cfg.checkpoint);
  tandem::checkpoint::AsyncSaver saver(cfg.checkpoint, so);
  std::vector<double> stall_ms;
  auto save = [&](int64_t done) {
    const auto t0 = Clock::now();
    saver.save(done, state.part());
    if (cfg.checkpoint_sync) saver.wait();
    stall_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  };
  double loss = 0;
  const int64_t last = cfg.stop_at > 0 ? cfg.stop_at : cfg.steps;
  // Every rank decides alike: on the loss averaged over the ranks and the
  // norm of the whole model's averaged gradients.
  tandem::optim::NonFiniteGuard guard(tandem::optim::non_finite_from_string(cfg.on_nonfinite));
  for (int64_t step = start; step < last; ++step) {
    auto [x, y] = batches.at_step(step);
    poison_if_asked(cfg, step, x);
    set_lr(cfg.lr * lr_factor(cfg, step));
    at::Tensor logits;
    if (zero) {
      logits = (*ddp_model)(x);
    } else {
      // The embeddings and the head are the root unit; each block a unit.
      logits = fsdp->forward([&] {
        at::Tensor h = model->forward_layer(0, x);
        for (int64_t b = 1; b <= cfg.layers; ++b) {
          h = fsdp->run(std::to_string(b), [&] { return model->forward_layer(b, h); });
        }
        return model->forward_layer(static_cast<size_t>(cfg.layers) + 1, h);
      });
    }
    at::Tensor l = tp > 1 ? tp_loss(logits, y, V, tp_group) : gpt::loss(logits, y);
    l.backward();
    loss = l.item<double>();
    at::Tensor mean = at::tensor({loss}, at::kDouble);
    if (group->size() > 1) group->all_reduce(mean, ddp::ReduceOp::kAvg);
    loss = mean.item<double>();
    const double norm =
        zero ? zero->clip_grad_norm(cfg.clip, clip) : fsdp->clip_grad_norm(cfg.clip, clip);
    if (guard.check(step + 1, loss, norm)) {
      if (zero) {
        zero->step();
      } else {
        adam->step();
      }
    }
    if (zero) {
      zero->zero_grad();
    } else {
      adam->zero_grad();
    }
    if (speak) progress.add(step + 1, loss);
    if ((step + 1) % cfg.checkpoint_every == 0 || step + 1 == last) save(step + 1);
  }
  saver.wait();
  // The parameters as every layout prints them (train.h): --zero 3's
  // gathered to each tp rank's first replica.
  Named mine;
  if (zero) {
    for (const auto& p : model->named_parameters()) mine[p.key()] = p.value().detach();
  } else {
    for (auto& [name, t] : fsdp->full_state_dict(0)) mine[name] = t;
  }
  const std::pair<double, double> print = fingerprint(mine, initial, mesh);
  if (speak) {
    std::sort(stall_ms.begin(), stall_ms.end());
    std::printf(
        "%zu checkpoint(s), each rank its part, %s to %s; a save held its step %.2f "
        "ms (median)\n",
        stall_ms.size(), cfg.checkpoint_sync ? "written in the step" : "written in the background",
        cfg.checkpoint.c_str(), stall_ms.empty() ? 0.0 : stall_ms[stall_ms.size() / 2]);
    examples::report_skipped(guard);
    std::printf("final step %lld loss %.6f\n", static_cast<long long>(last), loss);
    std::printf("parameters: norm %.9g projection %.9g\n", print.first, print.second);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace gpt
