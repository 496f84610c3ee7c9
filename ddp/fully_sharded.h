#pragma once
// FullyShardedDataParallel: data parallelism with every rank holding only a
// 1/N shard of each unit's parameters, gradients and optimizer state (ZeRO
// stage 3), after PyTorch's FSDP.
//
//   ddp::init_process_group("gloo");
//   torch::nn::Sequential model(embed, block0, block1, block2, head);
//   ddp::FSDPOptions o;
//   o.units = {"1", "2", "3"};                      // the blocks: units of their own
//   ddp::FullyShardedDataParallel fsdp(model, o);
//   torch::optim::Adam opt(fsdp.parameters(), 1e-3);   // over the shards
//   for (...) {
//     loss_fn(fsdp.forward(x), y).backward();
//     fsdp.clip_grad_norm(1.0);                  // optional: the whole model's norm
//     opt.step();
//     opt.zero_grad();
//   }
//
// What it promises:
//  1. Units. Each submodule named in FSDPOptions::units (its name as the
//     model's named_modules() gives it) is a unit; the parameters of no named
//     unit form the root unit. Each unit's parameters are flattened into one
//     buffer, padded to a multiple of the group's size (at least one element
//     a rank, for a unit of empty parameters), and each rank keeps
//     its 1/N of it as one tensor that requires grad (parameters()):
//     that is what the optimizer steps: any of LibTorch's elementwise
//     optimizers (SGD, Adam, AdamW, Adagrad, RMSprop; not LBFGS).
//  2. Forward. Before a unit runs, its whole parameters are all-gathered
//     into a buffer of its own and the module's parameters point into it;
//     after it they are freed (reshard_after_forward), and the next unit's
//     gather was started while this one computed (prefetch). The root unit
//     stays gathered from the start of forward to the end of backward.
//     Outside that, a unit's parameters are empty tensors (numel 0): read
//     them with full_state_dict(), never directly.
//  3. Backward. Before a unit's backward its parameters are gathered again
//     (the one before it in forward order prefetched); once every gradient
//     of the unit has landed, the gradients are averaged by reduce-scatter
//     into each rank's shard (ProcessGroup::reduce_scatter_async), and the
//     unit's whole parameters and gradients are freed. The reduce-scatters
//     go in reverse forward order on every rank; a unit with a parameter
//     that got no gradient is reduced at the end of backward, with zeros
//     for it. A shard's gradient adds up over backwards until zero_grad(),
//     as LibTorch's gradients do (accumulation communicates every time).
//     The ranks' backwards must reach the same parameters: a unit whose
//     parameter gets a gradient on one rank and none on another would be
//     reduced at different points of their backwards (DDP's
//     find_unused_parameters has no counterpart here yet). One backward per
//     forward, and the wrapper outlives the graphs it made.
//  4. Running units. A torch::nn::Sequential model runs through forward(x):
//     its children in order, each named unit around its child (units are
//     then its children: "0", "1", ...). Any other model runs its own
//     forward inside forward(fn), calling each unit through run(name, fn);
//     a unit it does not call that way holds empty parameters and fails.
//  5. Construction is collective: the ranks compare the model (parameter
//     names, shapes, dtypes, units) and take rank 0's parameters and
//     buffers (without sync_module_states: no communication, each rank
//     shards its own values; a state that tandem::ft heals is one). Bad units fail on every rank naming them: a name that is no
//     submodule, two units of which one holds the other, a parameter two
//     units share, a parameter that does not require grad.
//  6. Checkpoints. full_state_dict(to) gathers every parameter, named as in
//     the unwrapped model, to rank `to` (collective; buffers too);
//     load_full_state_dict() takes such a dict on every rank. The sharded
//     form (sharded_state_dict()) is this rank's shards and what they hold.
//  7. Mixed precision (param_dtype): the gathered parameters, forward,
//     backward and the gradients' reduce-scatter are in that dtype; the
//     shards (master weights) and the optimizer's state stay in the
//     parameters' dtype. forward(x) casts a floating-point x to it (with
//     forward(fn), the model's own code does). On the CPU, LibTorch 1.x
//     has no float16 matmul: there bfloat16 it is. On Gloo (LibTorch 1.x's sums no bfloat16) the
//     16-bit values travel as raw 2-byte words and each rank sums what it
//     receives in float32.
//  8. HSDP (replicate_group): shard within the sharding group, replicate
//     across another (a mesh: shard over "dp_shard", replicate over
//     "dp_replicate"). The replicas start from the replicate group's rank
//     0 and average their shards' gradients after the reduce-scatter.
//  9. Errors: a collective's failure is a CollectiveError naming the rank
//     that is gone (ProcessGroup); bad arguments std::invalid_argument.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/ddp/process_group.h"

