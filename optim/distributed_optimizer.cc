// The DistributedOptimizer's two sides: the owner's optimizers (an agent
// extension holding one LibTorch optimizer per id, and the "tandem.optim.*"
// handlers), and the caller's handle that groups parameters by owner.
#include "tandem/optim/distributed_optimizer.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <atomic>
#include <map>
#include <mutex>

#include "tandem/autograd/autograd.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/layer.h"
#include "tandem/rpc/registry.h"

namespace tandem::optim {
namespace {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Kind kind,
                                                        std::vector<at::Tensor> params,
                                                        Options o) {
  if (o.eps < 0) o.eps = kind == Kind::kAdagrad ? 1e-10 : 1e-8;
  if (o.weight_decay < 0) o.weight_decay = kind == Kind::kAdamW ? 1e-2 : 0;
  if (o.lr < 0) throw std::invalid_argument("optimizer options: negative learning rate");
  switch (kind) {
    case Kind::kSGD:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(o.lr)
                      .momentum(o.momentum)
                      .dampening(o.dampening)
                      .weight_decay(o.weight_decay)
                      .nesterov(o.nesterov));
    case Kind::kAdam:
      return std::make_unique<torch::optim::Adam>(
          params, torch::optim::AdamOptions(o.lr)
                      .betas({o.beta1, o.beta2})
                      .eps(o.eps)
                      .weight_decay(o.weight_decay)
                      .amsgrad(o.amsgrad));
    case Kind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(o.lr)
                      .betas({o.beta1, o.beta2})
                      .eps(o.eps)
                      .weight_decay(o.weight_decay)
                      .amsgrad(o.amsgrad));
    case Kind::kAdagrad:
      return std::make_unique<torch::optim::Adagrad>(
          params, torch::optim::AdagradOptions(o.lr)
                      .lr_decay(o.lr_decay)
                      .weight_decay(o.weight_decay)
                      .initial_accumulator_value(o.initial_accumulator_value)
                      .eps(o.eps));
    case Kind::kRMSprop:
      return std::make_unique<torch::optim::RMSprop>(
          params, torch::optim::RMSpropOptions(o.lr)
                      .alpha(o.alpha)
                      .eps(o.eps)
                      .weight_decay(o.weight_decay)
                      .momentum(o.momentum)
                      .centered(o.centered));
  }
  throw std::invalid_argument("unknown optimizer kind " + std::to_string(static_cast<int>(kind)));
}

// Options travel as a flat list of numbers, in this order.
std::vector<double> pack(const Options& o) {
  return {o.lr,       o.weight_decay, o.momentum, o.dampening, o.nesterov ? 1.0 : 0.0,
          o.beta1,    o.beta2,        o.eps,      o.amsgrad ? 1.0 : 0.0, o.lr_decay,
          o.initial_accumulator_value, o.alpha, o.centered ? 1.0 : 0.0};
}

Options unpack(const std::vector<double>& v) {
  if (v.size() != 13) {
    throw std::invalid_argument("optimizer options: expected 13 numbers, got " +
                                std::to_string(v.size()));
  }
  Options o;
  o.lr = v[0];
  o.weight_decay = v[1];
  o.momentum = v[2];
  o.dampening = v[3];
  o.nesterov = v[4] != 0;
  o.beta1 = v[5];
  o.beta2 = v[6];
  o.eps = v[7];
  o.amsgrad = v[8] != 0;
  o.lr_decay = v[9];
  o.initial_accumulator_value = v[10];
  o.alpha = v[11];
  o.centered = v[12] != 0;
  return o;
}

Kind kind_of(int64_t k) {
  if (k < 0 || k > static_cast<int64_t>(Kind::kRMSprop)) {
    throw std::invalid_argument("unknown optimizer kind " + std::to_string(k));
  }
  return static_cast<Kind>(k);
}

