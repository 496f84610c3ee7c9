// FullyShardedDataParallel's construction (ddp/fsdp/impl.h): the units
// found and checked, the ranks' models compared, rank 0's parameters and
// buffers taken, each unit's flat buffer and this rank's shard, the
// gradient hooks; and the public methods that only forward to Impl.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>

#include "tandem/ddp/fsdp/impl.h"

namespace tandem::ddp {
namespace {

bool holds(const std::string& outer, const std::string& inner) {
  return outer.empty() || inner.rfind(outer + ".", 0) == 0;
}

}  // namespace

void FullyShardedDataParallel::Impl::setup(FSDPOptions options) {
  opt = std::move(options);
  const std::string who = "FullyShardedDataParallel: ";
  if (!model) throw std::invalid_argument(who + "the model is null");
  if (group) {
    layout_rank = group->rank();
    layout_size = group->size();
  }
  if (group && group->backend() != "gloo" && group->backend() != "nccl") {
    throw std::invalid_argument(who + "unknown backend " + group->backend());
  }
  if (opt.param_dtype && *opt.param_dtype != at::kHalf && *opt.param_dtype != at::kBFloat16 &&
      *opt.param_dtype != at::kFloat && *opt.param_dtype != at::kDouble) {
    throw std::invalid_argument(who + "param_dtype " + c10::toString(*opt.param_dtype) +
                                " is not a floating-point dtype to compute in");
  }
  // What is wrong with the units or the parameters fails on every rank: the
  // error goes into the lines the ranks compare.
  std::string refused;
  std::vector<std::string> lines;
  try {
    // The units: named submodules, none inside another.
    std::vector<std::string> names = opt.units;
    if (names.empty()) {
      for (const auto& item : model->named_children()) {
        if (!item.value()->parameters().empty()) names.push_back(item.key());
      }
    }
    std::unordered_map<std::string, std::shared_ptr<torch::nn::Module>> modules;
    for (const auto& item : model->named_modules("", /*include_self=*/false)) {
      modules[item.key()] = item.value();
    }
    units.assign(1, Unit{});  // the root
    for (size_t i = 0; i < names.size(); ++i) {
      if (!modules.count(names[i])) {
        throw std::invalid_argument(who + "unit '" + names[i] +
                                    "' is not a submodule of the model");
      }
      for (size_t j = 0; j < i; ++j) {
        if (names[i] == names[j] || holds(names[j], names[i]) || holds(names[i], names[j])) {
          throw std::invalid_argument(
              who + "units '" + names[j] + "' and '" + names[i] + "' overlap (" +
              (names[i] == names[j] ? "the same unit twice" : "one holds the other") + ")");
        }
      }
      if (sequential && names[i].find('.') != std::string::npos) {
        throw std::invalid_argument(who + "unit '" + names[i] +
                                    "' is not a child of the Sequential; its units are its "
                                    "children (\"0\", \"1\", ...)");
      }
      Unit u;
      u.name = names[i];
      unit_of_name[names[i]] = units.size();
      units.push_back(std::move(u));
    }
    // Every parameter, into the unit that holds it (the deepest named one).
    std::unordered_map<c10::TensorImpl*, size_t> seen;
    for (const auto& item : model->named_parameters(/*recurse=*/true)) {
      const at::Tensor& t = item.value();
      size_t unit = 0;
      for (size_t k = 1; k < units.size(); ++k) {
        if (holds(units[k].name, item.key())) unit = k;
      }
      if (auto it = seen.find(t.unsafeGetTensorImpl()); it != seen.end()) {
        const Param& first = params[it->second];
        if (first.unit != unit) {
          throw std::invalid_argument(
              who + "parameter '" + item.key() + "' is also '" + first.name + "', shared by " +
              (unit ? "unit '" + units[unit].name + "'" : std::string("the root")) + " and " +
              (first.unit ? "unit '" + units[first.unit].name + "'" : std::string("the root")) +
              ": put both in one unit");
        }
        continue;
      }
      if (!t.requires_grad()) {
        throw std::invalid_argument(who + "parameter '" + item.key() +
                                    "' does not require grad: FSDP shards trainable parameters "
                                    "(keep frozen ones as buffers)");
      }
      if (!t.is_floating_point()) {
        throw std::invalid_argument(who + "parameter '" + item.key() + "' is " +
                                    c10::toString(t.scalar_type()) + ", not floating point");
      }
      const bool nccl = group && group->backend() == "nccl";
      if (group && nccl != t.device().is_cuda()) {
        throw std::invalid_argument(who + "parameter '" + item.key() + "' is on " +
                                    t.device().str() + "; a " + group->backend() + " group takes " +
                                    (nccl ? "CUDA" : "CPU") + " tensors");
      }
      seen[t.unsafeGetTensorImpl()] = params.size();
      Param p;
      p.name = item.key();
      p.tensor = t;
      p.shape = t.sizes().vec();
      p.unit = unit;
      p.numel = t.numel();
      params.push_back(std::move(p));
    }
    for (const auto& item : model->named_buffers(/*recurse=*/true)) {
      buffers.emplace_back(item.key(), item.value());
    }
    for (size_t k = 1; k < units.size(); ++k) {
      bool any = false;
      for (const auto& p : params) any = any || p.unit == k;
      if (!any) throw std::invalid_argument(who + "unit '" + units[k].name + "' has no parameters");
    }
    // The ranks build the same model, with the same units.
    for (const auto& u : units) {
      if (!u.name.empty()) lines.push_back("unit '" + u.name + "'");
    }
    for (const auto& p : params) {
      lines.push_back("'" + p.name + "' " + c10::str(at::IntArrayRef(p.shape)) + " " +
                      c10::toString(p.tensor.scalar_type()));
    }
    for (const auto& [name, b] : buffers) {
      lines.push_back("buffer '" + name + "' " + c10::str(b.sizes()) + " " +
                      c10::toString(b.scalar_type()));
    }
  } catch (const std::invalid_argument& e) {
    refused = e.what();
    lines = {"an error: " + refused};
  }
  const c10::Device device = params.empty() ? c10::Device(c10::kCPU) : params[0].tensor.device();
  if (opt.sync_module_states) {
    group->expect_same_lines(lines, "FullyShardedDataParallel", "models", "entry",
                             "every rank must build the same model with the same units", timeout(),
                             device);
  }
  if (!refused.empty()) throw std::invalid_argument(refused);
  if (params.empty()) throw std::invalid_argument(who + "the model has no parameters");

  c10::AutoGradMode no_grad(false);
  for (size_t k = 0; k < units.size(); ++k) {
    Unit& u = units[k];
    at::ScalarType dtype = at::ScalarType::Undefined;
    for (size_t i = 0; i < params.size(); ++i) {
      Param& p = params[i];
      if (p.unit != k) continue;
      if (dtype == at::ScalarType::Undefined) dtype = p.tensor.scalar_type();
      if (p.tensor.scalar_type() != dtype) {
        throw std::invalid_argument(who + "parameter '" + p.name + "' is " +
                                    c10::toString(p.tensor.scalar_type()) + ", its unit's first " +
                                    c10::toString(dtype) + ": a unit's parameters share a dtype");
      }
      p.offset = u.numel;
      u.numel += p.numel;
      u.params.push_back(i);
    }
    if (u.params.empty()) continue;  // a root without parameters
    // (at least one element a rank: Gloo's collectives fail on none, and a
    // unit of empty parameters still runs them)
    u.shard_numel = std::max<int64_t>(1, (u.numel + size() - 1) / size());
    u.padded = u.shard_numel * size();
    const at::Tensor& like = params[u.params.front()].tensor;
    // Rank 0's values: its flat buffer, broadcast.
    u.full = at::zeros({u.padded}, like.options());
    for (size_t i : u.params) {
      u.full.narrow(0, params[i].offset, params[i].numel).copy_(params[i].tensor.reshape({-1}));
    }
    if (opt.sync_module_states && size() > 1) group->broadcast(u.full, 0, timeout());
    if (opt.sync_module_states && opt.replicate_group && opt.replicate_group->size() > 1) {
      opt.replicate_group->broadcast(u.full, 0, timeout());
    }
    u.shard = u.full.narrow(0, static_cast<int64_t>(rank()) * u.shard_numel, u.shard_numel)
                  .clone()
                  .requires_grad_(true);
    // Mixed precision: the flat buffer (and so the parameters and their
    // gradients) in the compute dtype, before the accumulators are made.
    if (opt.param_dtype && *opt.param_dtype != dtype) u.full = u.full.to(*opt.param_dtype);
    // Each parameter a view of the flat buffer for good; its gradient
    // accumulator made now, while it has its shape, and kept.
    for (size_t i : u.params) {
      Param& p = params[i];
      p.tensor.set_data(u.full.narrow(0, p.offset, p.numel).view(p.shape));
      p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
      p.hook_key = p.accumulator->add_post_hook(std::make_unique<ReadyHook>(this, i));
    }
    u.state = Unit::State::kGathered;
    free_unit(k);
  }
  // Buffers are not sharded: rank 0's, once.
  for (auto& [name, b] : buffers) {
    if (!opt.sync_module_states) break;
    if (size() > 1) group->broadcast(b, 0, timeout());
    if (opt.replicate_group && opt.replicate_group->size() > 1) {
      opt.replicate_group->broadcast(b, 0, timeout());
    }
  }
}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> model,
                                                   FSDPOptions options,
                                                   std::shared_ptr<ProcessGroup> group)
    : impl_(std::make_unique<Impl>()) {
  impl_->model = std::move(model);
  impl_->group = group ? std::move(group) : default_group_ptr();
  impl_->setup(std::move(options));
}

