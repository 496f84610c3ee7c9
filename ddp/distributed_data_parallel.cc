#include "tandem/ddp/distributed_data_parallel.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <utility>
#include <unordered_set>

#include "tandem/autograd/pass.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/trace.h"

namespace tandem::ddp {
namespace {

CommHook compress_hook(at::ScalarType wire) {
  return [wire](ProcessGroup& group, at::Tensor& bucket) {
    if (!at::isFloatingType(bucket.scalar_type())) {
      throw std::invalid_argument(std::string("DistributedDataParallel: a compression hook takes ") +
                                  "floating-point buckets, not " + c10::toString(bucket.scalar_type()));
    }
    at::Tensor packed = bucket.div(group.size()).to(wire);
    BucketWork w;
    w.pending = group.all_reduce_async(packed, ReduceOp::kSum);
    w.finish = [bucket, packed]() mutable { bucket.copy_(packed); };
    return w;
  };
}

}  // namespace

CommHook allreduce_hook() {
  return [](ProcessGroup& group, at::Tensor& bucket) {
    bucket.div_(group.size());
    return BucketWork{group.all_reduce_async(bucket, ReduceOp::kSum), nullptr};
  };
}
CommHook fp16_compress_hook() { return compress_hook(at::kHalf); }
CommHook bf16_compress_hook() {
  CommHook inner = compress_hook(at::kBFloat16);
  return [inner](ProcessGroup& group, at::Tensor& bucket) {
#if TORCH_VERSION_MAJOR < 2
    if (group.backend() == "gloo") {
      throw std::invalid_argument(
          "bf16_compress_hook: Gloo in LibTorch 1.x cannot sum bfloat16 (LibTorch 2.x's can, "
          "and so can nccl); use fp16_compress_hook");
    }
#endif
    return inner(group, bucket);
  };
}

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::string shape_text(at::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

// Rank 0's values of `tensors` on every rank, one broadcast per dtype.
void broadcast_coalesced(const std::vector<at::Tensor>& tensors, ProcessGroup& group,
                         std::chrono::milliseconds timeout, int src = 0) {
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

// Every rank's string, in rank order.
// `device`: where the group's collectives take their tensors (CPU for gloo,
// the model's GPU for nccl).
std::vector<std::string> all_gather_strings(const std::string& mine, ProcessGroup& group,
                                            std::chrono::milliseconds timeout,
                                            c10::Device device) {
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong).to(device);
  auto lens = group.all_gather(len, timeout);
  int64_t longest = 1;
  for (const auto& l : lens) longest = std::max(longest, l.item<int64_t>());
  at::Tensor bytes = at::zeros({longest}, at::kByte);
  std::copy(mine.begin(), mine.end(), bytes.data_ptr<uint8_t>());
  auto all = group.all_gather(bytes.to(device), timeout);
  std::vector<std::string> out;
  for (size_t r = 0; r < all.size(); ++r) {
    all[r] = all[r].cpu();
    const auto* p = reinterpret_cast<const char*>(all[r].data_ptr<uint8_t>());
    out.emplace_back(p, static_cast<size_t>(lens[r].item<int64_t>()));
  }
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream s(text);
  for (std::string line; std::getline(s, line);) out.push_back(line);
  return out;
}

}  // namespace

struct Reducer::Impl {
  struct Param {
    std::string name;
    at::Tensor tensor;
    std::shared_ptr<torch::autograd::Node> accumulator;  // kept alive: it carries the hook
    uintptr_t hook_key = 0;
    size_t bucket = 0;
    int64_t offset = 0;  // elements into the bucket
    at::Tensor slot;     // the .grad it gets: an alias of its part of the bucket
  };
  struct Bucket {
    at::Tensor buffer;
    std::vector<size_t> params;
    size_t pending = 0;
    BucketWork work;
    std::function<void()> trace;  // with tracing on, when on_completion could not take it
  };

