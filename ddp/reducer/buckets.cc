// The Reducer's backward (ddp/reducer/impl.h): each gradient into its bucket
// as its hook fires (mark_ready), each bucket's reduction launched by its
// last gradient, in bucket order (launch_ready), unused parameters and the
// wait at the end (finalize); the buckets built, and rebuilt after the first
// step in rank 0's order of readiness (agreed_order).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>

#include "tandem/autograd/pass.h"
#include "tandem/ddp/reducer/impl.h"

namespace tandem::ddp::detail {
namespace {

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

void Reducer::Impl::build_buckets(const std::vector<size_t>& order) {
  std::vector<Bucket> fresh;
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
      bytes = 0;
    }
    bytes += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
    full = bytes >= cap_bytes(fresh.size() - 1);
    fresh.back().params.push_back(i);
  }
  for (size_t b = 0; b < fresh.size(); ++b) {
    Bucket& bucket = fresh[b];
    // Sharded: each owner's parameters side by side, so that its piece is
    // one run of the bucket.
    if (sharded) {
      std::stable_sort(bucket.params.begin(), bucket.params.end(),
                       [&](size_t x, size_t y) { return params[x].owner < params[y].owner; });
      bucket.counts.assign(static_cast<size_t>(group->size()), 0);
    }
    for (size_t i : bucket.params) {
      Param& p = params[i];
      p.bucket = b;
      p.offset = bucket.numel;
      bucket.numel += p.tensor.numel();
      if (sharded) {
        p.piece_offset = bucket.counts[static_cast<size_t>(p.owner)];
        bucket.counts[static_cast<size_t>(p.owner)] += p.tensor.numel();
      }
    }
    bucket.element_size = params[bucket.params.front()].tensor.element_size();
    bucket.pending = bucket.params.size();
  }
  buckets = std::move(fresh);
  if (sharded) {
    for (auto& p : params) p.slot = at::Tensor();  // made with the buffer, at a gradient
    return;
  }
  for (size_t b = 0; b < buckets.size(); ++b) ensure_buffer(b);
  c10::AutoGradMode no_grad(false);
  for (auto& p : params) {
    at::Tensor grad = p.tensor.grad();
    if (grad.defined()) {
      p.slot.copy_(grad);
      p.tensor.mutable_grad() = p.slot;
    }
  }
}

void Reducer::Impl::ensure_buffer(size_t b) {
  Bucket& bucket = buckets[b];
  if (bucket.buffer.defined()) return;
  c10::AutoGradMode no_grad(false);
  bucket.buffer = at::zeros({bucket.numel}, params[bucket.params.front()].tensor.options());
  for (size_t i : bucket.params) {
    Param& p = params[i];
    at::Tensor slot = at::empty({0}, bucket.buffer.options());
    slot.set_(bucket.buffer.storage(), bucket.buffer.storage_offset() + p.offset, p.tensor.sizes(),
              c10::contiguous_strides(p.tensor.sizes()));
    p.slot = slot;
  }
}

void Reducer::Impl::keep_owned_grads() {
  c10::AutoGradMode no_grad(false);
  for (auto& p : params) {
    if (p.owner != group->rank()) {
      p.tensor.mutable_grad() = at::Tensor();
      p.reduced = at::Tensor();
      p.carry = at::Tensor();
      p.slot = at::Tensor();
      continue;
    }
    const at::Tensor& piece = buckets[p.bucket].piece;
    at::Tensor g = at::empty({0}, piece.options());
    g.set_(piece.storage(), piece.storage_offset() + p.piece_offset, p.tensor.sizes(),
           c10::contiguous_strides(p.tensor.sizes()));
    p.carried = p.carry.defined();
    if (p.carried) g.add_(p.carry);
    p.carry = at::Tensor();
    p.tensor.mutable_grad() = g;
    p.reduced = g;
    p.slot = at::Tensor();
  }
  for (auto& b : buckets) {
    b.buffer = at::Tensor();
    b.piece = at::Tensor();
  }
}

void Reducer::Impl::set_aside(size_t i) {
  Param& p = params[i];
  const at::Tensor& g = p.tensor.grad();
  if (p.reduced.defined() && g.defined() &&
      g.unsafeGetTensorImpl() == p.reduced.unsafeGetTensorImpl()) {
    p.carry = g;
    p.tensor.mutable_grad() = at::Tensor();
  }
  p.reduced = at::Tensor();
}

bool Reducer::Impl::holds_slot(const Param& p) const {
  const at::Tensor& g = p.tensor.grad();
  return g.defined() && g.data_ptr() == p.slot.data_ptr() && g.is_contiguous() &&
         g.sizes() == p.slot.sizes();
}

at::Tensor Reducer::Impl::local_grad(const Param& p) const {
  return hybrid ? autograd::pass::gradient(p.tensor) : p.tensor.grad();
}