// The owner's side: the optimizers over this worker's parameters.
class OptimService final : public rpc::AgentExtension,
                           public std::enable_shared_from_this<OptimService> {
 public:
  explicit OptimService(rpc::Agent& agent) : agent_(agent) {}

  static std::shared_ptr<OptimService> of(rpc::Agent& agent) {
    return rpc::layer::require_extension<OptimService>(agent, "distributed optimizer", "optim");
  }

  void create(int64_t id, Kind kind, std::vector<at::Tensor> params, const Options& options) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].is_leaf() || !params[i].requires_grad()) {
        throw std::invalid_argument("parameter " + std::to_string(i) + " on " + agent_.name() +
                                    " is not a leaf that requires grad");
      }
    }
    auto local = std::make_shared<Local>();
    local->params = params;
    local->optimizer = make_optimizer(kind, std::move(params), options);
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw rpc::ShutdownError("agent " + agent_.name() + " is shutting down");
    if (!optimizers_.emplace(id, std::move(local)).second) {
      throw std::invalid_argument("optimizer " + std::to_string(id) + " exists already");
    }
  }

  void step(int64_t id, uint64_t context_id) {
    auto local = find(id);
    autograd::Gradients grads = autograd::get_gradients(agent_, context_id);
    std::lock_guard<std::mutex> lock(local->mu);  // steps on one optimizer are serialized
    std::vector<at::Tensor> saved;
    saved.reserve(local->params.size());
    for (auto& p : local->params) {
      saved.push_back(p.grad());
      auto it = grads.find(p);
      // No gradient in this context: LibTorch's optimizers skip the parameter.
      p.mutable_grad() = it == grads.end() ? at::Tensor() : it->value();
    }
    try {
      local->optimizer->step();
    } catch (...) {
      restore(local->params, saved);
      throw;
    }
    restore(local->params, saved);
  }

  void destroy(int64_t id) {
    std::shared_ptr<Local> dead;  // freed outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    auto it = optimizers_.find(id);
    if (it == optimizers_.end()) return;  // idempotent
    dead = std::move(it->second);
    optimizers_.erase(it);
  }

  size_t live() const {
    std::lock_guard<std::mutex> lock(mu_);
    return optimizers_.size();
  }

  void register_handlers(rpc::Registry& internal) override {
    std::weak_ptr<OptimService> weak = weak_from_this();
    auto self = [weak] {
      auto s = weak.lock();
      if (!s) throw rpc::ShutdownError("the distributed optimizer is shut down");
      return s;
    };
    internal.def("tandem.optim.create", [self](int64_t id, int64_t kind, std::vector<double> options,
                                               std::vector<rpc::RRef<at::Tensor>> params) {
      std::vector<at::Tensor> tensors;
      tensors.reserve(params.size());
      for (auto& p : params) tensors.push_back(p.local_value());
      self()->create(id, kind_of(kind), std::move(tensors), unpack(options));
    });
    internal.def("tandem.optim.step", [self](int64_t id, int64_t context_id) {
      self()->step(id, static_cast<uint64_t>(context_id));
    });
    internal.def("tandem.optim.destroy", [self](int64_t id) { self()->destroy(id); });
  }

  void before_send(rpc::Message&, int) override {}
  void after_encode(const rpc::Message&, rpc::OutFrame&, int) override {}
  void after_receive(rpc::Message&, int) override {}

  std::vector<std::string> live_objects() const override {
    std::vector<std::string> out;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, _] : optimizers_) out.push_back("distributed optimizer " + std::to_string(id));
    return out;
  }

  void close() override {
    std::map<int64_t, std::shared_ptr<Local>> dead;
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    dead.swap(optimizers_);
  }

 private:
  struct Local {
    std::mutex mu;
    std::vector<at::Tensor> params;
    std::unique_ptr<torch::optim::Optimizer> optimizer;
  };

  static void restore(std::vector<at::Tensor>& params, std::vector<at::Tensor>& saved) {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = std::move(saved[i]);
  }

  std::shared_ptr<Local> find(int64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = optimizers_.find(id);
    if (it == optimizers_.end()) {
      throw std::invalid_argument("no distributed optimizer " + std::to_string(id) + " on " +
                                  agent_.name());
    }
    return it->second;
  }

  rpc::Agent& agent_;
  mutable std::mutex mu_;
  std::map<int64_t, std::shared_ptr<Local>> optimizers_;
  bool closed_ = false;
};

const bool kRegistered = [] {
  rpc::register_agent_extension(
      [](rpc::Agent& agent) { return std::make_shared<OptimService>(agent); });
  return true;
}();

std::atomic<int64_t> g_next_id{1};

}  // namespace

std::string kind_name(Kind kind) {
  switch (kind) {
    case Kind::kSGD: return "SGD";
    case Kind::kAdam: return "Adam";
    case Kind::kAdamW: return "AdamW";
    case Kind::kAdagrad: return "Adagrad";
    case Kind::kRMSprop: return "RMSprop";
  }
  return "unknown";
}

DistributedOptimizer::DistributedOptimizer(Kind kind,
                                           const std::vector<rpc::RRef<at::Tensor>>& params,
                                           const Options& options)
    : DistributedOptimizer(*rpc::current_agent(), kind, params, options) {}