FullyShardedDataParallel::FullyShardedDataParallel(torch::nn::Sequential model, FSDPOptions options,
                                                   std::shared_ptr<ProcessGroup> group)
    : impl_(std::make_unique<Impl>()) {
  impl_->model = model.ptr();
  impl_->sequential = model;
  impl_->group = group ? std::move(group) : default_group_ptr();
  impl_->setup(std::move(options));
}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> model,
                                                   FSDPOptions options, int rank, int size)
    : impl_(std::make_unique<Impl>()) {
  impl_->model = std::move(model);
  impl_->start_without_group(rank, size, options);
  impl_->setup(std::move(options));
}

FullyShardedDataParallel::FullyShardedDataParallel(torch::nn::Sequential model, FSDPOptions options,
                                                   int rank, int size)
    : impl_(std::make_unique<Impl>()) {
  impl_->model = model.ptr();
  impl_->sequential = model;
  impl_->start_without_group(rank, size, options);
  impl_->setup(std::move(options));
}

void FullyShardedDataParallel::Impl::start_without_group(int rank, int size,
                                                         FSDPOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw std::invalid_argument("FullyShardedDataParallel: rank " + std::to_string(rank) +
                                " of " + std::to_string(size) + " is no place in a group");
  }
  if (options.replicate_group) {
    throw std::invalid_argument(
        "FullyShardedDataParallel: a replicate_group needs the sharding group at construction");
  }
  layout_rank = rank;
  layout_size = size;
  options.sync_module_states = false;
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  if (!impl_) return;
  try {
    impl_->abandon_step();
  } catch (...) {
  }
  for (auto& p : impl_->params) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