  // Runs after a parameter's AccumulateGrad: its .grad is complete.
  struct ReadyHook final : torch::autograd::FunctionPostHook {
    ReadyHook(Impl* impl, size_t index) : impl(impl), index(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      impl->mark_ready(index);
      return outputs;
    }
    Impl* impl;
    size_t index;
  };

  Impl(std::shared_ptr<torch::nn::Module> m, DDPOptions o, ProcessGroup& g)
      : module(std::move(m)), opt(std::move(o)), group(g) {
    if (!opt.comm_hook) opt.comm_hook = allreduce_hook();
    // rpc/trace.h: the agent's timeline when this process has a tracing
    // agent (a hybrid job), else $TANDEM_TRACE's.
    try {
      if (rpc::is_initialized()) tracer = rpc::current_agent()->tracer();
    } catch (const std::logic_error&) {
      // the agent shut down meanwhile
    }
    if (!tracer) tracer = rpc::Tracer::from_env(group.rank());
  }

  std::shared_ptr<torch::nn::Module> module;
  DDPOptions opt;
  // Where the group's collectives take their tensors: the CPU for gloo, the
  // parameters' GPU for nccl (set by the constructor's checks).
  c10::Device comm_device{c10::kCPU};
  ProcessGroup& group;
  std::vector<Param> params;
  std::vector<at::Tensor> buffers;
  std::vector<Bucket> buckets;
  std::shared_ptr<rpc::Tracer> tracer;  // null unless tracing
  uint64_t launches = 0;                // bucket allreduces started, for span ids

  mutable std::mutex mu;
  bool sync = true;       // the user's setting (no_sync turns it off)
  bool iter_sync = true;  // taken at forward: whether this backward averages
  bool in_backward = false;
  // This backward runs in the distributed engine (a context): gradients
  // come from and go back to the context, never .grad.
  bool hybrid = false;
  std::vector<char> ready;
  size_t next_bucket = 0;
  bool record_order = true;  // until the buckets are rebuilt once
  bool rebuild_pending = false;
  bool rebuilt = false;
  std::vector<size_t> ready_order;
  // join(): whether a scope is open, the rounds counted so far (one per
  // forward of any rank still training), this rank's last real round.
  bool join_enabled = false;
  int64_t join_round = 0, last_real_round = -1;
  Clock::time_point first_hook, last_launch;
  double backward_ms = 0, tail_wait_ms = 0, allreduce_ms = 0;

  std::chrono::milliseconds timeout() const {
    return opt.timeout.count() < 0 ? group.timeout() : opt.timeout;
  }

  // Parameters in `order` into buckets of one dtype each, filled as
  // PyTorch fills them: a bucket takes parameters until it holds at least
  // its cap (first_bucket_mb for the first, bucket_cap_mb after), so the
  // parameter that crosses the cap is still in it. Each parameter's slot
  // aliases its part, and a gradient it already has is copied there.
  void build_buckets(const std::vector<size_t>& order) {
    std::vector<Bucket> fresh;
    std::vector<int64_t> sizes;  // elements per bucket
    auto cap_bytes = [&](size_t k) {
      double mb = k == 0 ? opt.first_bucket_mb : opt.bucket_cap_mb;
      return static_cast<int64_t>(mb * 1024 * 1024);
    };
    int64_t bytes = 0;
    bool full = false;
    for (size_t i : order) {
      Param& p = params[i];
      if (fresh.empty() || full ||
          p.tensor.scalar_type() != params[fresh.back().params.front()].tensor.scalar_type()) {
        fresh.emplace_back();
        sizes.push_back(0);
        bytes = 0;
      }
      p.bucket = fresh.size() - 1;
      p.offset = sizes.back();
      sizes.back() += p.tensor.numel();
      bytes += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
      full = bytes >= cap_bytes(fresh.size() - 1);
      fresh.back().params.push_back(i);
    }
    c10::AutoGradMode no_grad(false);
    for (size_t b = 0; b < fresh.size(); ++b) {
      const at::Tensor& like = params[fresh[b].params.front()].tensor;
      fresh[b].buffer = at::zeros({sizes[b]}, like.options());
      fresh[b].pending = fresh[b].params.size();
    }
    for (auto& p : params) {
      const at::Tensor& buffer = fresh[p.bucket].buffer;
      at::Tensor slot = at::empty({0}, buffer.options());
      slot.set_(buffer.storage(), buffer.storage_offset() + p.offset, p.tensor.sizes(),
                c10::contiguous_strides(p.tensor.sizes()));
      at::Tensor grad = p.tensor.grad();
      if (grad.defined()) {
        slot.copy_(grad);
        p.tensor.mutable_grad() = slot;
      }
      p.slot = slot;
    }
    buckets = std::move(fresh);
  }

