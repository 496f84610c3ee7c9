// ZeroRedundancyOptimizer: data parallelism without a copy of the optimizer's
// state on every rank (ZeRO stage 1), after PyTorch's
// torch.distributed.optim.ZeroRedundancyOptimizer.
//
//   ddp::DistributedDataParallel net(model);
//   optim::Options o;
//   o.lr = 1e-3;
//   optim::ZeroRedundancyOptimizer opt(net.parameters(), optim::Kind::kAdam, o);
//   for (...) {
//     loss_fn(net(x), y).backward();   // DDP averages the gradients
//     opt.step();                      // each rank steps its share; all get every parameter
//     opt.zero_grad();
//   }
//
// What it promises:
//  1. Partition. The parameters are shared out over the group's ranks as
//     PyTorch shares them: sorted by size, largest first (equal sizes in the
//     order given), each goes to the rank whose share has the fewest
//     elements so far (the lowest such rank). Each rank builds and keeps the
//     LibTorch optimizer of `kind` over its share only, so its state (Adam:
//     8 bytes a float parameter) lives on one rank.
//  2. step() steps this rank's share with the gradients it holds there
//     (averaged already, by DDP or by the caller; a parameter without a
//     gradient is skipped, as LibTorch's optimizers skip it), then every
//     parameter comes back to every rank from its owner: over Gloo, a
//     broadcast of each parameter from its owner into every rank's tensor,
//     all in flight at once (as PyTorch does); over NCCL, an all-gather per
//     bucket of about `bucket_cap_mb` of each rank's share (padded to the
//     largest share), two in flight. Every rank ends with bit-identical
//     parameters. A step that fails there (a rank gone) leaves the
//     parameters undefined and the group broken: load a checkpoint into a
//     new group. Collective: every rank calls it, in the same order as
//     the group's other collectives.
//  3. clip_grad_norm(max_norm) is LibTorch's clip_grad_norm_ over every
//     parameter of the model: each rank sums the squares of its share's
//     gradients, the sums are added over the group, and every gradient this
//     rank holds is scaled. It holds whether the gradients are whole on
//     every rank (DDP) or each rank holds only its share's (sharded
//     gradients). Collective.
//  4. Checkpoints, two kinds:
//     - consolidate_state_dict(to) gathers every share's state to rank `to`
//       (collective); there state_dict() is then the archive LibTorch's own
//       optimizer of `kind` over all the parameters, in the order given,
//       would save: torch::optim::Adam(params).load(archive) takes it, and
//       load_state_dict(archive) takes it on any number of ranks.
//     - local_state_dict() is this rank's share alone (an archive of its
//       own), and load_local_state_dict() takes it back only on the same
//       rank of a group of the same size over the same parameters, the
//       partition then being the same; anything else is an error naming
//       what differs.
//     Both carry the learning rate, which a load takes (a state from
//     elsewhere, without it, leaves the rate as it is); the other
//     hyper-parameters stay those of the loading optimizer's Options, as
//     with LibTorch's own load and a DistributedOptimizer's.
//  5. Construction is collective: the ranks compare the parameters' shapes
//     and dtypes, and a difference fails on every rank naming the first
//     parameter that differs. Every parameter must be contiguous and on the
//     group's device (the CPU for gloo, this process's GPU for nccl).
//  6. Errors: std::invalid_argument for bad arguments and foreign states,
//     ddp::CollectiveError (naming a dead rank) when a collective fails.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/ddp/process_group.h"
#include "tandem/optim/options.h"

namespace torch::optim {
class Optimizer;
}

namespace tandem::optim {

struct ZeroOptions {
  // The ranks the state is shared over (a mesh dimension's group, say).
  // Null: the default process group.
  std::shared_ptr<ddp::ProcessGroup> group;
  // Of each rank's share per all-gather after a step (NCCL; over Gloo each
  // parameter is broadcast whole).
  double bucket_cap_mb = 25;
  std::chrono::milliseconds timeout = ddp::kGroupTimeout;
};

class ZeroRedundancyOptimizer {
 public:
  ZeroRedundancyOptimizer(std::vector<at::Tensor> params, Kind kind, Options options = {},
                          ZeroOptions zero = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  void step();
  // Every parameter's gradient (not only this rank's share): undefined with
  // set_to_none, else zeros.
  void zero_grad(bool set_to_none = true);
  // Returns the total norm (before clipping). norm_type 2 only.
  double clip_grad_norm(double max_norm);
  // The same over a model also split over a tensor-parallel group
  // (ddp::ClipOptions): the squares summed over both groups, a replicated
  // parameter counted where `counted` says. Collective over both.
  double clip_grad_norm(double max_norm, const ddp::ClipOptions& options);

  double lr() const;
  void set_lr(double lr);
  Kind kind() const;

  int rank() const;
  int world_size() const;
  const std::vector<at::Tensor>& params() const;
  // The owner of each parameter, in the order given.
  const std::vector<int>& owners() const;
  // The indices of the parameters rank r steps, in its optimizer's order.
  const std::vector<size_t>& share(int r) const;
  // The owner of `param` (one of params()), for DDP's sharded gradients
  // (ZeRO stage 2): DDPOptions::gradient_owner = opt.gradient_owner().
  // It answers -1 for a tensor that is not one of params(), which DDP
  // refuses naming the parameter. It stays valid after the optimizer is gone.
  std::function<int(const at::Tensor&)> gradient_owner() const;
  // Bytes of optimizer state this rank holds (its LibTorch optimizer's
  // tensors).
  int64_t state_bytes() const;
  // This rank's LibTorch optimizer (null when its share is empty).
  torch::optim::Optimizer* local_optimizer();

  void consolidate_state_dict(int to = 0);
  std::string state_dict() const;
  void load_state_dict(const std::string& archive);
  std::string local_state_dict() const;
  void load_local_state_dict(const std::string& archive);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The partition alone: for each parameter of `numels`, the rank of
// `world_size` that owns it.
std::vector<int> zero_partition(const std::vector<int64_t>& numels, int world_size);

}  // namespace tandem::optim