DistributedOptimizer::DistributedOptimizer(rpc::Agent& agent, Kind kind,
                                           const std::vector<rpc::RRef<at::Tensor>>& params,
                                           const Options& options)
    : agent_(agent.weak_from_this()), kind_(kind) {
  (void)kRegistered;
  if (params.empty()) throw std::invalid_argument("DistributedOptimizer: no parameters");
  std::map<int, std::vector<rpc::RRef<at::Tensor>>> by_owner;
  for (const auto& p : params) by_owner[p.owner().rank].push_back(p);
  auto service = OptimService::of(agent);
  std::vector<rpc::RawFuture> remote;
  try {
    for (auto& [owner, mine] : by_owner) {
      // Ids are unique per owner: this worker's rank above a counter.
      const int64_t id = (static_cast<int64_t>(agent.rank()) << 40) | g_next_id.fetch_add(1);
      parts_.push_back({owner, id});
      if (owner == agent.rank()) {  // the caller's own parameters need no RPC
        std::vector<at::Tensor> tensors;
        for (auto& p : mine) tensors.push_back(p.local_value());
        service->create(id, kind, std::move(tensors), options);
      } else {
        remote.push_back(
            agent
                .call(agent.get_worker_info(owner).name, "tandem.optim.create",
                      rpc::to_ivalues(id, static_cast<int64_t>(kind), pack(options), mine))
                .raw());
      }
    }
    rpc::wait_raw_or_throw(rpc::when_all_raw(remote), std::chrono::milliseconds(0),
                           "DistributedOptimizer: creating the owners' optimizers");
  } catch (...) {
    // Every creation that started has ended (when_all waits for all of
    // them), so dropping cannot overtake one: drop what was made, then report.
    rpc::wait_raw(rpc::when_all_raw(remote), std::chrono::milliseconds(0));
    drop();
    throw;
  }
}

DistributedOptimizer::~DistributedOptimizer() { drop(); }

std::shared_ptr<rpc::Agent> DistributedOptimizer::agent() const {
  auto a = agent_.lock();
  if (!a) throw rpc::ShutdownError("DistributedOptimizer: its agent is gone");
  return a;
}

void DistributedOptimizer::drop() noexcept {
  std::vector<Part> parts;
  parts.swap(parts_);
  auto agent = agent_.lock();
  if (!agent) return;  // an agent that is gone dropped its optimizers as it closed
  std::vector<rpc::RawFuture> pending;
  for (const auto& part : parts) {
    try {
      if (part.owner == agent->rank()) {
        OptimService::of(*agent)->destroy(part.id);
      } else {
        pending.push_back(agent->call(agent->get_worker_info(part.owner).name,
                                      "tandem.optim.destroy", rpc::to_ivalues(part.id))
                              .raw());
      }
    } catch (const std::exception&) {
      // Shutting down: nothing is left to drop there.
    }
  }
  // Every owner at once; one that is gone has nothing left to drop.
  rpc::wait_raw(rpc::when_all_raw(pending), std::chrono::milliseconds(0));
}

void DistributedOptimizer::step(uint64_t context_id) {
  if (context_id == 0) throw std::invalid_argument("DistributedOptimizer::step: no context (id 0)");
  auto agent = this->agent();
  // Every other owner first, then ours on this thread (one part per owner).
  std::vector<rpc::RawFuture> all;
  all.reserve(parts_.size());
  const Part* mine = nullptr;
  for (const auto& part : parts_) {
    if (part.owner == agent->rank()) {
      mine = &part;
      continue;
    }
    all.push_back(agent->call(agent->get_worker_info(part.owner).name, "tandem.optim.step",
                               rpc::to_ivalues(part.id, static_cast<int64_t>(context_id)))
                      .raw());
  }
  std::exception_ptr local_error;
  if (mine) {
    try {
      OptimService::of(*agent)->step(mine->id, context_id);
    } catch (...) {
      local_error = std::current_exception();
    }
  }
  rpc::wait_raw_or_throw(rpc::when_all_raw(all), std::chrono::milliseconds(0),
                         "DistributedOptimizer::step");
  if (local_error) std::rethrow_exception(local_error);
}

std::vector<int> DistributedOptimizer::owners() const {
  std::vector<int> out;
  for (const auto& p : parts_) out.push_back(p.owner);
  return out;
}

size_t live_optimizers(rpc::Agent& agent) { return OptimService::of(agent)->live(); }

}  // namespace tandem::optim
