// DistributedOptimizer: steps parameters where they live, as
// torch.distributed.optim.DistributedOptimizer does for Python.
//
//   std::vector<rpc::RRef<at::Tensor>> params = ...;   // on any workers
//   optim::DistributedOptimizer opt(optim::Kind::kAdam, params, {.lr = 1e-3});
//   {
//     autograd::Context ctx;
//     ... forward across workers, autograd::backward(ctx.id(), {loss});
//     opt.step(ctx.id());          // every owner applies that context's gradients
//   }
//
// How it works:
//  1. The constructor groups the parameters by owner and makes one LibTorch
//     optimizer on each owner over that owner's parameters ("tandem.optim.
//     create"; the caller's own parameters need no RPC). The optimizers stay
//     there: their state never crosses the wire.
//  2. step(ctx) asks every owner at once to step with its gradients of that
//     context (autograd::get_gradients on the owner) and returns when all
//     are done, or throws the first failure (rpc::RemoteError naming the
//     worker). A parameter with no gradient in the context is left alone.
//     Steps on one owner are serialized, those of different optimizers too
//     (as PyTorch's local optimizers share one lock): several trainers'
//     optimizers may step the same parameters (a parameter server's table),
//     and each step lends the parameters' .grad to its optimizer.
//  3. The destructor drops every owner's optimizer (best effort: an owner
//     that is gone has nothing left to drop). An optimizer still alive at a
//     graceful shutdown is reported as a leak, like an RRef.
//
// Beyond PyTorch's version (every call reaches all owners at once, the
// caller's own part without RPC, and throws the first failure):
//  4. set_lr(lr) sets the learning rate of every owner's optimizer (all of
//     its param groups); lr() is the current one. Schedules build on it
//     (optim/lr_scheduler.h).
//  5. clip_grad_norm(ctx, max_norm, norm_type) clips the context's gradients
//     by their global norm, exactly as torch::nn::utils::clip_grad_norm_
//     does over all the parameters in one process: each owner sends its
//     per-parameter norms, the caller combines them, and when the
//     coefficient max_norm / (total + 1e-6) is below 1 every owner scales
//     its gradients in that context in place, so the next step() uses them.
//  6. state_dict() / load_state_dict() gather and restore every owner's
//     LibTorch optimizer state (OptimizerState, optim/optimizer_state.h);
//     save(path) / load(path) keep one in a file.
//
// Its neighbours: Kind and Options are optim/options.h's; the owners'
// service (optim/owner/service.h) holds the optimizers, and this class
// reaches it by the messages of optim/owner/protocol.h (its own worker's
// part by direct calls); checkpoints are optim/optimizer_state.h's.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/optim/optimizer_state.h"
#include "tandem/optim/options.h"
#include "tandem/rpc/agent.h"
#include "tandem/rpc/rref.h"

namespace tandem::ddp {
class ProcessGroup;
}

namespace tandem::optim {

// How the owners keep their state, beside the optimizer's Options.
struct DistributedOptions {
  // ZeRO stage 1 on every owner, for data-parallel replicas of a model
  // (pipeline x data parallelism): the name of a process group registered
  // on the owners' agents (a Mesh registers its groups under
  // Mesh::group_name(dim); or ddp::register_group) whose ranks own the same
  // parameters in the other replicas. Each owner then keeps a
  // ZeroRedundancyOptimizer over that group: it steps its share and
  // all-gathers the rest, so the state is split over the replicas. Every
  // replica's DistributedOptimizer is then made, stepped and checkpointed
  // (state_dict, load_state_dict) together: those are collective over the
  // groups. state_dict() holds the whole state on the replica whose owners
  // are their groups' rank 0 (every part empty on the others), in the
  // unsharded format, so it loads with or without sharding and on any
  // number of replicas, each replica's parts given its own owners' ranks
  // and names first (examples/gpt/train.cc does). Empty: each owner keeps
  // all of its parameters' state.
  std::string shard_group;
};

class DistributedOptimizer {
 public:
  // On the current agent (rpc::current_agent()).
  DistributedOptimizer(Kind kind, const std::vector<rpc::RRef<at::Tensor>>& params,
                       const Options& options = {}, const DistributedOptions& distributed = {});
  DistributedOptimizer(rpc::Agent& agent, Kind kind,
                       const std::vector<rpc::RRef<at::Tensor>>& params,
                       const Options& options = {}, const DistributedOptions& distributed = {});
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  // Applies the gradients of autograd context `context_id` on every owner.
  void step(uint64_t context_id);

