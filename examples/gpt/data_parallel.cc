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
// the losses are that path's (to float rounding). The checkpoint holds the
// model (gathered to rank 0) and no optimizer state: --resume is refused
// with --zero 2 or 3 (main.cc).
#include <ATen/ops/tensor.h>
#include <torch/optim/adam.h>

#include <cstdio>

#include "examples/gpt/batches.h"
#include "examples/gpt/model.h"
#include "examples/progress.h"
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
  std::shared_ptr<StackImpl> model = whole_model(cfg, V, initial_parameters(cfg, V));

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
        "%lld ranks data-parallel, %s; steps 1..%lld\n",
        job.corpus.name.c_str(), job.corpus.text.size(), static_cast<long long>(V),
        static_cast<long long>(cfg.layers), static_cast<long long>(cfg.dim),
        static_cast<long long>(cfg.heads), static_cast<long long>(cfg.context),
        static_cast<long long>(cfg.dp),
        cfg.zero == 2 ? "ZeRO stage 2 (sharded optimizer state and gradients)"
                      : "ZeRO stage 3 (FullyShardedDataParallel, a unit a block)",
        static_cast<long long>(cfg.steps));
    std::fflush(stdout);
  }
  examples::Progress progress{cfg.steps,  cfg.log_every, cfg.losses,
                              cfg.resume, job.started,   cfg.batch * cfg.context};
  std::optional<Saver> saver;
  if (speak) saver.emplace(cfg.checkpoint, cfg.checkpoint_sync);
  auto save = [&](int64_t done) {
    if (speak) saver->begin();
    // Collective for FSDP (the shards gathered to rank 0).
    std::vector<std::pair<std::string, at::Tensor>> params;
    if (fsdp) {
      params = fsdp->full_state_dict(0);
    } else if (speak) {
      for (const auto& item : model->named_parameters()) {
        params.emplace_back(item.key(), item.value().detach().clone());
      }
    }
    if (!speak) return;
    Checkpoint ck = checkpoint_at(job, done);
    ck.counts = {cfg.layers + 2};
    for (auto& [name, t] : params) ck.model[name] = t;
    ck.optim.kind = optim::Kind::kAdam;
    ck.optim.lr = cfg.lr;
    saver->save(ck);
  };
  double loss = 0;
  const int64_t last = cfg.stop_at > 0 ? cfg.stop_at : cfg.steps;
  for (int64_t step = 0; step < last; ++step) {
    auto [x, y] = batches.at_step(step);
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
    at::Tensor l = gpt::loss(logits, y);
    l.backward();
    loss = l.item<double>();
    if (zero) {
      zero->clip_grad_norm(cfg.clip);
      zero->step();
      zero->zero_grad();
    } else {
      fsdp->clip_grad_norm(cfg.clip);
      adam->step();
      adam->zero_grad();
    }
    at::Tensor mean = at::tensor({loss}, at::kDouble);
    if (group->size() > 1) group->all_reduce(mean, ddp::ReduceOp::kAvg);
    loss = mean.item<double>();
    if (speak) progress.add(step + 1, loss);
    if ((step + 1) % cfg.checkpoint_every == 0 || step + 1 == last) save(step + 1);
  }
  if (speak) {
    saver->finish();
    std::printf("%s\n", saver->summary().c_str());
    std::printf("final step %lld loss %.6f\n", static_cast<long long>(last), loss);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace gpt