  bool holds_slot(const Param& p) const {
    const at::Tensor& g = p.tensor.grad();
    return g.defined() && g.data_ptr() == p.slot.data_ptr() && g.is_contiguous() &&
           g.sizes() == p.slot.sizes();
  }

  // This rank's gradient of `p`: .grad, or in a distributed backward the
  // context's (undefined when there is none).
  at::Tensor local_grad(const Param& p) const {
    return hybrid ? autograd::pass::gradient(p.tensor) : p.tensor.grad();
  }

  // The parameter's gradient in its slot (zeros when it has none), and .grad
  // pointing there; a context's gradient is only copied in.
  void gather_grad(Param& p) {
    if (!hybrid && holds_slot(p)) return;
    c10::AutoGradMode no_grad(false);
    at::Tensor g = local_grad(p);
    if (g.defined()) {
      p.slot.copy_(g);
    } else {
      p.slot.zero_();
    }
    if (!hybrid) p.tensor.mutable_grad() = p.slot;
  }

  // The parameters then the buffers: what rank 0 (or the last trainer) hands out.
  std::vector<at::Tensor> state() const {
    std::vector<at::Tensor> out;
    for (const auto& p : params) out.push_back(p.tensor);
    out.insert(out.end(), buffers.begin(), buffers.end());
    return out;
  }

  // find_unused_parameters: 1 for each parameter this rank has a gradient of
  // in this step (a joined rank: all 0), to be summed over the group after
  // the buckets, in the same order on every rank.
  at::Tensor used_map(bool joined) const {
    at::Tensor used = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
    if (!joined) {
      int* u = used.data_ptr<int>();
      for (size_t i = 0; i < params.size(); ++i) u[i] = ready[i] ? 1 : 0;
    }
    return used.to(comm_device);
  }

  // After the first synced step: the buckets are rebuilt at the next forward.
  void first_sync_done() {
    if (!record_order) return;
    record_order = false;
    rebuild_pending = true;
  }

  void launch_ready() {
    while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
      Bucket& b = buckets[next_bucket++];
      c10::AutoGradMode no_grad(false);
      const auto launched = Clock::now();
      b.work = opt.comm_hook(group, b.buffer);
      if (!b.work.pending.valid()) {
        throw std::logic_error("DistributedDataParallel: the communication hook started nothing");
      }
      if (tracer) {
        // From launch to the collective's end (or, where the backend cannot
        // say, to when wait_launched saw it).
        const uint64_t id = (static_cast<uint64_t>(group.rank()) << 48) | ++launches;
        auto emit = [tracer = tracer, launched, id, index = next_bucket - 1,
                     bytes = b.buffer.nbytes(), params = b.params.size()] {
          tracer->span("allreduce", "ddp.bucket", id, launched, Clock::now(),
                       "{\"bucket\":" + std::to_string(index) + ",\"bytes\":" +
                           std::to_string(bytes) + ",\"params\":" + std::to_string(params) + "}");
        };
        if (!b.work.pending.on_completion(emit)) b.trace = emit;
      }
      last_launch = Clock::now();
    }
  }

