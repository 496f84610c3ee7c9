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
//     LibTorch optimizer state (OptimizerState below); save(path) /
//     load(path) keep one in a file.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
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

// A checkpoint of a DistributedOptimizer: every owner's LibTorch optimizer,
// serialized there (Optimizer::save into a torch::serialize::OutputArchive),
// plus the learning rate. The parts follow the optimizer's owners() order;
// load_state_dict() takes it only into an optimizer of the same kind over
// the same owners with as many parameters on each (the parameters of a
// fresh run: the state is matched to them by position, as in LibTorch).
// The hyper-parameters other than lr come from the loading optimizer's
// Options (LibTorch's own load keeps them too).
struct OptimizerState {
  struct Part {
    int rank = -1;           // the owner
    std::string worker;      // its name (for messages)
    int64_t num_params = 0;  // parameters this owner steps
    std::string bytes;       // its OutputArchive, as written by save_to()
  };
  Kind kind = Kind::kSGD;
  double lr = 0;
  std::vector<Part> parts;
};

// One OptimizerState in one file, and back. The format (little-endian):
//   "TANDEM-OPTIM-STATE\n", u32 version (1), i64 kind, f64 lr, u64 parts,
//   per part: i64 rank, u64 n + n bytes of worker name, i64 num_params,
//             u64 n + n bytes of state;
//   u64 FNV-1a hash of everything before it.
// save_state writes a temporary file beside `path` and renames it over
// `path`, so a crash never leaves half a checkpoint. Errors name the path:
// std::runtime_error when the file cannot be opened or written,
// std::invalid_argument when what is read is not such a checkpoint
// (another file, truncated, corrupt).
void save_state(const OptimizerState& state, const std::string& path);
OptimizerState load_state(const std::string& path);
// The same bytes, for a checkpoint of one's own that holds more than the
// optimizer (examples/char_lm.cc). `source` names the bytes in errors.
std::string state_to_bytes(const OptimizerState& state);
OptimizerState state_from_bytes(const std::string& data,
                                const std::string& source = "the optimizer state");

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

 private:
  struct Part {
    int owner;
    int64_t id;                 // the optimizer's id on its owner
    std::vector<size_t> index;  // its parameters' positions in the constructor's list
  };
  std::shared_ptr<rpc::Agent> agent() const;  // throws ShutdownError once it is gone
  void drop() noexcept;                        // every owner's optimizer, best effort
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