std::shared_ptr<torch::nn::Module> FullyShardedDataParallel::module() const { return impl_->model; }
ProcessGroup& FullyShardedDataParallel::group() { return *impl_->group; }

void FullyShardedDataParallel::set_group(std::shared_ptr<ProcessGroup> group) {
  const std::string who = "FullyShardedDataParallel::set_group: ";
  if (!group) throw std::invalid_argument(who + "the group is null");
  if (group->size() != impl_->size() || group->rank() != impl_->rank()) {
    throw std::invalid_argument(who + "the new group has this process as rank " +
                                std::to_string(group->rank()) + " of " +
                                std::to_string(group->size()) + ", the old one as rank " +
                                std::to_string(impl_->rank()) + " of " +
                                std::to_string(impl_->size()) + " (the shards are laid out by them)");
  }
  if (impl_->group && group->backend() != impl_->group->backend()) {
    throw std::invalid_argument(who + "the new group's backend is " + group->backend() +
                                ", the old one's " + impl_->group->backend());
  }
  if (group->backend() != "gloo" && group->backend() != "nccl") {
    throw std::invalid_argument(who + "unknown backend " + group->backend());
  }
  for (const auto& u : impl_->units) {
    if (u.shard.defined() && u.shard.device().is_cuda() != (group->backend() == "nccl")) {
      throw std::invalid_argument(who + "the shards are on " + u.shard.device().str() + "; a " +
                                  group->backend() + " group takes " +
                                  (group->backend() == "nccl" ? "CUDA" : "CPU") + " tensors");
    }
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->in_forward) throw std::logic_error(who + "called inside forward()");
  }
  impl_->abandon_step();
  impl_->group = std::move(group);
}

std::vector<at::Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& u : impl_->units) {
    if (u.shard.defined()) out.push_back(u.shard);
  }
  return out;
}

}  // namespace tandem::ddp