  void mark_ready(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    if (!in_backward) {
      in_backward = true;
      first_hook = Clock::now();
      hybrid = autograd::pass::active();
      // At the end of this backward (the engine runs it after every node),
      // or of this worker's part of a distributed one.
      if (hybrid) {
        autograd::pass::on_part_done([this] { finalize(); });
      } else {
        torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
      }
    }
    if (ready[i]) return;
    ready[i] = 1;
    Param& p = params[i];
    gather_grad(p);
    if (!iter_sync) return;
    if (record_order) ready_order.push_back(i);  // the first synced backward's order
    if (--buckets[p.bucket].pending == 0) {
      try {
        launch_ready();
      } catch (...) {
        abandon_iteration();  // the engine will not run finalize() after this error
        throw;
      }
    }
  }

  // Ends an iteration that cannot complete: what was launched is waited for
  // (the group stays in step as far as this rank goes), errors dropped.
  void abandon_iteration() {
    try {
      wait_launched();
    } catch (...) {
    }
    reset_iteration();
  }

  void reset_iteration() {
    in_backward = false;
    std::fill(ready.begin(), ready.end(), 0);
    next_bucket = 0;
    for (auto& b : buckets) b.pending = b.params.size();
  }

  // Waits for every launched bucket, whatever happens; the first failure is rethrown.
  void wait_launched() {
    std::exception_ptr first;
    for (size_t b = 0; b < next_bucket; ++b) {
      BucketWork& w = buckets[b].work;
      if (!w.pending.valid()) continue;
      try {
        w.pending.wait(timeout());
        if (buckets[b].trace) std::exchange(buckets[b].trace, nullptr)();
        if (w.finish && !first) {
          c10::AutoGradMode no_grad(false);
          w.finish();
        }
      } catch (...) {
        if (!first) first = std::current_exception();
      }
      w.finish = nullptr;
    }
    if (first) std::rethrow_exception(first);
  }

