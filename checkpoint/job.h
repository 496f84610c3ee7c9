#pragma once
// A job's state in one call: what each rank holds, registered once by name,
// saved as that rank's part of a step (checkpoint.h) and loaded back by the
// same names, into the same layout or another.
//
//   checkpoint::JobState state(group->rank());
//   state.module("model", *net, /*write=*/group->rank() == 0)  // one copy is the job's
//        .optimizer("adam", zero, names)                       // each rank its share
//        .sampler("data", sampler)
//        .random()                                             // every rank's generator
//        .record("step", &step_text);
//   checkpoint::save_job(dir, step, state, options);           // collective
//   ...
//   if (auto step = checkpoint::load_latest_job(dir, state)) { ... }
//
// What it promises:
//  1. Names are global: a module's tensors are "<prefix>.<name>", an
//     optimizer's state is "<prefix>/<parameter name>" per parameter
//     (optim/param_state.h), whoever held them. So a state saved with
//     ZeroRedundancyOptimizer on 2 ranks loads into ZeroRedundancyOptimizer
//     on 3, or into a plain LibTorch optimizer on 1, and goes on exactly.
//     FullyShardedDataParallel's ranks write each parameter's pieces as
//     flat slices of those names ("<prefix>.<name>#<start>:<end>", with
//     the parameter's shape and the other names of a shared parameter
//     beside them: checkpoint/slices.h); every loader takes a tensor or a
//     state whole or from its slices, so FSDP on 2 ranks goes on with FSDP
//     on 3, ZeRO, or one process, and back.
//  2. load() checks every registered piece before it changes anything: one
//     the step does not hold, holds in another shape, or holds in a part
//     that fails its checks (size, checksum), and an optimizer state that
//     does not decode for the optimizer's kind, is refused by name with
//     nothing loaded. (A RemoteModule's or a DistributedOptimizer's owner
//     checks its own piece; a failure there leaves the local pieces as
//     they were.) A parameter of no elements needs nothing in the step.
//  3. Pieces written by one rank (`write` false elsewhere, a sampler, a
//     record, a schedule: rank 0) are read by every rank. A random
//     generator is each rank's own ("<name>/<rank>"); a rank the step has
//     none for (more ranks than were saved) keeps its own.
//  4. A sampler is saved as its epoch and the share of the epoch the job
//     has gone through (each rank's position times the replicas; "end" for
//     the whole epoch): it loads on another number of replicas when that
//     share divides among them (else std::invalid_argument, naming both).
//     The position is what next() handed out: a loader that fetches ahead
//     saves a place ahead of what was trained on.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/checkpoint/checkpoint.h"

namespace tandem::ddp {
class DistributedSampler;
class FullyShardedDataParallel;
}  // namespace tandem::ddp
namespace tandem::nn {
class RemoteModule;
}
namespace tandem::optim {
class ZeroRedundancyOptimizer;
class LRScheduler;
class DistributedOptimizer;
}  // namespace tandem::optim

namespace tandem::checkpoint {

class Slices;  // checkpoint/slices.h

class JobState {
 public:
  // `rank`: this process's rank in the group that saves (0 alone).
  explicit JobState(int rank = 0);

