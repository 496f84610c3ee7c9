// The caller's side of the DistributedOptimizer: groups the parameters by
// owner and asks every owner's service (optim/owner/service.h) at once.
#include "tandem/optim/distributed_optimizer.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/max.h>
#include <ATen/ops/norm.h>
#include <ATen/ops/stack.h>

#include <atomic>
#include <cmath>
#include <map>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "tandem/ddp/process_group.h"
#include "tandem/optim/owner/protocol.h"
#include "tandem/optim/owner/service.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/trace.h"

namespace tandem::optim {
namespace {

using owner::OptimService;

// A number for a message ("-1", "nan", "0.001").
std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

std::atomic<int64_t> g_next_id{1};

}  // namespace

DistributedOptimizer::DistributedOptimizer(Kind kind,
                                           const std::vector<rpc::RRef<at::Tensor>>& params,
                                           const Options& options,
                                           const DistributedOptions& distributed)
    : DistributedOptimizer(*rpc::current_agent(), kind, params, options, distributed) {}

DistributedOptimizer::DistributedOptimizer(rpc::Agent& agent, Kind kind,
                                           const std::vector<rpc::RRef<at::Tensor>>& params,
                                           const Options& options,
                                           const DistributedOptions& distributed)
    : agent_(agent.weak_from_this()), kind_(kind), lr_(options.lr) {
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
    for (auto& [rank, mine] : by_owner) {
      // Ids are unique per owner: this worker's rank above a counter.
      const int64_t id = (static_cast<int64_t>(agent.rank()) << 40) | g_next_id.fetch_add(1);
      parts_.push_back({rank, id, std::move(index[rank])});
      if (rank == agent.rank()) {  // the caller's own parameters need no RPC
        std::vector<at::Tensor> tensors;
        for (auto& p : mine) tensors.push_back(p.local_value());
        service->create(id, kind, std::move(tensors), options, distributed.shard_group);
      } else {
        remote.push_back(
            agent
                .call(
                    agent.get_worker_info(rank).name, owner::kCreate,
                    owner::CreateRequest{id, kind, options, mine, distributed.shard_group}.encode())
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
        pending.push_back(agent
                              ->call(agent->get_worker_info(part.owner).name, owner::kDestroy,
                                     owner::IdRequest{part.id}.encode())
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
    trace.set_args("{\"context\":" + std::to_string(context_id) +
                   ",\"owners\":" + std::to_string(parts_.size()) + "}");
  }
  on_owners(
      "DistributedOptimizer::step", owner::kStep,
      [&](const Part& p) {
        return owner::StepRequest{p.id, context_id}.encode();
      },
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
      "DistributedOptimizer::set_lr", owner::kSetLr,
      [&](const Part& p) {
        return owner::SetLrRequest{p.id, lr}.encode();
      },
      [&](const Part& p) {
        service->set_lr(p.id, lr);
        return c10::IValue();
      });
  lr_ = lr;
}

double DistributedOptimizer::clip_grad_norm(uint64_t context_id, double max_norm,
                                            double norm_type) {
  ClipOptions o;
  o.norm_type = norm_type;
  return clip_grad_norm(context_id, max_norm, o);
}

double DistributedOptimizer::clip_grad_norm(uint64_t context_id, double max_norm,
                                            const ClipOptions& options) {
  const std::string what = "DistributedOptimizer::clip_grad_norm";
  const double norm_type = options.norm_type;
  if (context_id == 0) throw std::invalid_argument(what + ": no context (id 0)");
  if (!(max_norm > 0)) {
    throw std::invalid_argument(what + ": max_norm must be > 0, got " + number(max_norm));
  }
  if (!(norm_type >= 0)) {
    throw std::invalid_argument(what + ": norm_type must be >= 0 (or infinity), got " +
                                number(norm_type));
  }
  size_t num_params = 0;
  for (const auto& part : parts_) num_params += part.index.size();
  if (!options.counted.empty() && options.counted.size() != num_params) {
    throw std::invalid_argument(what + ": ClipOptions::counted has " +
                                std::to_string(options.counted.size()) + " entries for " +
                                std::to_string(num_params) + " parameters");
  }
  auto agent = this->agent();
  auto service = OptimService::of(*agent);
  auto results = on_owners(
      what, owner::kGradNorms,
      [&](const Part& p) {
        return owner::GradNormsRequest{p.id, context_id, norm_type}.encode();
      },
      [&](const Part& p) {
        return owner::GradNormsReply{service->grad_norms(p.id, context_id, norm_type)}.encode();
      });
  // Back in the order of the constructor's parameters: stacked in that
  // order, the total is clip_grad_norm_'s over the same list to the last bit.
  std::vector<at::Tensor> by_param(num_params);
  for (size_t i = 0; i < parts_.size(); ++i) {
    const std::string from = agent->get_worker_info(parts_[i].owner).name;
    auto norms = owner::GradNormsReply::decode(results[i], parts_[i].index.size(), from).norms;
    for (size_t k = 0; k < norms.size(); ++k) {
      if (norms[k]) by_param[parts_[i].index[k]] = *norms[k];
    }
  }
  std::vector<at::Tensor> norms;
  for (size_t i = 0; i < by_param.size(); ++i) {
    if (by_param[i].defined() && (options.counted.empty() || options.counted[i])) {
      norms.push_back(std::move(by_param[i]));
    }
  }
  at::Tensor total;
  if (options.group && options.group->size() > 1) {
    // This rank's share, summed (or maxed) over the group: every rank joins,
    // with or without gradients of its own.
    const bool inf = std::isinf(norm_type);
    double share = 0;
    for (const auto& n : norms) {
      const double v = n.item<double>();
      share = inf ? std::max(share, v) : norm_type == 0 ? share + 1 : share + std::pow(v, norm_type);
    }
    at::Tensor t = at::full({1}, share, at::kDouble);
    options.group->all_reduce(t, inf ? ddp::ReduceOp::kMax : ddp::ReduceOp::kSum);
    const double sum = t.item<double>();
    const double value = inf || norm_type == 0 ? sum : std::pow(sum, 1.0 / norm_type);
    total = at::full({}, value, at::kFloat);
  } else {
    if (norms.empty()) return 0.0;  // as clip_grad_norm_: nothing to clip
    // What clip_grad_norm_ computes, op for op (the same dtypes and rounding).
    if (std::isinf(norm_type)) {
      total = norms.size() == 1 ? norms[0] : at::max(at::stack(norms));
    } else if (norm_type == 0) {
      total = at::full({}, static_cast<double>(norms.size()));
    } else {
      total = norms.size() == 1 ? norms[0] : at::norm(at::stack(norms), norm_type);
    }
  }
  const double coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0).item<double>();
  if (coef < 1) {  // a factor of 1 would change nothing
    on_owners(
        what, owner::kScaleGrads,
        [&](const Part& p) {
          return owner::ScaleGradsRequest{p.id, context_id, coef}.encode();
        },
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
      "DistributedOptimizer::state_dict", owner::kState,
      [&](const Part& p) { return owner::IdRequest{p.id}.encode(); },
      [&](const Part& p) { return owner::StateReply{service->state(p.id)}.encode(); });
  OptimizerState out;
  out.kind = kind_;
  out.lr = lr;
  for (size_t i = 0; i < parts_.size(); ++i) {
    OptimizerState::Part part;
    part.rank = parts_[i].owner;
    part.worker = agent->get_worker_info(part.rank).name;
    part.num_params = static_cast<int64_t>(parts_[i].index.size());
    part.bytes = owner::StateReply::decode(results[i], part.worker).bytes;
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
                                  std::to_string(state.parts[i].num_params) + " parameter(s) on " +
                                  agent->get_worker_info(parts_[i].owner).name +
                                  ", this optimizer " + std::to_string(parts_[i].index.size()));
    }
  }
  auto service = OptimService::of(*agent);
  auto bytes_of = [&](const Part& p) -> const std::string& {
    return state.parts[static_cast<size_t>(&p - parts_.data())].bytes;
  };
  on_owners(
      "DistributedOptimizer::load_state_dict", owner::kLoad,
      [&](const Part& p) {
        return owner::LoadRequest{p.id, bytes_of(p), state.lr}.encode();
      },
      [&](const Part& p) {
        service->load(p.id, bytes_of(p), state.lr);
        return c10::IValue();
      });
  lr_ = state.lr;
}

void DistributedOptimizer::save(const std::string& path) const { save_state(state_dict(), path); }

void DistributedOptimizer::load(const std::string& path) { load_state_dict(load_state(path)); }

std::vector<int> DistributedOptimizer::owners() const {
  std::vector<int> out;
  for (const auto& p : parts_) out.push_back(p.owner);
  return out;
}

std::vector<DistributedOptimizer::OwnerPart> DistributedOptimizer::owner_parts() const {
  std::vector<OwnerPart> out;
  for (const Part& p : parts_) out.push_back({p.owner, p.id, p.index});
  return out;
}

size_t live_optimizers(rpc::Agent& agent) { return OptimService::of(agent)->live(); }

}  // namespace tandem::optim