  void finalize() {
    std::lock_guard<std::mutex> lock(mu);
    if (!iter_sync) {
      reset_iteration();
      return;
    }
    std::vector<size_t> missing;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!ready[i]) missing.push_back(i);
    }
    std::vector<size_t> had_no_grad;  // missing and without any gradient here
    if (!missing.empty() && !opt.find_unused_parameters) {
      abandon_iteration();
      std::string names = "'" + params[missing[0]].name + "'";
      for (size_t k = 1; k < std::min<size_t>(missing.size(), 5); ++k) {
        names += ", '" + params[missing[k]].name + "'";
      }
      if (missing.size() > 5) names += " and " + std::to_string(missing.size() - 5) + " more";
      throw std::runtime_error(
          "DistributedDataParallel: parameter" + std::string(missing.size() > 1 ? "s " : " ") +
          names + " got no gradient in this backward; if the model leaves parameters unused "
          "in some steps, construct it with DDPOptions::find_unused_parameters = true");
    }
    at::Tensor used;
    ProcessGroup::Pending used_work;
    // With find_unused_parameters the used map is summed every synced step
    // (a joined rank mirrors it without knowing whether anything was missing).
    if (opt.find_unused_parameters) {
      used = used_map(/*joined=*/false);
      for (size_t i : missing) {
        if (!local_grad(params[i]).defined()) had_no_grad.push_back(i);
        gather_grad(params[i]);  // this rank's accumulated gradient, or zeros
        ready[i] = 1;
        buckets[params[i].bucket].pending -= 1;
      }
      launch_ready();
      used_work = group.all_reduce_async(used, ReduceOp::kSum, timeout());
    }
    auto t0 = Clock::now();
    try {
      wait_launched();
      if (used_work.valid()) {
        used_work.wait();
        used = used.cpu();
      }
    } catch (...) {
      reset_iteration();
      throw;
    }
    auto t1 = Clock::now();
    // A parameter no rank used keeps no gradient, as it had none.
    std::vector<char> unused_everywhere(params.size(), 0);
    for (size_t i : had_no_grad) {
      if (used.data_ptr<int>()[i] == 0) {
        unused_everywhere[i] = 1;
        if (!hybrid) params[i].tensor.mutable_grad() = at::Tensor();
      }
    }
    // In a context, the averages become the context's gradients (views of
    // the buckets until the next backward, as .grad is).
    if (hybrid) {
      for (size_t i = 0; i < params.size(); ++i) {
        if (!unused_everywhere[i]) autograd::pass::set_gradient(params[i].tensor, params[i].slot);
      }
    }
    backward_ms = ms_between(first_hook, last_launch);
    tail_wait_ms = ms_between(t0, t1);
    allreduce_ms = ms_between(first_hook, t1);
    first_sync_done();
    reset_iteration();
  }

  // The start of each forward (and of each round a joined rank shadows).
  void begin_iteration() {
    if (rebuild_pending) {
      rebuild_pending = false;
      build_buckets(agreed_order());
      rebuilt = true;
    }
    if (opt.broadcast_buffers && !buffers.empty() && group.size() > 1) {
      broadcast_coalesced(buffers, group, timeout());
    }
  }

  // One join round: this rank's {training?, averaging?} summed over the
  // group; returns the sums.
  std::pair<int, int> join_round_sums(bool training, bool averaging) {
    at::Tensor t = at::zeros({2}, at::kInt);
    t[0] = training ? 1 : 0;
    t[1] = averaging ? 1 : 0;
    t = t.to(comm_device);
    group.all_reduce(t, ReduceOp::kSum, timeout());
    t = t.cpu();
    ++join_round;
    return {t[0].item<int>(), t[1].item<int>()};
  }

  // A rank out of inputs takes part in the others' steps with zero
  // gradients until every rank is out, then all take the parameters and
  // buffers of the rank that trained last (its optimizer stepped most).
  void finish_join() {
    for (;;) {
      auto [training, averaging] = join_round_sums(false, false);
      if (training == 0) break;
      begin_iteration();
      if (averaging == 0) continue;
      for (auto& b : buckets) {
        b.buffer.zero_();
        b.work = opt.comm_hook(group, b.buffer);
      }
      next_bucket = buckets.size();
      ProcessGroup::Pending used_work;
      at::Tensor used;
      if (opt.find_unused_parameters) {
        used = used_map(/*joined=*/true);
        used_work = group.all_reduce_async(used, ReduceOp::kSum, timeout());
      }
      wait_launched();
      if (used_work.valid()) used_work.wait();
      reset_iteration();
      first_sync_done();
    }
    at::Tensor last =
        at::full({1}, last_real_round * group.size() + group.rank(), at::kLong).to(comm_device);
    group.all_reduce(last, ReduceOp::kMax, timeout());
    const int src = static_cast<int>(last.item<int64_t>() % group.size());
    broadcast_coalesced(state(), group, timeout(), src);
  }

  // Rank 0's order of readiness (parameters it never saw come last, in
  // reverse order), on every rank.
  std::vector<size_t> agreed_order() {
    std::vector<size_t> order = ready_order;
    std::vector<char> seen(params.size(), 0);
    for (size_t i : order) seen[i] = 1;
    for (size_t i = params.size(); i-- > 0;) {
      if (!seen[i]) order.push_back(i);
    }
    at::Tensor t = at::empty({static_cast<int64_t>(order.size())}, at::kLong);
    int64_t* o = t.data_ptr<int64_t>();
    for (size_t k = 0; k < order.size(); ++k) o[k] = static_cast<int64_t>(order[k]);
    t = t.to(comm_device);
    group.broadcast(t, 0, timeout());
    t = t.cpu();
    o = t.data_ptr<int64_t>();
    for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<size_t>(o[k]);
    return order;
  }
};

