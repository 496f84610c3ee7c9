// The DistributedOptimizer's two sides: the owner's optimizers (an agent
// extension holding one LibTorch optimizer per id, and the "tandem.optim.*"
// handlers), and the caller's handle that groups parameters by owner.
#include "tandem/optim/distributed_optimizer.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/version.h>

#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/max.h>
#include <ATen/ops/norm.h>
#include <ATen/ops/stack.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

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

// The tensors LibTorch keeps for one parameter (some may be undefined).
std::vector<at::Tensor> state_tensors(const torch::optim::OptimizerParamState& s) {
  using namespace torch::optim;
  if (auto* x = dynamic_cast<const SGDParamState*>(&s)) return {x->momentum_buffer()};
  if (auto* x = dynamic_cast<const AdamParamState*>(&s)) {
    return {x->exp_avg(), x->exp_avg_sq(), x->max_exp_avg_sq()};
  }
  if (auto* x = dynamic_cast<const AdamWParamState*>(&s)) {
    return {x->exp_avg(), x->exp_avg_sq(), x->max_exp_avg_sq()};
  }
  if (auto* x = dynamic_cast<const AdagradParamState*>(&s)) return {x->sum()};
  if (auto* x = dynamic_cast<const RMSpropParamState*>(&s)) {
    return {x->square_avg(), x->momentum_buffer(), x->grad_avg()};
  }
  return {};
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

// A number for a message ("-1", "nan", "0.001").
std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
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
    local->kind = kind;
    local->options = options;
    local->params = params;
    local->optimizer = make_optimizer(kind, std::move(params), options);
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw rpc::ShutdownError("agent " + agent_.name() + " is shutting down");
    if (!optimizers_.emplace(id, std::move(local)).second) {
      throw std::invalid_argument("optimizer " + std::to_string(id) + " exists already");
    }
  }

  void step(int64_t id, uint64_t context_id) {
    // rpc/trace.h: each owner's local step, waiting for the lock included.
    rpc::TraceScope trace(agent_.tracer().get(), "optim");
    auto local = find(id);
    if (trace.on()) {
      trace.set_name("optimizer step");
      trace.set_args("{\"optimizer\":" + std::to_string(id) + ",\"context\":" +
                     std::to_string(context_id) + ",\"params\":" +
                     std::to_string(local->params.size()) + "}");
    }
    autograd::Gradients grads = autograd::get_gradients(agent_, context_id);
    std::lock_guard<std::mutex> lock(local->mu);  // steps on one optimizer are serialized
    // So are steps of different optimizers here: they may share parameters
    // (two trainers' optimizers over one parameter server's table), and a
    // step lends each parameter's .grad to its optimizer for its duration.
    std::lock_guard<std::mutex> steps(step_mu_);
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

  void set_lr(int64_t id, double lr) {
    auto local = find(id);
    std::lock_guard<std::mutex> lock(local->mu);
    set_lr(*local->optimizer, lr);
  }

  // Per parameter, the norm of its gradient in the context (on the CPU, in
  // the gradient's dtype, as clip_grad_norm_ computes it), or None.
  std::vector<c10::optional<at::Tensor>> grad_norms(int64_t id, uint64_t context_id,
                                                    double norm_type) {
    auto local = find(id);
    autograd::Gradients grads = autograd::get_gradients(agent_, context_id);
    std::vector<c10::optional<at::Tensor>> out;
    out.reserve(local->params.size());
    for (auto& p : local->params) {
      auto it = grads.find(p);
      if (it == grads.end()) {
        out.emplace_back(c10::nullopt);
        continue;
      }
      const at::Tensor& g = it->value();
      at::Tensor n = std::isinf(norm_type) ? g.abs().max() : at::norm(g, norm_type);
      out.emplace_back(n.cpu());
    }
    return out;
  }

  // Scales this optimizer's gradients in the context by `coef`, in place:
  // get_gradients hands out the context's own tensors, so the next
  // get_gradients (and step) sees the scaled ones.
  void scale_grads(int64_t id, uint64_t context_id, double coef) {
    auto local = find(id);
    autograd::Gradients grads = autograd::get_gradients(agent_, context_id);
    std::lock_guard<std::mutex> lock(local->mu);  // not in the middle of a step
    for (auto& p : local->params) {
      auto it = grads.find(p);
      if (it != grads.end()) it->value().mul_(coef);
    }
  }

  std::string state(int64_t id) {
    auto local = find(id);
    std::ostringstream bytes;
    {
      std::lock_guard<std::mutex> lock(local->mu);
      torch::serialize::OutputArchive archive;
      local->optimizer->save(archive);
      archive.save_to(bytes);
    }
    return std::move(bytes).str();
  }

  void load(int64_t id, const std::string& bytes, double lr) {
    auto local = find(id);
    // A fresh optimizer: LibTorch's load only adds the saved per-parameter
    // state to what is there, so a parameter with no saved state (SGD
    // before its first step) would keep this optimizer's. Swapped in only
    // once all of it was read.
    auto fresh = make_optimizer(local->kind, local->params, local->options);
    try {
      torch::serialize::InputArchive archive;
      archive.load_from(bytes.data(), bytes.size());
      fresh->load(archive);
    } catch (const c10::Error& e) {
      throw std::invalid_argument("the optimizer state for " + agent_.name() +
                                  " cannot be read: " + e.what_without_backtrace());
    }
    // Counts matched on the caller; shapes can only be seen here. A state of
    // another model would otherwise fail only at the next step.
    for (size_t i = 0; i < local->params.size(); ++i) {
      const at::Tensor& p = local->params[i];
      // torch::optim keys its state by the parameter's TensorImpl: as text in
      // LibTorch 1.x, as the pointer itself from 2.0 on.
#if TORCH_VERSION_MAJOR < 2
      auto it = fresh->state().find(c10::guts::to_string(p.unsafeGetTensorImpl()));
#else
      auto it = fresh->state().find(static_cast<void*>(p.unsafeGetTensorImpl()));
#endif
      if (it == fresh->state().end()) continue;
      for (const at::Tensor& t : state_tensors(*it->second)) {
        if (t.defined() && t.sizes() != p.sizes()) {
          std::ostringstream msg;
          msg << "the optimizer state for " << agent_.name() << " does not fit its parameter " << i
              << ": the state is of shape " << t.sizes() << ", the parameter " << p.sizes();
          throw std::invalid_argument(msg.str());
        }
      }
    }
    set_lr(*fresh, lr);
    std::unique_ptr<torch::optim::Optimizer> old;  // freed outside the lock
    std::lock_guard<std::mutex> lock(local->mu);
    old = std::exchange(local->optimizer, std::move(fresh));
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
    internal.def("tandem.optim.set_lr",
                 [self](int64_t id, double lr) { self()->set_lr(id, lr); });
    internal.def("tandem.optim.grad_norms", [self](int64_t id, int64_t context_id,
                                                   double norm_type) {
      return self()->grad_norms(id, static_cast<uint64_t>(context_id), norm_type);
    });
    internal.def("tandem.optim.scale_grads", [self](int64_t id, int64_t context_id, double coef) {
      self()->scale_grads(id, static_cast<uint64_t>(context_id), coef);
    });
    internal.def("tandem.optim.state", [self](int64_t id) { return self()->state(id); });
    internal.def("tandem.optim.load", [self](int64_t id, std::string bytes, double lr) {
      self()->load(id, bytes, lr);
    });
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
    std::mutex mu;  // serializes steps, lr changes, clipping and loads
    Kind kind;
    Options options;  // as created: a load starts from a fresh optimizer made with them
    std::vector<at::Tensor> params;
    std::unique_ptr<torch::optim::Optimizer> optimizer;
  };

  static void set_lr(torch::optim::Optimizer& optimizer, double lr) {
    for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
  }

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
  std::mutex step_mu_;  // one step at a time on this worker (after a Local's mu)
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
    : agent_(agent.weak_from_this()), kind_(kind), lr_(options.lr) {
  (void)kRegistered;
  if (params.empty()) throw std::invalid_argument("DistributedOptimizer: no parameters");
  std::map<int, std::vector<rpc::RRef<at::Tensor>>> by_owner;
  std::map<int, std::vector<size_t>> index;  // positions in `params`, by owner
  for (size_t i = 0; i < params.size(); ++i) {
    by_owner[params[i].owner().rank].push_back(params[i]);
    index[params[i].owner().rank].push_back(i);
  }
  auto service = OptimService::of(agent);
  std::vector<rpc::RawFuture> remote;
  try {
    for (auto& [owner, mine] : by_owner) {
      // Ids are unique per owner: this worker's rank above a counter.
      const int64_t id = (static_cast<int64_t>(agent.rank()) << 40) | g_next_id.fetch_add(1);
      parts_.push_back({owner, id, std::move(index[owner])});
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

std::vector<c10::IValue> DistributedOptimizer::on_owners(
    const std::string& what, const std::string& fn,
    const std::function<std::vector<c10::IValue>(const Part&)>& args,
    const std::function<c10::IValue(const Part&)>& local) const {
  auto agent = this->agent();
  // Every other owner first, then ours on this thread (one part per owner).
  std::vector<rpc::RawFuture> remote;
  remote.reserve(parts_.size());
  const Part* mine = nullptr;
  for (const auto& part : parts_) {
    if (part.owner == agent->rank()) {
      mine = &part;
      continue;
    }
    remote.push_back(agent->call(agent->get_worker_info(part.owner).name, fn, args(part)).raw());
  }
  c10::IValue local_result;
  std::exception_ptr local_error;
  if (mine) {
    try {
      local_result = local(*mine);
    } catch (...) {
      local_error = std::current_exception();
    }
  }
  rpc::RawFuture all = rpc::when_all_raw(remote);
  rpc::wait_raw_or_throw(all, std::chrono::milliseconds(0), what);
  if (local_error) std::rethrow_exception(local_error);
  auto values = all->value().toListRef();
  std::vector<c10::IValue> out;
  out.reserve(parts_.size());
  size_t next = 0;
  for (const auto& part : parts_) out.push_back(&part == mine ? local_result : values[next++]);
  return out;
}

void DistributedOptimizer::step(uint64_t context_id) {
  if (context_id == 0) throw std::invalid_argument("DistributedOptimizer::step: no context (id 0)");
  const auto agent = this->agent();
  auto service = OptimService::of(*agent);
  rpc::TraceScope trace(agent->tracer().get(), "optim");
  if (trace.on()) {
    trace.set_name("DistributedOptimizer::step");
    trace.set_args("{\"context\":" + std::to_string(context_id) + ",\"owners\":" +
                   std::to_string(parts_.size()) + "}");
  }
  on_owners(
      "DistributedOptimizer::step", "tandem.optim.step",
      [&](const Part& p) { return rpc::to_ivalues(p.id, static_cast<int64_t>(context_id)); },
      [&](const Part& p) {
        service->step(p.id, context_id);
        return c10::IValue();
      });
}

void DistributedOptimizer::set_lr(double lr) {
  if (!(lr >= 0) || std::isinf(lr)) {
    throw std::invalid_argument(
        "DistributedOptimizer::set_lr: the learning rate must be a finite number >= 0, got " +
        number(lr));
  }
  auto service = OptimService::of(*agent());
  on_owners(
      "DistributedOptimizer::set_lr", "tandem.optim.set_lr",
      [&](const Part& p) { return rpc::to_ivalues(p.id, lr); },
      [&](const Part& p) {
        service->set_lr(p.id, lr);
        return c10::IValue();
      });
  lr_ = lr;
}

double DistributedOptimizer::clip_grad_norm(uint64_t context_id, double max_norm,
                                            double norm_type) {
  const std::string what = "DistributedOptimizer::clip_grad_norm";
  if (context_id == 0) throw std::invalid_argument(what + ": no context (id 0)");
  if (!(max_norm > 0)) {
    throw std::invalid_argument(what + ": max_norm must be > 0, got " + number(max_norm));
  }
  if (!(norm_type >= 0)) {
    throw std::invalid_argument(what + ": norm_type must be >= 0 (or infinity), got " +
                                number(norm_type));
  }
  auto agent = this->agent();
  auto service = OptimService::of(*agent);
  const auto ctx = static_cast<int64_t>(context_id);
  auto results = on_owners(
      what, "tandem.optim.grad_norms",
      [&](const Part& p) { return rpc::to_ivalues(p.id, ctx, norm_type); },
      [&](const Part& p) { return rpc::to_ivalue(service->grad_norms(p.id, context_id, norm_type)); });
  // Back in the order of the constructor's parameters: stacked in that
  // order, the total is clip_grad_norm_'s over the same list to the last bit.
  size_t num_params = 0;
  for (const auto& part : parts_) num_params += part.index.size();
  std::vector<at::Tensor> by_param(num_params);
  for (size_t i = 0; i < parts_.size(); ++i) {
    const std::string from = agent->get_worker_info(parts_[i].owner).name;
    auto norms = rpc::from_ivalue<std::vector<c10::optional<at::Tensor>>>(
        results[i], "the gradient norms from " + from);
    if (norms.size() != parts_[i].index.size()) {
      throw std::runtime_error(what + ": " + from + " sent " + std::to_string(norms.size()) +
                               " gradient norms for its " +
                               std::to_string(parts_[i].index.size()) + " parameters");
    }
    for (size_t k = 0; k < norms.size(); ++k) {
      if (norms[k]) by_param[parts_[i].index[k]] = *norms[k];
    }
  }
  std::vector<at::Tensor> norms;
  for (auto& n : by_param) {
    if (n.defined()) norms.push_back(std::move(n));
  }
  if (norms.empty()) return 0.0;  // as clip_grad_norm_: nothing to clip
  // What clip_grad_norm_ computes, op for op (the same dtypes and rounding).
  at::Tensor total;
  if (std::isinf(norm_type)) {
    total = norms.size() == 1 ? norms[0] : at::max(at::stack(norms));
  } else if (norm_type == 0) {
    total = at::full({}, static_cast<double>(norms.size()));
  } else {
    total = norms.size() == 1 ? norms[0] : at::norm(at::stack(norms), norm_type);
  }
  const double coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0).item<double>();
  if (coef < 1) {  // a factor of 1 would change nothing
    on_owners(
        what, "tandem.optim.scale_grads",
        [&](const Part& p) { return rpc::to_ivalues(p.id, ctx, coef); },
        [&](const Part& p) {
          service->scale_grads(p.id, context_id, coef);
          return c10::IValue();
        });
  }
  return total.item<double>();
}

OptimizerState DistributedOptimizer::state_dict() const {
  auto agent = this->agent();
  auto service = OptimService::of(*agent);
  const double lr = this->lr();
  auto results = on_owners(
      "DistributedOptimizer::state_dict", "tandem.optim.state",
      [&](const Part& p) { return rpc::to_ivalues(p.id); },
      [&](const Part& p) { return c10::IValue(service->state(p.id)); });
  OptimizerState out;
  out.kind = kind_;
  out.lr = lr;
  for (size_t i = 0; i < parts_.size(); ++i) {
    OptimizerState::Part part;
    part.rank = parts_[i].owner;
    part.worker = agent->get_worker_info(part.rank).name;
    part.num_params = static_cast<int64_t>(parts_[i].index.size());
    part.bytes = rpc::from_ivalue<std::string>(results[i], "the optimizer state from " + part.worker);
    out.parts.push_back(std::move(part));
  }
  return out;
}

void DistributedOptimizer::load_state_dict(const OptimizerState& state) {
  const std::string what = "DistributedOptimizer::load_state_dict: ";
  auto agent = this->agent();
  if (state.kind != kind_) {
    throw std::invalid_argument(what + "the state is of a " + kind_name(state.kind) +
                                " optimizer, this one is " + kind_name(kind_));
  }
  if (!(state.lr >= 0) || std::isinf(state.lr)) {
    throw std::invalid_argument(what + "the state's learning rate is " + number(state.lr));
  }
  bool same_owners = state.parts.size() == parts_.size();
  for (size_t i = 0; same_owners && i < parts_.size(); ++i) {
    same_owners = state.parts[i].rank == parts_[i].owner;
  }
  if (!same_owners) {
    std::string theirs, ours;
    for (const auto& p : state.parts) {
      theirs += (theirs.empty() ? "" : ", ") +
                (p.worker.empty() ? "rank " + std::to_string(p.rank) : p.worker);
    }
    for (const auto& p : parts_) {
      ours += (ours.empty() ? "" : ", ") + agent->get_worker_info(p.owner).name;
    }
    throw std::invalid_argument(what + "the state is of owners [" + theirs +
                                "], this optimizer's are [" + ours + "]");
  }
  for (size_t i = 0; i < parts_.size(); ++i) {
    if (state.parts[i].num_params != static_cast<int64_t>(parts_[i].index.size())) {
      throw std::invalid_argument(what + "the state has " +
                                  std::to_string(state.parts[i].num_params) +
                                  " parameter(s) on " + agent->get_worker_info(parts_[i].owner).name +
                                  ", this optimizer " + std::to_string(parts_[i].index.size()));
    }
  }
  auto service = OptimService::of(*agent);
  auto bytes_of = [&](const Part& p) -> const std::string& {
    return state.parts[static_cast<size_t>(&p - parts_.data())].bytes;
  };
  on_owners(
      "DistributedOptimizer::load_state_dict", "tandem.optim.load",
      [&](const Part& p) { return rpc::to_ivalues(p.id, bytes_of(p), state.lr); },
      [&](const Part& p) {
        service->load(p.id, bytes_of(p), state.lr);
        return c10::IValue();
      });
  lr_ = state.lr;
}

void DistributedOptimizer::save(const std::string& path) const { save_state(state_dict(), path); }

void DistributedOptimizer::load(const std::string& path) { load_state_dict(load_state(path)); }

// ---- the checkpoint file -------------------------------------------------------------

namespace {

constexpr char kMagic[] = "TANDEM-OPTIM-STATE\n";
constexpr size_t kMagicSize = sizeof(kMagic) - 1;
constexpr uint32_t kVersion = 1;

uint64_t fnv1a(const char* data, size_t size) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < size; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 1099511628211ull;
  }
  return h;
}

void put_uint(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_f64(std::string& out, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_uint(out, bits, 8);
}
void put_bytes(std::string& out, const std::string& s) {
  put_uint(out, s.size(), 8);
  out += s;
}

// Reads the fields of a state whose hash matched; a length that runs past
// the end is still refused, naming the source.
class Reader {
 public:
  Reader(const std::string& data, size_t end, const std::string& source)
      : data_(data), end_(end), source_(source) {}
  uint64_t uint(int bytes) {
    need(static_cast<uint64_t>(bytes), "a number");
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) {
      v |= static_cast<uint64_t>(static_cast<unsigned char>(data_[pos_ + i])) << (8 * i);
    }
    pos_ += static_cast<size_t>(bytes);
    return v;
  }
  int64_t i64() { return static_cast<int64_t>(uint(8)); }
  double f64() {
    uint64_t bits = uint(8);
    double v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  std::string bytes(const char* what) {
    uint64_t n = uint(8);
    need(n, what);
    std::string out = data_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return out;
  }
  size_t left() const { return end_ - pos_; }
  [[noreturn]] void bad(const std::string& why) const {
    throw std::invalid_argument(source_ + " is corrupt: " + why);
  }

 private:
  void need(uint64_t n, const char* what) const {
    if (n > end_ - pos_) bad(std::string(what) + " runs past its end");
  }
  const std::string& data_;
  const size_t end_;
  const std::string& source_;
  size_t pos_ = kMagicSize;
};

}  // namespace

std::string state_to_bytes(const OptimizerState& state) {
  std::string out(kMagic, kMagicSize);
  put_uint(out, kVersion, 4);
  put_uint(out, static_cast<uint64_t>(state.kind), 8);
  put_f64(out, state.lr);
  put_uint(out, state.parts.size(), 8);
  for (const auto& p : state.parts) {
    put_uint(out, static_cast<uint64_t>(static_cast<int64_t>(p.rank)), 8);
    put_bytes(out, p.worker);
    put_uint(out, static_cast<uint64_t>(p.num_params), 8);
    put_bytes(out, p.bytes);
  }
  put_uint(out, fnv1a(out.data(), out.size()), 8);
  return out;
}

OptimizerState state_from_bytes(const std::string& data, const std::string& source) {
  if (data.size() < kMagicSize || data.compare(0, kMagicSize, kMagic, kMagicSize) != 0) {
    throw std::invalid_argument(source + " is not an optimizer checkpoint (it does not "
                                "start with TANDEM-OPTIM-STATE)");
  }
  auto corrupt = [&](const std::string& why) {
    return std::invalid_argument(source + " is corrupt: " + why);
  };
  if (data.size() < kMagicSize + 8) throw corrupt("it is truncated");
  // The last 8 bytes hash everything before them.
  const size_t end = data.size() - 8;
  uint64_t stored = 0;
  for (size_t i = 0; i < 8; ++i) {
    stored |= static_cast<uint64_t>(static_cast<unsigned char>(data[end + i])) << (8 * i);
  }
  if (stored != fnv1a(data.data(), end)) {
    throw corrupt("its hash does not match (truncated or altered)");
  }
  Reader in(data, end, source);
  if (uint64_t version = in.uint(4); version != kVersion) {
    in.bad("version " + std::to_string(version) + ", this build reads " + std::to_string(kVersion));
  }
  OptimizerState state;
  const int64_t kind = in.i64();
  if (kind < 0 || kind > static_cast<int64_t>(Kind::kRMSprop)) {
    in.bad("unknown optimizer kind " + std::to_string(kind));
  }
  state.kind = static_cast<Kind>(kind);
  state.lr = in.f64();
  const uint64_t parts = in.uint(8);
  if (parts > in.left() / 32) in.bad(std::to_string(parts) + " parts cannot fit in it");
  for (uint64_t i = 0; i < parts; ++i) {
    OptimizerState::Part p;
    p.rank = static_cast<int>(in.i64());
    p.worker = in.bytes("a worker name");
    p.num_params = in.i64();
    p.bytes = in.bytes("an optimizer state");
    state.parts.push_back(std::move(p));
  }
  if (in.left() != 0) in.bad(std::to_string(in.left()) + " bytes after its last part");
  return state;
}

void save_state(const OptimizerState& state, const std::string& path) {
  const std::string out = state_to_bytes(state);
  // Beside the target, then renamed over it: never half a checkpoint.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    if (!file) {
      throw std::runtime_error("cannot write optimizer checkpoint '" + path + "': " +
                               std::strerror(errno));
    }
    file.write(out.data(), static_cast<std::streamsize>(out.size()));
    file.close();
    if (!file) {
      std::remove(tmp.c_str());
      throw std::runtime_error("cannot write optimizer checkpoint '" + path + "'");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot write optimizer checkpoint '" + path + "': " + why);
  }
}

OptimizerState load_state(const std::string& path) {
  std::string data;
  {
    std::ifstream file(path, std::ios::binary);
    if (!file) {
      throw std::runtime_error("cannot open optimizer checkpoint '" + path + "': " +
                               std::strerror(errno));
    }
    std::ostringstream all;
    all << file.rdbuf();
    if (file.bad()) throw std::runtime_error("cannot read optimizer checkpoint '" + path + "'");
    data = std::move(all).str();
  }
  return state_from_bytes(data, "'" + path + "'");
}

std::vector<int> DistributedOptimizer::owners() const {
  std::vector<int> out;
  for (const auto& p : parts_) out.push_back(p.owner);
  return out;
}

size_t live_optimizers(rpc::Agent& agent) { return OptimService::of(agent)->live(); }

}  // namespace tandem::optim