  // Every parameter and buffer of `m`; `write`: whether this rank's copy
  // goes into the checkpoint (one copy is the job's: a DDP replica's).
  JobState& module(const std::string& prefix, torch::nn::Module& m, bool write = true);
  // A LibTorch optimizer's state, per parameter: `params` names the tensors
  // it steps.
  JobState& optimizer(const std::string& prefix, torch::optim::Optimizer& optimizer,
                      std::vector<std::pair<std::string, at::Tensor>> params, bool write = true);
  // ZeroRedundancyOptimizer: each rank writes the state of the parameters
  // it owns and loads the state of those it owns now. `names`: its params()'
  // names, in order. Its learning rate travels too (rank 0's).
  JobState& optimizer(const std::string& prefix, optim::ZeroRedundancyOptimizer& optimizer,
                      std::vector<std::string> names);
  // A FullyShardedDataParallel model: each rank writes, of every parameter
  // its shard holds a piece of, that piece as "<prefix>.<name>#<start>:<end>"
  // (its flattened elements [start, end); with HSDP the replicate group's
  // rank 0 alone), and this rank's buffers if it is rank 0. It loads on any
  // number of ranks, each taking the pieces its shard overlaps, from such
  // slices or from a whole "<prefix>.<name>" (module(), ZeRO, a pipeline's
  // stages); module() loads the slices too. `f` must outlive the JobState.
  JobState& module(const std::string& prefix, ddp::FullyShardedDataParallel& f);
  // The optimizer over f.parameters() (LibTorch's SGD, Adam, AdamW, Adagrad,
  // RMSprop): each shard's state cut by parameter as module(f) cuts the
  // shard ("<prefix>/<name>#<start>:<end>", each the state of a parameter of
  // [end - start]), so that it loads into FSDP on another number of ranks,
  // and into ZeRO or a plain optimizer, and back. Elements of a shard no
  // saved state covers (a parameter that had none) start from zeros, with
  // the other pieces' step count.
  JobState& optimizer(const std::string& prefix, torch::optim::Optimizer& optimizer,
                      ddp::FullyShardedDataParallel& f);
  JobState& sampler(const std::string& name, ddp::DistributedSampler& sampler);
  // A DistributedOptimizer's schedule (its last epoch and base rate).
  JobState& scheduler(const std::string& name, optim::LRScheduler& scheduler);
  // This rank's CPU random generator, and each visible GPU's
  // ("<name>/<rank>/cuda<i>").
  JobState& random(const std::string& name = "rng");
  // A RemoteModule's parameters and buffers as "<prefix>.<name>", written
  // into a part of its own and read back by its owner (checkpoint/remote.h),
  // so a model spread over workers is saved by them in parallel. The module
  // must outlive the JobState.
  // `first_layer` >= 0: a pipeline stage, saved by the model's layer
  // indices (checkpoint/remote.h), so it loads into another cut.
  JobState& remote_module(const std::string& prefix, const nn::RemoteModule& m,
                          int64_t first_layer = -1, bool write = true);
  // A DistributedOptimizer's state, per parameter "<prefix>/<name>",
  // written and loaded by its owners (`names`: its parameters' names in the
  // constructor's order), so it loads into another placement.
  JobState& distributed_optimizer(const std::string& prefix, optim::DistributedOptimizer& opt,
                                  std::vector<std::string> names, bool write = true);
  // Bytes of the caller's (a step count, metrics), written by rank 0.
  JobState& record(const std::string& name, std::string* bytes);

  int rank() const { return rank_; }
  // What this rank writes, copied now.
  Part part() const;
  // The parts written for this rank elsewhere (its remote modules').
  std::vector<RemotePartWriter> remote_writers() const;
  // Every registered piece from `reader`'s step.
  void load(const Reader& reader);

 private:
  struct Item {
    std::function<void(Part&)> write;
    std::function<void(const Slices&)> verify;  // throws before anything is read
    std::function<void(const Slices&)> read;
    std::vector<RemotePartWriter> remote;  // the parts other workers write of it
  };
  std::vector<Item> items_;
  int rank_;
};

// checkpoint::save_parts of state.part() and state.remote_writers(),
// collective over options.group.
void save_job(const std::string& dir, int64_t step, const JobState& state,
              const SaveOptions& options = {});
// Loads checkpoint::latest(dir, options) into `state` and returns its step;
// nullopt when `dir` holds none. By default every part of a step is
// verified first and a damaged step passed over for the newest whole one
// (said on stderr, naming the step, the file and what is wrong). Each rank
// that calls it reads the whole step and chooses alone: ranks that must load
// the same step should check they agree (all-reduce it), as examples/gpt does.
std::optional<int64_t> load_latest_job(const std::string& dir, JobState& state,
                                       const LatestOptions& options = LatestOptions::verified());

}  // namespace tandem::checkpoint