  // Sets the learning rate of every owner's optimizer (all param groups).
  // std::invalid_argument if lr is negative or not finite (nothing changes).
  // If an owner fails, the others have the new rate and lr() the old one.
  // Calls from several threads at once are not ordered against each other.
  void set_lr(double lr);
  // The learning rate set last (by Options, set_lr or a load).
  double lr() const { return lr_.load(); }

  // Clips the gradients of context `context_id` over all the parameters to
  // a global norm of at most max_norm, as torch::nn::utils::clip_grad_norm_
  // (LibTorch 1.13) does in one process: total = the norm_type-norm of the
  // per-parameter gradient norms (for infinity the largest absolute value;
  // for 0 the number of gradients), then every gradient is scaled by
  // max_norm / (total + 1e-6) when that is below 1. Parameters with no
  // gradient in the context are skipped. Returns the total norm (before
  // clipping; 0 when no parameter has a gradient). std::invalid_argument
  // for max_norm <= 0 or NaN, or norm_type negative or NaN. The gradients
  // are scaled where they are stored (the context's own tensors), so the
  // next get_gradients() and step() see the clipped ones; do not run it
  // beside a backward() in the same context.
  double clip_grad_norm(uint64_t context_id, double max_norm, double norm_type = 2.0);
  // The same over a model of which this optimizer steps one piece and the
  // optimizers of `options.group`'s other ranks the others (tensor
  // parallelism: each tp rank's driver steps its slices of the split
  // parameters and a copy of the replicated ones). Each rank's norm_type
  // power sum over the parameters options.counted marks (constructor order;
  // empty: all) is summed over the group (for infinity, the largest
  // taken), so a split parameter counts once through its slices and a
  // replicated one once when a single rank counts it; every rank then
  // scales by the same coefficient. Collective over the group: every rank
  // calls it, in the same order as its other collectives. Equal to one
  // process's clip_grad_norm_ up to the sum's rounding.
  // std::invalid_argument for a `counted` of another length.
  struct ClipOptions {
    double norm_type = 2.0;
    std::shared_ptr<ddp::ProcessGroup> group;
    std::vector<bool> counted;
  };
  double clip_grad_norm(uint64_t context_id, double max_norm, const ClipOptions& options);

  // Every owner's optimizer state, and back (see OptimizerState). A state
  // of another kind, other owners or other parameter counts is refused with
  // std::invalid_argument naming the mismatch, before any owner is touched;
  // state tensors whose shapes do not fit the parameters are refused by
  // their owner (naming the parameter and both shapes). Each owner loads into
  // a fresh LibTorch optimizer and swaps it in only when all of it was read
  // (LibTorch's load would merge into the old state instead); an owner
  // that fails (rpc::RemoteError naming it) keeps its old state, but the
  // others have loaded theirs. lr() is the state's afterwards.
  OptimizerState state_dict() const;
  void load_state_dict(const OptimizerState& state);
  // state_dict() into a file, and load_state_dict() from one (save_state,
  // load_state).
  void save(const std::string& path) const;
  void load(const std::string& path);

  Kind kind() const { return kind_; }
  // The workers that own parameters, by rank.
  std::vector<int> owners() const;

  // Each owner's optimizer: the owner's rank, the optimizer's id there
  // (optim/owner/service.h), and its parameters' positions in the
  // constructor's list, in its order. For checkpoints written by the
  // owners (checkpoint/remote.h).
  struct OwnerPart {
    int owner;
    int64_t id;
    std::vector<size_t> index;
  };
  std::vector<OwnerPart> owner_parts() const;
  // The agent it was made on (throws rpc::ShutdownError once it is gone).
  std::shared_ptr<rpc::Agent> agent() const;

 private:
  struct Part {
    int owner;
    int64_t id;                 // the optimizer's id on its owner
    std::vector<size_t> index;  // its parameters' positions in the constructor's list
  };
  void drop() noexcept;  // every owner's optimizer, best effort
  // Runs `fn` on every owner at once: an RPC with args(part) to each other
  // owner, local(part) for the caller's own part on this thread. Returns
  // each part's result in parts_ order; throws the first remote failure,
  // else the local one.
  std::vector<c10::IValue> on_owners(
      const std::string& what, const std::string& fn,
      const std::function<std::vector<c10::IValue>(const Part&)>& args,
      const std::function<c10::IValue(const Part&)>& local) const;
  std::weak_ptr<rpc::Agent> agent_;
  Kind kind_;
  std::atomic<double> lr_;
  std::vector<Part> parts_;
};

// Optimizers alive on `agent` as an owner (tests and leak checks).
size_t live_optimizers(rpc::Agent& agent);

}  // namespace tandem::optim