void Reducer::Impl::gather_grad(Param& p) {
  if (sharded) ensure_buffer(p.bucket);
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

at::Tensor Reducer::Impl::used_map(bool joined) const {
  at::Tensor used = at::zeros({static_cast<int64_t>(params.size())}, at::kInt);
  if (!joined) {
    int* u = used.data_ptr<int>();
    for (size_t i = 0; i < params.size(); ++i) u[i] = ready[i] ? 1 : 0;
  }
  return used.to(comm_device);
}

void Reducer::Impl::first_sync_done() {
  if (!record_order) return;
  record_order = false;
  rebuild_pending = true;
}

void Reducer::Impl::launch_ready() {
  while (next_bucket < buckets.size() && buckets[next_bucket].pending == 0) {
    Bucket& b = buckets[next_bucket++];
    c10::AutoGradMode no_grad(false);
    const auto launched = Clock::now();
    if (sharded) {
      b.piece = at::empty({b.counts[static_cast<size_t>(group->rank())]}, b.buffer.options());
      b.work = BucketWork{
          group->reduce_scatter_async(b.buffer, b.piece, ReduceOp::kAvg, b.counts, timeout()),
          nullptr};
    } else {
      b.work = opt.comm_hook(*group, b.buffer);
    }
    if (!b.work.pending.valid()) {
      throw std::logic_error("DistributedDataParallel: the communication hook started nothing");
    }
    if (tracer) {
      // From launch to the collective's end (or, where the backend cannot
      // say, to when wait_launched saw it).
      const uint64_t id = (static_cast<uint64_t>(group->rank()) << 48) | ++launches;
      auto emit = [tracer = tracer, launched, id, index = next_bucket - 1,
                   bytes = b.buffer.nbytes(), params = b.params.size(),
                   name = sharded ? "reduce_scatter" : "allreduce"] {
        tracer->span(name, "ddp.bucket", id, launched, Clock::now(),
                     "{\"bucket\":" + std::to_string(index) + ",\"bytes\":" +
                         std::to_string(bytes) + ",\"params\":" + std::to_string(params) + "}");
      };
      if (!b.work.pending.on_completion(emit)) b.trace = emit;
    }
    last_launch = Clock::now();
  }
}

void Reducer::Impl::mark_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mu);
  if (!in_backward) {
    if (sharded && autograd::pass::active()) {
      throw std::logic_error(
          "DistributedDataParallel: sharded gradients (gradient_owner) are not supported in a "
          "distributed autograd context");
    }
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

void Reducer::Impl::abandon_iteration() {
  try {
    wait_launched();
  } catch (...) {
  }
  reset_iteration();
}

void Reducer::Impl::reset_iteration() {
  in_backward = false;
  std::fill(ready.begin(), ready.end(), 0);
  next_bucket = 0;
  for (auto& b : buckets) b.pending = b.params.size();
}

void Reducer::Impl::wait_launched() {
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

void Reducer::Impl::finalize() {
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
        names +
        " got no gradient in this backward; if the model leaves parameters unused "
        "in some steps, construct it with DDPOptions::find_unused_parameters = true");
  }
  at::Tensor used;
  ProcessGroup::Pending used_work;
  // With find_unused_parameters the used map is summed every synced step
  // (a joined rank mirrors it without knowing whether anything was missing).
  if (opt.find_unused_parameters) {
    used = used_map(/*joined=*/false);
    for (size_t i : missing) {
      // Sharded: an owner's average from the last sync is not this
      // backward's gradient (the others have none to add to it).
      if (sharded) set_aside(i);
      if (!local_grad(params[i]).defined()) had_no_grad.push_back(i);
      gather_grad(params[i]);  // this rank's accumulated gradient, or zeros
      ready[i] = 1;
      buckets[params[i].bucket].pending -= 1;
    }
    launch_ready();
    used_work = group->all_reduce_async(used, ReduceOp::kSum, timeout());
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
  if (sharded) keep_owned_grads();
  // A parameter no rank used keeps no gradient, as it had none.
  std::vector<char> unused_everywhere(params.size(), 0);
  for (size_t i : had_no_grad) {
    if (used.data_ptr<int>()[i] == 0) {
      unused_everywhere[i] = 1;
      // (Sharded: an owner that carried a gradient keeps it, as DDP does.)
      if (!hybrid && !(sharded && params[i].carried))
        params[i].tensor.mutable_grad() = at::Tensor();
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

void Reducer::Impl::begin_iteration() {
  if (rebuild_pending) {
    rebuild_pending = false;
    build_buckets(agreed_order());
    rebuilt = true;
  }
  if (opt.broadcast_buffers && !buffers.empty() && group->size() > 1) {
    broadcast_coalesced(buffers, *group, timeout());
  }
}

std::vector<size_t> Reducer::Impl::agreed_order() {
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
  group->broadcast(t, 0, timeout());
  t = t.cpu();
  o = t.data_ptr<int64_t>();
  for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<size_t>(o[k]);
  return order;
}

}  // namespace tandem::ddp::detail
