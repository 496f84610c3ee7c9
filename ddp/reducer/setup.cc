// The Reducer's construction (ddp/reducer/impl.h): its options checked, the
// devices, the ranks' models compared, rank 0's state taken, the first
// buckets and the gradient hooks; and its destruction.
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <unordered_set>

#include "tandem/ddp/reducer/impl.h"
#include "tandem/rpc/api.h"

namespace tandem::ddp::detail {

void broadcast_coalesced(const std::vector<at::Tensor>& tensors, ProcessGroup& group,
                         std::chrono::milliseconds timeout, int src) {
  std::vector<at::ScalarType> dtypes;
  for (const auto& t : tensors) {
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) {
      dtypes.push_back(t.scalar_type());
    }
  }
  for (auto dtype : dtypes) {
    std::vector<at::Tensor> same;
    for (const auto& t : tensors) {
      if (t.scalar_type() == dtype) same.push_back(t.detach().reshape({-1}));
    }
    at::Tensor flat = at::cat(same);
    group.broadcast(flat, src, timeout);
    int64_t offset = 0;
    for (const auto& t : tensors) {
      if (t.scalar_type() != dtype) continue;
      int64_t n = t.numel();
      t.detach().copy_(flat.narrow(0, offset, n).view(t.sizes()));
      offset += n;
    }
  }
}

Reducer::Impl::Impl(std::shared_ptr<torch::nn::Module> m, DDPOptions o, ProcessGroup& g)
    : module(std::move(m)), opt(std::move(o)), group(&g) {
  if (!opt.comm_hook) opt.comm_hook = allreduce_hook();
  // rpc/trace.h: the agent's timeline when this process has a tracing
  // agent (a hybrid job), else $TANDEM_TRACE's.
  try {
    if (rpc::is_initialized()) tracer = rpc::current_agent()->tracer();
  } catch (const std::logic_error&) {
    // the agent shut down meanwhile
  }
  if (!tracer) tracer = rpc::Tracer::from_env(group->rank());
}

std::vector<at::Tensor> Reducer::Impl::state() const {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.tensor);
  out.insert(out.end(), buffers.begin(), buffers.end());
  return out;
}

