// The owners' service: on every worker, the LibTorch optimizers that
// DistributedOptimizers made there over its parameters.
//
// What it promises: one optimizer per id, made, stepped, clipped, saved,
// loaded and dropped only through the calls below; steps on one optimizer
// are serialized, and so are steps of different optimizers on this worker
// (they may share parameters, and a step lends each parameter's .grad to
// its optimizer); a load swaps in a fresh optimizer only when all of the
// state was read; an optimizer still alive at a graceful shutdown is a
// leak (live_objects). How it talks to its neighbours: it is an agent
// extension (rpc/extension.h), made with every agent, that registers the
// tandem.optim.* functions (their messages: optim/owner/protocol.h); the
// DistributedOptimizer (optim/distributed_optimizer.cc)
// reaches the other owners' services by those functions and its own
// worker's service by the methods below, without RPC. The optimizers
// themselves are optim/owner/local_optimizer.h's.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "tandem/optim/options.h"
#include "tandem/rpc/agent.h"
#include "tandem/rpc/extension.h"

namespace tandem::optim::owner {

class OptimService final : public rpc::AgentExtension,
                           public std::enable_shared_from_this<OptimService> {
 public:
  explicit OptimService(rpc::Agent& agent);
  ~OptimService() override;

  // The service of `agent` (std::logic_error if the agent was made before
  // this library was loaded).
  static std::shared_ptr<OptimService> of(rpc::Agent& agent);

  // Every method but destroy throws std::invalid_argument for an id this
  // worker holds no optimizer under.
  // `params` must be leaves that require grad (std::invalid_argument naming
  // the first that is not); ids are unique per worker. With a shard_group
  // the optimizer is a ZeroRedundancyOptimizer over the process group of
  // that name registered with this agent (ddp::find_group): making,
  // stepping and state() are then collective over the group (state()
  // answers the whole state on the group's rank 0, none elsewhere), and
  // load() takes this owner's share of a whole state.
  void create(int64_t id, Kind kind, std::vector<at::Tensor> params, const Options& options,
              const std::string& shard_group = "");
  // Steps with the gradients of autograd context `context_id` here; a
  // parameter with none in the context is left alone.
  void step(int64_t id, uint64_t context_id);
  void set_lr(int64_t id, double lr);
  // Per parameter, the norm of its gradient in the context (on the CPU, in
  // the gradient's dtype, as clip_grad_norm_ computes it), or None.
  std::vector<c10::optional<at::Tensor>> grad_norms(int64_t id, uint64_t context_id,
                                                    double norm_type);
  // Scales the optimizer's gradients in the context by `coef`, in place:
  // get_gradients hands out the context's own tensors, so the next
  // get_gradients (and step) sees the scaled ones.
  void scale_grads(int64_t id, uint64_t context_id, double coef);
  // The optimizer's LibTorch archive, and back (with its learning rate).
  std::string state(int64_t id);
  void load(int64_t id, const std::string& bytes, double lr);
  // The positions (in its params' order) of the parameters whose state this
  // owner keeps, for a checkpoint written here: all of them, or for a
  // sharded optimizer this replica's share.
  std::vector<size_t> held_params(int64_t id);
  // Its kind, and its parameters' shapes (in its params' order).
  std::pair<Kind, std::vector<std::vector<int64_t>>> layout(int64_t id);
  // Each of those with its state (optim/param_state.h's bytes), copied now
  // and made into bytes when its function is called.
  std::vector<std::pair<size_t, std::function<std::string()>>> param_state_snapshots(int64_t id);
  // The same, each held parameter's state cut as `cut(index, param)` says: ranges
  // (start, numel) of its flattened elements, each snapshot the state of a
  // parameter of those elements (optim::param_state_slice_snapshot); no
  // ranges: the whole state (start 0, numel -1); nullopt: none of it.
  struct CutSnapshot {
    size_t index = 0;
    int64_t start = 0, numel = -1;
    std::function<std::string()> make;
  };
  using Cut = std::function<std::optional<std::vector<std::pair<int64_t, int64_t>>>(
      size_t, const at::Tensor&)>;
  std::vector<CutSnapshot> param_state_snapshots(int64_t id, const Cut& cut);
  // Its parameters (in its params' order).
  std::vector<at::Tensor> params(int64_t id);
  // A held parameter's saved state (optim/param_state.h's bytes), or none:
  // the parameter keeps what its optimizer has (a fresh optimizer's own
  // state; a sharded owner's live one) — for a parameter of no elements a
  // checkpoint holds nothing of; Adagrad's state must never be missing.
  using StateOf = std::function<std::optional<std::string>(size_t)>;
  // Reads and checks `bytes_of(i)` for each held parameter, as
  // load_param_states would, loading nothing (std::invalid_argument naming
  // the parameter).
  void check_param_states(int64_t id, const StateOf& bytes_of);
  // Loads `bytes_of(i)` into each held parameter's state (a fresh optimizer
  // swapped in once all were read, as load() does; a sharded one checked
  // whole first), and sets the rate.
  void load_param_states(int64_t id, const StateOf& bytes_of, double lr);
  void destroy(int64_t id);  // idempotent
  size_t live() const;

  // rpc::AgentExtension
  void register_handlers(rpc::Registry& internal) override;
  void before_send(rpc::Message&, int) override {}
  void after_encode(const rpc::Message&, rpc::OutFrame&, int) override {}
  void after_receive(rpc::Message&, int) override {}
  std::vector<std::string> live_objects() const override;
  void close() override;

  // Runs `fn` while no optimizer of this worker steps (a step begun
  // finishes first; the next waits for fn): a copy of parameters that
  // steps update in place, a module's for a checkpoint, is then one
  // moment's values, never half a step's (checkpoint/remote.cc). Answers
  // that moment: how many steps this worker had taken (its optimizers'
  // together, failed ones too), so that copies made in several calls can
  // be told apart when a step fell between them.
  int64_t between_steps(const std::function<void()>& fn);

 private:
  struct Local;
  std::shared_ptr<Local> find(int64_t id) const;
  // held_params of `local`, whose mu the caller holds; and the optimizer
  // that keeps their state (null: a sharded one with an empty share).
  static std::vector<size_t> held(const Local& local);
  static torch::optim::Optimizer* keeper(const Local& local);

  rpc::Agent& agent_;
  mutable std::mutex mu_;
  std::mutex step_mu_;  // one step at a time on this worker (after a Local's mu)
  // Held shared by every step (before a Local's mu), by between_steps alone.
  std::shared_mutex params_mu_;
  std::atomic<int64_t> steps_taken_{0};  // (counted before a step lets params_mu_ go)
  std::map<int64_t, std::shared_ptr<Local>> optimizers_;
  bool closed_ = false;
};

}  // namespace tandem::optim::owner