Reducer::Reducer(std::shared_ptr<torch::nn::Module> module, DDPOptions options,
                 std::shared_ptr<ProcessGroup> group)
    : group_(std::move(group)) {
  if (!module) throw std::invalid_argument("DistributedDataParallel: the module is null");
  if (!(options.bucket_cap_mb > 0) || !(options.first_bucket_mb > 0)) {
    throw std::invalid_argument("DistributedDataParallel: bucket_cap_mb and first_bucket_mb must be > 0");
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
      throw std::invalid_argument(where + "; a gloo group takes CPU tensors (nccl takes CUDA ones)");
    }
    if (nccl && !t.device().is_cuda()) {
      throw std::invalid_argument(where + "; an nccl group takes CUDA tensors (gloo takes CPU ones)");
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
    throw std::invalid_argument("DistributedDataParallel: the module has no parameter that requires grad");
  }
  if (nccl) m.comm_device = *model_device;
  std::string fingerprint;
  for (const auto& p : m.params) {
    fingerprint += "'" + p.name + "' " + shape_text(p.tensor.sizes()) + " " +
                   c10::toString(p.tensor.scalar_type()) + "\n";
  }
  for (const auto& item : m.module->named_buffers(true)) {
    check_device("buffer '" + item.key() + "'", item.value());
    m.buffers.push_back(item.value());
    fingerprint += "buffer '" + item.key() + "' " + shape_text(item.value().sizes()) + " " +
                   c10::toString(item.value().scalar_type()) + "\n";
  }
  auto all = all_gather_strings(fingerprint, *group_, m.timeout(), m.comm_device);
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    auto a = lines_of(all[0]), b = lines_of(all[r]);
    size_t k = 0;
    while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
    auto has = [&](const std::vector<std::string>& lines, size_t rank) {
      return "rank " + std::to_string(rank) + " has " +
             (k < lines.size() ? lines[k] : "no entry #" + std::to_string(k) + " (" +
                                                std::to_string(lines.size()) + " in all)");
    };
    throw std::invalid_argument(
        "DistributedDataParallel: the ranks' models differ at parameter #" + std::to_string(k) +
        ": " + has(a, 0) + ", " + has(b, r) + " (every rank must build the same model)");
  }
  if (group_->size() > 1) broadcast_coalesced(m.state(), *group_, m.timeout());

  std::vector<size_t> order;
  for (size_t i = m.params.size(); i-- > 0;) order.push_back(i);
  m.build_buckets(order);
  m.ready.assign(m.params.size(), 0);
  for (size_t i = 0; i < m.params.size(); ++i) {
    auto& p = m.params[i];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    p.hook_key = p.accumulator->add_post_hook(std::make_unique<Impl::ReadyHook>(&m, i));
  }
}

Reducer::~Reducer() {
  for (auto& p : impl_->params) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

void Reducer::prepare_forward() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  // The last backward failed before its end (an error in the graph): what it
  // started is finished here, so that this one starts clean.
  if (m.in_backward) m.abandon_iteration();
  m.iter_sync = m.sync;
  if (m.join_enabled) {
    m.last_real_round = m.join_round;
    m.join_round_sums(true, m.iter_sync);
  }
  m.begin_iteration();
}

void Reducer::begin_join() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->join_enabled) throw std::logic_error("DistributedDataParallel: join() scopes do not nest");
  impl_->join_enabled = true;
  impl_->join_round = 0;
  impl_->last_real_round = -1;
}

void Reducer::end_join() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->join_enabled) return;
  impl_->join_enabled = false;
  if (impl_->in_backward) impl_->abandon_iteration();
  impl_->finish_join();
}

void Reducer::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->sync = sync;
}

bool Reducer::sync() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->sync;
}

Reducer::Stats Reducer::stats() const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  Stats s;
  s.buckets = m.buckets.size();
  for (const auto& b : m.buckets) {
    s.bucket_bytes.push_back(static_cast<size_t>(b.buffer.numel() * b.buffer.element_size()));
    s.bucket_params.push_back(b.params);
  }
  s.rebuilt = m.rebuilt;
  s.backward_ms = m.backward_ms;
  s.tail_wait_ms = m.tail_wait_ms;
  s.allreduce_ms = m.allreduce_ms;
  return s;
}

}  // namespace detail
}  // namespace tandem::ddp