namespace tandem::ddp {

struct FSDPOptions {
  // The submodules that are units of their own (named as named_modules()
  // names them). Empty: every child of the root module that has parameters.
  std::vector<std::string> units;
  bool reshard_after_forward = true;
  // Start the next unit's all-gather while this one computes.
  bool prefetch = true;
  // Mixed precision: gather, compute and reduce in this dtype (kHalf or
  // kBFloat16); the shards, which the optimizer steps, keep the
  // parameters' own dtype. Empty: the parameters' dtype throughout.
  std::optional<at::ScalarType> param_dtype;
  // HSDP: the shards are replicated over this group (a mesh's other
  // dimension): each rank's shard gradients, reduce-scattered over the
  // sharding group, are then averaged over it. Null: shard over the whole
  // job (the sharding group is the world).
  std::shared_ptr<ProcessGroup> replicate_group;
  std::chrono::milliseconds timeout = kGroupTimeout;
  // Construction compares the ranks' models and takes rank 0's parameters
  // and buffers. False: it does not communicate; each rank keeps its own
  // values (the same seed made them alike, or a state loaded later
  // replaces them), and a model that differs is the caller's error.
  bool sync_module_states = true;
};

// One rank's shard of one unit, for a checkpoint of its own.
struct UnitShard {
  std::string unit;                // "" for the root unit
  std::vector<std::string> names;  // its parameters, as the model names them
  std::vector<std::vector<int64_t>> shapes;
  int64_t numel = 0;  // the unit's elements, before padding
  int rank = 0, world_size = 1;
  at::Tensor shard;  // this rank's [numel padded / world_size] piece
  // The module's parameters themselves, as `names` (empty between steps:
  // 2.), by which checkpoints find a tensor-parallel piece's placement.
  std::vector<at::Tensor> params;
};

class FullyShardedDataParallel {
 public:
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> model, FSDPOptions options = {},
                           std::shared_ptr<ProcessGroup> group = nullptr);
  FullyShardedDataParallel(torch::nn::Sequential model, FSDPOptions options = {},
                           std::shared_ptr<ProcessGroup> group = nullptr);
  // Without a group yet: the shards laid out for `rank` of `size`, each
  // rank's own values kept (as sync_module_states false: nothing is
  // communicated), set_group() before the first forward. For a model whose
  // group comes later (tandem::ft: with the replica's first quorum, after
  // the state was described to the Manager). std::invalid_argument for a
  // rank outside [0, size) or a replicate_group.
  FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> model, FSDPOptions options, int rank,
                           int size);
  FullyShardedDataParallel(torch::nn::Sequential model, FSDPOptions options, int rank, int size);
  ~FullyShardedDataParallel();
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  // A Sequential model's forward (std::logic_error for another model).
  at::Tensor forward(const at::Tensor& x);
  at::Tensor operator()(const at::Tensor& x) { return forward(x); }
  // Any model: `fn` runs its forward, calling each unit through run().
  at::Tensor forward(const std::function<at::Tensor()>& fn);
  at::Tensor run(const std::string& unit, const std::function<at::Tensor()>& fn);

  // The shards, one per unit (the root's first when it has parameters).
  std::vector<at::Tensor> parameters() const;
  void zero_grad();
  // LibTorch's clip_grad_norm_ over the whole model's gradients (the
  // shards'); returns the norm before clipping. Collective.
  double clip_grad_norm(double max_norm);
  // The same over a model that is also split over a tensor-parallel group
  // (ClipOptions, process_group.h): each rank's squares summed over the
  // sharding group and then over `group`, a replicated parameter counted
  // where `counted` says. Collective over both.
  double clip_grad_norm(double max_norm, const ClipOptions& options);

  // Collective: rank `to` gets every parameter and buffer, named as the
  // model names them (the others an empty list).
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict(int to = 0);
  // On every rank: each shard taken from the dict's parameters (every one
  // must be there, with its shape), and its buffers.
  void load_full_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& state);
  std::vector<UnitShard> sharded_state_dict() const;
  // The same without the copies: each `shard` is the live shard, detached
  // (what parameters() holds), in parameters()' order. checkpoint::JobState
  // writes a job's checkpoint from it, each parameter's slices by name, so
  // that another world size loads them (checkpoint/job.h).
  std::vector<UnitShard> shards() const;
  // FSDPOptions::replicate_group (null without HSDP).
  std::shared_ptr<ProcessGroup> replicate_group() const;
  // Takes shards saved by this rank of a group of this size over this
  // model; anything else is an error naming what differs.
  void load_sharded_state_dict(const std::vector<UnitShard>& shards);

  struct Stats {
    std::vector<std::string> units;            // in forward order of the last forward
    int64_t largest_unit_bytes = 0;            // the largest unit, gathered
    int64_t shard_bytes = 0;                   // this rank's shards and their gradients
    int64_t gathers = 0, reduce_scatters = 0;  // over the last forward and backward
  };
  Stats stats() const;
  std::shared_ptr<torch::nn::Module> module() const;
  ProcessGroup& group();
  // Communicates over `group` from now on: another group of the same size
  // in which this process has the same rank (the replica's group a new
  // tandem::ft quorum makes). Between steps; what a failed step left in
  // flight on the old group is waited for (its failure ends it) and
  // dropped. std::invalid_argument for a null group, or one of another
  // size, rank or backend.
  void set_group(std::shared_ptr<ProcessGroup> group);

  struct Impl;  // ddp/fsdp/impl.h

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::ddp