Reducer::Reducer(std::shared_ptr<torch::nn::Module> module, DDPOptions options,
                 std::shared_ptr<ProcessGroup> group)
    : group_(std::move(group)) {
  if (!module) throw std::invalid_argument("DistributedDataParallel: the module is null");
  if (!(options.bucket_cap_mb > 0) || !(options.first_bucket_mb > 0)) {
    throw std::invalid_argument(
        "DistributedDataParallel: bucket_cap_mb and first_bucket_mb must be > 0");
  }
  if (options.gradient_owner && options.comm_hook) {
    throw std::invalid_argument(
        "DistributedDataParallel: sharded gradients (gradient_owner) take no comm_hook");
  }
  impl_ = std::make_unique<Impl>(std::move(module), options, *group_);
  Impl& m = *impl_;
  // One process drives one device, as PyTorch's single-device modules: the
  // model lives on device_ids[0] when it is given, and on one GPU for nccl.
  std::optional<c10::Device> model_device;
  if (options.device_ids.size() > 1) {
    throw std::invalid_argument("DistributedDataParallel: device_ids names " +
                                std::to_string(options.device_ids.size()) +
                                " devices; each process drives one (device_ids = {local_rank})");
  }
  if (!options.device_ids.empty()) {
    const int id = options.device_ids[0];
    if (id < 0 || id > std::numeric_limits<c10::DeviceIndex>::max()) {
      throw std::invalid_argument("DistributedDataParallel: device_ids = {" + std::to_string(id) +
                                  "} is not a CUDA device index");
    }
    model_device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(id));
    input_device_ = model_device;
  }
  const bool nccl = group_->backend() == "nccl";
  // `what`: "parameter 'fc1.weight'" or "buffer 'bn.running_mean'".
  auto check_device = [&](const std::string& what, const at::Tensor& t) {
    const std::string where = "DistributedDataParallel: " + what + " is on " + t.device().str();
    if (!options.device_ids.empty() && t.device() != *model_device) {
      throw std::invalid_argument(where + ", but device_ids names " + model_device->str() +
                                  " (move the model there first: model->to(device))");
    }
    if (!nccl && !t.device().is_cpu()) {
      throw std::invalid_argument(where +
                                  "; a gloo group takes CPU tensors (nccl takes CUDA ones)");
    }
    if (nccl && !t.device().is_cuda()) {
      throw std::invalid_argument(where +
                                  "; an nccl group takes CUDA tensors (gloo takes CPU ones)");
    }
    if (nccl && !model_device) model_device = t.device();
    if (nccl && t.device() != *model_device) {
      throw std::invalid_argument(where + " and another on " + model_device->str() +
                                  "; with nccl the whole model lives on this process's one GPU");
    }
  };
  std::unordered_set<c10::TensorImpl*> seen;
  for (const auto& item : m.module->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (!t.requires_grad() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    check_device("parameter '" + item.key() + "'", t);
    Impl::Param p;
    p.name = item.key();
    p.tensor = t;
    m.params.push_back(std::move(p));
  }
  if (m.params.empty()) {
    throw std::invalid_argument(
        "DistributedDataParallel: the module has no parameter that requires grad");
  }
  if (nccl) m.comm_device = *model_device;
  m.sharded = static_cast<bool>(options.gradient_owner);
  // A parameter without an owner is refused on every rank (below, after
  // the ranks have compared their models).
  std::string refused;
  for (auto& p : m.params) {
    if (!m.sharded) break;
    p.owner = options.gradient_owner(p.tensor);
    if (refused.empty() && (p.owner < 0 || p.owner >= group_->size())) {
      refused = "DistributedDataParallel: gradient_owner gives parameter '" + p.name +
                "' to rank " + std::to_string(p.owner) + ", not one of the group's " +
                std::to_string(group_->size()) +
                " (is it among the parameters the optimizer steps?)";
    }
  }
  std::vector<std::string> fingerprint;
  for (const auto& p : m.params) {
    fingerprint.push_back("'" + p.name + "' " + c10::str(p.tensor.sizes()) + " " +
                          c10::toString(p.tensor.scalar_type()) +
                          (m.sharded ? " kept by rank " + std::to_string(p.owner) : ""));
  }
  for (const auto& item : m.module->named_buffers(true)) {
    check_device("buffer '" + item.key() + "'", item.value());
    m.buffers.push_back(item.value());
    fingerprint.push_back("buffer '" + item.key() + "' " + c10::str(item.value().sizes()) + " " +
                          c10::toString(item.value().scalar_type()));
  }
  if (!refused.empty()) fingerprint = {"an error: " + refused};
  if (options.init_sync) {
    group_->expect_same_lines(fingerprint, "DistributedDataParallel", "models", "parameter",
                              "every rank must build the same model", m.timeout(),
                              m.comm_device);
  }
  if (!refused.empty()) throw std::invalid_argument(refused);
  if (options.init_sync && group_->size() > 1) {
    broadcast_coalesced(m.state(), *group_, m.timeout());
  }

  std::vector<size_t> order;
  for (size_t i = m.params.size(); i-- > 0;) order.push_back(i);
  m.build_buckets(order);
  m.ready.assign(m.params.size(), 0);
  for (size_t i = 0; i < m.params.size(); ++i) {
    auto& p = m.params[i];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<Impl::ReadyHook>(&m, i));
    if (m.sharded) p.accumulator->add_pre_hook(std::make_unique<Impl::SetAsideHook>(m.alive, i));
  }
}

void Reducer::set_group(std::shared_ptr<ProcessGroup> group) {
  const std::string who = "DistributedDataParallel::set_group: ";
  if (!group) throw std::invalid_argument(who + "the group is null");
  if (group->backend() != group_->backend()) {
    throw std::invalid_argument(who + "the new group's backend is " + group->backend() +
                                ", the old one's " + group_->backend());
  }
  Impl& m = *impl_;
  if (m.sharded && (group->size() != group_->size() || group->rank() != group_->rank())) {
    throw std::invalid_argument(
        who + "with sharded gradients (gradient_owner) the new group must have this process as "
              "rank " +
        std::to_string(group_->rank()) + " of " + std::to_string(group_->size()) + ", not " +
        std::to_string(group->rank()) + " of " + std::to_string(group->size()));
  }
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.join_enabled) throw std::logic_error(who + "called inside a join() scope");
  group_ = std::move(group);
  m.group = group_.get();
  // A failed step's buckets (their collectives on the old group) dropped;
  // every rank of the new group starts from the same buckets, and rebuilds
  // them after its first step, together.
  std::vector<size_t> order;
  for (size_t i = m.params.size(); i-- > 0;) order.push_back(i);
  m.build_buckets(order);
  m.record_order = true;
  m.rebuild_pending = false;
  m.ready_order.clear();
  m.reset_iteration();
}

Reducer::~Reducer() {
  impl_->alive->store(nullptr);
  for (auto& p : impl_->params) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

}  // namespace tandem::ddp::detail
