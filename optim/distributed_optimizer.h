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
//     Steps on one owner's optimizer are serialized.
//  3. The destructor drops every owner's optimizer (best effort: an owner
//     that is gone has nothing left to drop). An optimizer still alive at a
//     graceful shutdown is reported as a leak, like an RRef.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/rpc/agent.h"
#include "tandem/rpc/rref.h"

namespace tandem::optim {

enum class Kind { kSGD, kAdam, kAdamW, kAdagrad, kRMSprop };

// One options struct for every kind; each kind reads the fields PyTorch's
// optimizer of that name takes, with PyTorch's defaults. Where the default
// differs by kind, a negative value means "the kind's default": eps (1e-10
// for Adagrad, 1e-8 otherwise) and weight_decay (0.01 for AdamW, 0 otherwise).
struct Options {
  double lr = 0.01;
  double weight_decay = -1;
  // SGD
  double momentum = 0;
  double dampening = 0;
  bool nesterov = false;
  // Adam, AdamW
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = -1;
  bool amsgrad = false;
  // Adagrad
  double lr_decay = 0;
  double initial_accumulator_value = 0;
  // RMSprop (eps, momentum and weight_decay above)
  double alpha = 0.99;
  bool centered = false;
};

std::string kind_name(Kind kind);

class DistributedOptimizer {
 public:
  // On the current agent (rpc::current_agent()).
  DistributedOptimizer(Kind kind, const std::vector<rpc::RRef<at::Tensor>>& params,
                       const Options& options = {});
  DistributedOptimizer(rpc::Agent& agent, Kind kind,
                       const std::vector<rpc::RRef<at::Tensor>>& params,
                       const Options& options = {});
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  // Applies the gradients of autograd context `context_id` on every owner.
  void step(uint64_t context_id);

  Kind kind() const { return kind_; }
  // The workers that own parameters, by rank.
  std::vector<int> owners() const;

 private:
  struct Part {
    int owner;
    int64_t id;  // the optimizer's id on its owner
  };
  std::shared_ptr<rpc::Agent> agent() const;  // throws ShutdownError once it is gone
  void drop() noexcept;                        // every owner's optimizer, best effort
  std::weak_ptr<rpc::Agent> agent_;
  Kind kind_;
  std::vector<Part> parts_;
};

// Optimizers alive on `agent` as an owner (tests and leak checks).
size_t live_optimizers(rpc::Agent& agent);

}  // namespace tandem::optim
