#include "tandem/optim/owner/service.h"

#include <ATen/ops/empty.h>

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <ATen/ops/abs.h>
#include <ATen/ops/max.h>
#include <ATen/ops/norm.h>

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "tandem/autograd/autograd.h"
#include "tandem/ddp/process_group.h"
#include "tandem/optim/owner/local_optimizer.h"
#include "tandem/optim/owner/protocol.h"
#include "tandem/optim/param_state.h"
#include "tandem/optim/zero_redundancy_optimizer.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/layer.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rref.h"
#include "tandem/rpc/trace.h"

namespace tandem::optim::owner {
namespace {

const bool kRegistered = [] {
  rpc::register_agent_extension(
      [](rpc::Agent& agent) { return std::make_shared<OptimService>(agent); });
  return true;
}();

void restore(std::vector<at::Tensor>& params, std::vector<at::Tensor>& saved) {
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = std::move(saved[i]);
}

}  // namespace

struct OptimService::Local {
  std::mutex mu;  // serializes steps, lr changes, clipping and loads
  Kind kind;
  Options options;  // as created: a load starts from a fresh optimizer made with them
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // null when sharded
  // Sharded (a shard group): ZeRO stage 1 over the group's ranks, the
  // owners of these parameters in the other replicas.
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
};

OptimService::OptimService(rpc::Agent& agent) : agent_(agent) {}

OptimService::~OptimService() = default;

std::shared_ptr<OptimService> OptimService::of(rpc::Agent& agent) {
  (void)kRegistered;
  return rpc::layer::require_extension<OptimService>(agent, "distributed optimizer", "optim");
}

void OptimService::create(int64_t id, Kind kind, std::vector<at::Tensor> params,
                          const Options& options, const std::string& shard_group) {
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
  if (shard_group.empty()) {
    local->optimizer = make_optimizer(kind, std::move(params), options);
  } else {
    ZeroOptions z;
    z.group = ddp::find_group(agent_, shard_group);
    if (!z.group) {
      throw std::invalid_argument("no process group '" + shard_group + "' on " + agent_.name() +
                                  " to shard the optimizer's state over (make the mesh there, "
                                  "or ddp::register_group it)");
    }
    // Collective: the owners in the other replicas make theirs now too.
    local->zero = std::make_unique<ZeroRedundancyOptimizer>(std::move(params), kind, options, z);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw rpc::ShutdownError("agent " + agent_.name() + " is shutting down");
  if (!optimizers_.emplace(id, std::move(local)).second) {
    throw std::invalid_argument("optimizer " + std::to_string(id) + " exists already");
  }
}

void OptimService::step(int64_t id, uint64_t context_id) {
  // rpc/trace.h: each owner's local step, waiting for the lock included.
  rpc::TraceScope trace(agent_.tracer().get(), "optim");
  auto local = find(id);
  if (trace.on()) {
    trace.set_name("optimizer step");
    trace.set_args("{\"optimizer\":" + std::to_string(id) +
                   ",\"context\":" + std::to_string(context_id) +
                   ",\"params\":" + std::to_string(local->params.size()) + "}");
  }
  autograd::Gradients grads = autograd::get_gradients(agent_, context_id);
  std::shared_lock<std::shared_mutex> writing(params_mu_);  // (between_steps waits)
  struct Counted {  // (destroyed before `writing`: a failed step may have moved some)
    std::atomic<int64_t>& n;
    ~Counted() { n.fetch_add(1); }
  } counted{steps_taken_};
  std::lock_guard<std::mutex> lock(local->mu);  // steps on one optimizer are serialized
  // So are steps of different optimizers here: they may share parameters
  // (two trainers' optimizers over one parameter server's table), and a
  // step lends each parameter's .grad to its optimizer for its duration.
  // (A sharded optimizer's step waits for the other replicas: it does not
  // hold the worker's other optimizers up meanwhile.)
  std::unique_lock<std::mutex> steps(step_mu_, std::defer_lock);
  if (!local->zero) steps.lock();
  std::vector<at::Tensor> saved;
  saved.reserve(local->params.size());
  for (auto& p : local->params) {
    saved.push_back(p.grad());
    auto it = grads.find(p);
    // No gradient in this context: LibTorch's optimizers skip the parameter.
    p.mutable_grad() = it == grads.end() ? at::Tensor() : it->value();
  }
  try {
    if (local->zero) {
      local->zero->step();  // collective over the shard group
    } else {
      local->optimizer->step();
    }
  } catch (...) {
    restore(local->params, saved);
    throw;
  }
  restore(local->params, saved);
}

int64_t OptimService::between_steps(const std::function<void()>& fn) {
  std::unique_lock<std::shared_mutex> no_step(params_mu_);
  fn();
  return steps_taken_.load();
}

void OptimService::set_lr(int64_t id, double lr) {
  auto local = find(id);
  std::lock_guard<std::mutex> lock(local->mu);
  if (local->zero) {
    local->zero->set_lr(lr);
  } else {
    owner::set_lr(*local->optimizer, lr);
  }
}

std::vector<c10::optional<at::Tensor>> OptimService::grad_norms(int64_t id, uint64_t context_id,
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

void OptimService::scale_grads(int64_t id, uint64_t context_id, double coef) {
  auto local = find(id);
  autograd::Gradients grads = autograd::get_gradients(agent_, context_id);
  std::lock_guard<std::mutex> lock(local->mu);  // not in the middle of a step
  for (auto& p : local->params) {
    auto it = grads.find(p);
    if (it != grads.end()) it->value().mul_(coef);
  }
}

std::string OptimService::state(int64_t id) {
  auto local = find(id);
  if (local->zero) {
    // Collective: the shares gathered to the group's rank 0, which answers
    // the whole archive (as an unsharded owner's); the others answer none.
    std::lock_guard<std::mutex> lock(local->mu);
    local->zero->consolidate_state_dict(0);
    return local->zero->rank() == 0 ? local->zero->state_dict() : std::string();
  }
  std::lock_guard<std::mutex> lock(local->mu);
  return state_bytes(*local->optimizer);
}

std::vector<size_t> OptimService::held(const Local& local) {
  if (local.zero) return local.zero->share(local.zero->rank());
  std::vector<size_t> out(local.params.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = i;
  return out;
}

torch::optim::Optimizer* OptimService::keeper(const Local& local) {
  return local.zero ? local.zero->local_optimizer() : local.optimizer.get();
}

std::vector<size_t> OptimService::held_params(int64_t id) {
  auto local = find(id);
  std::lock_guard<std::mutex> lock(local->mu);
  return held(*local);
}

std::pair<Kind, std::vector<std::vector<int64_t>>> OptimService::layout(int64_t id) {
  auto local = find(id);
  std::vector<std::vector<int64_t>> shapes;
  for (const at::Tensor& p : local->params) shapes.push_back(p.sizes().vec());
  return {local->kind, std::move(shapes)};
}

std::vector<OptimService::CutSnapshot> OptimService::param_state_snapshots(int64_t id,
                                                                           const Cut& cut) {
  auto local = find(id);
  std::lock_guard<std::mutex> lock(local->mu);
  torch::optim::Optimizer* optimizer = keeper(*local);
  const std::function<std::string()> none = [] { return std::string(); };
  std::vector<CutSnapshot> out;
  for (size_t i : held(*local)) {
    const at::Tensor& p = local->params[i];
    const auto cuts = cut(i, p);
    if (!cuts) continue;
    const auto& ranges = *cuts;
    if (ranges.empty()) {
      out.push_back({i, 0, -1, optimizer ? param_state_snapshot(*optimizer, p) : none});
    }
    for (const auto& [start, numel] : ranges) {
      out.push_back({i, start, numel,
                     optimizer ? param_state_slice_snapshot(*optimizer, p, start, numel) : none});
    }
  }
  return out;
}

std::vector<at::Tensor> OptimService::params(int64_t id) { return find(id)->params; }

std::vector<std::pair<size_t, std::function<std::string()>>> OptimService::param_state_snapshots(
    int64_t id) {
  auto local = find(id);
  std::lock_guard<std::mutex> lock(local->mu);
  torch::optim::Optimizer* optimizer = keeper(*local);
  std::vector<std::pair<size_t, std::function<std::string()>>> out;
  for (size_t i : held(*local)) {
    out.emplace_back(i, optimizer ? param_state_snapshot(*optimizer, local->params[i])
                                  : std::function<std::string()>([] { return std::string(); }));
  }
  return out;
}

void OptimService::check_param_states(int64_t id, const StateOf& bytes_of) {
  auto local = find(id);
  const Kind kind = local->kind;
  for (size_t i : held_params(id)) {
    // A one-parameter optimizer of the kind over a stand-in of the shape.
    at::Tensor stand_in =
        at::empty(local->params[i].sizes(), local->params[i].options().device(at::kCPU));
    auto scratch = make_optimizer(kind, {stand_in}, local->options);
    try {
      if (auto bytes = bytes_of(i)) load_param_state(*scratch, stand_in, *bytes);
    } catch (const std::exception& e) {
      throw std::invalid_argument("parameter " + std::to_string(i) + ": " + e.what());
    }
  }
}

void OptimService::load_param_states(int64_t id, const StateOf& bytes_of, double lr) {
  auto local = find(id);
  if (local->zero) {
    // (checked whole first: the live optimizer is loaded into in place)
    check_param_states(id, bytes_of);
    std::lock_guard<std::mutex> lock(local->mu);
    if (torch::optim::Optimizer* mine = keeper(*local)) {
      for (size_t i : held(*local)) {
        if (auto bytes = bytes_of(i)) load_param_state(*mine, local->params[i], *bytes);
      }
    }
    local->zero->set_lr(lr);
    return;
  }
  // A parameter with no saved state keeps the fresh optimizer's own.
  auto fresh = make_optimizer(local->kind, local->params, local->options);
  for (size_t i = 0; i < local->params.size(); ++i) {
    if (auto bytes = bytes_of(i)) load_param_state(*fresh, local->params[i], *bytes);
  }
  owner::set_lr(*fresh, lr);
  std::lock_guard<std::mutex> lock(local->mu);
  local->optimizer = std::move(fresh);
}

void OptimService::load(int64_t id, const std::string& bytes, double lr) {
  auto local = find(id);
  if (local->zero) {
    // Each replica's owner takes its share of the whole archive.
    std::lock_guard<std::mutex> lock(local->mu);
    local->zero->load_state_dict(bytes);
    local->zero->set_lr(lr);
    return;
  }
  // A fresh optimizer: LibTorch's load only adds the saved per-parameter
  // state to what is there, so a parameter with no saved state (SGD
  // before its first step) would keep this optimizer's. Swapped in only
  // once all of it was read.
  auto fresh = make_optimizer(local->kind, local->params, local->options);
  try {
    load_state_bytes(*fresh, bytes);
  } catch (const c10::Error& e) {
    throw std::invalid_argument("the optimizer state for " + agent_.name() +
                                " cannot be read: " + e.what_without_backtrace());
  }
  // Counts matched on the caller; shapes can only be seen here. A state of
  // another model would otherwise fail only at the next step.
  for (size_t i = 0; i < local->params.size(); ++i) {
    const at::Tensor& p = local->params[i];
    const torch::optim::OptimizerParamState* s = find_state(*fresh, p);
    if (!s) continue;
    for (const at::Tensor& t : state_tensors(*s)) {
      if (t.defined() && t.sizes() != p.sizes()) {
        std::ostringstream msg;
        msg << "the optimizer state for " << agent_.name() << " does not fit its parameter " << i
            << ": the state is of shape " << t.sizes() << ", the parameter " << p.sizes();
        throw std::invalid_argument(msg.str());
      }
    }
  }
  owner::set_lr(*fresh, lr);
  std::unique_ptr<torch::optim::Optimizer> old;  // freed outside the lock
  std::lock_guard<std::mutex> lock(local->mu);
  old = std::exchange(local->optimizer, std::move(fresh));
}

void OptimService::destroy(int64_t id) {
  std::shared_ptr<Local> dead;  // freed outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto it = optimizers_.find(id);
  if (it == optimizers_.end()) return;  // idempotent
  dead = std::move(it->second);
  optimizers_.erase(it);
}

size_t OptimService::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  return optimizers_.size();
}

void OptimService::register_handlers(rpc::Registry& internal) {
  std::weak_ptr<OptimService> weak = weak_from_this();
  auto self = [weak] {
    auto s = weak.lock();
    if (!s) throw rpc::ShutdownError("the distributed optimizer is shut down");
    return s;
  };
  // Each decodes its message (protocol.h) before it touches the service.
  internal.def_ivalue(kCreate, [self](std::vector<c10::IValue>& args) {
    CreateRequest m = CreateRequest::decode(args);
    std::vector<at::Tensor> tensors;
    tensors.reserve(m.params.size());
    for (auto& p : m.params) tensors.push_back(p.local_value());
    self()->create(m.id, m.kind, std::move(tensors), m.options, m.shard_group);
    return c10::IValue();
  });
  internal.def_ivalue(kStep, [self](std::vector<c10::IValue>& args) {
    StepRequest m = StepRequest::decode(args);
    self()->step(m.id, m.context_id);
    return c10::IValue();
  });
  internal.def_ivalue(kDestroy, [self](std::vector<c10::IValue>& args) {
    self()->destroy(IdRequest::decode(args, kDestroy).id);
    return c10::IValue();
  });
  internal.def_ivalue(kSetLr, [self](std::vector<c10::IValue>& args) {
    SetLrRequest m = SetLrRequest::decode(args);
    self()->set_lr(m.id, m.lr);
    return c10::IValue();
  });
  internal.def_ivalue(kGradNorms, [self](std::vector<c10::IValue>& args) {
    GradNormsRequest m = GradNormsRequest::decode(args);
    return GradNormsReply{self()->grad_norms(m.id, m.context_id, m.norm_type)}.encode();
  });
  internal.def_ivalue(kScaleGrads, [self](std::vector<c10::IValue>& args) {
    ScaleGradsRequest m = ScaleGradsRequest::decode(args);
    self()->scale_grads(m.id, m.context_id, m.coef);
    return c10::IValue();
  });
  internal.def_ivalue(kState, [self](std::vector<c10::IValue>& args) {
    return StateReply{self()->state(IdRequest::decode(args, kState).id)}.encode();
  });
  internal.def_ivalue(kLoad, [self](std::vector<c10::IValue>& args) {
    LoadRequest m = LoadRequest::decode(args);
    self()->load(m.id, m.bytes, m.lr);
    return c10::IValue();
  });
}

std::vector<std::string> OptimService::live_objects() const {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, _] : optimizers_)
    out.push_back("distributed optimizer " + std::to_string(id));
  return out;
}

void OptimService::close() {
  std::map<int64_t, std::shared_ptr<Local>> dead;
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  dead.swap(optimizers_);
}

std::shared_ptr<OptimService::Local> OptimService::find(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = optimizers_.find(id);
  if (it == optimizers_.end()) {
    throw std::invalid_argument("no distributed optimizer " + std::to_string(id) + " on " +
                                agent_.name());
  }
  return it->second;
}

}  // namespace tandem::optim::owner
