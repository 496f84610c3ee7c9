// FullyShardedDataParallel's step (ddp/fsdp/impl.h): each unit gathered
// before its forward and freed after it, gathered again before its backward
// (the one before it prefetched), its gradients reduce-scattered into the
// shard once they have all landed, in reverse forward order on every rank;
// the end of backward.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>

#include "tandem/ddp/fsdp/impl.h"

namespace tandem::ddp {

void FullyShardedDataParallel::Impl::start_gather(size_t k) {
  Unit& u = units[k];
  if (u.state != Unit::State::kFree || u.params.empty()) return;
  c10::AutoGradMode no_grad(false);
  c10::StorageImpl* storage = u.full.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(u.padded) * u.full.element_size();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
  u.gather_input = u.shard.detach().to(u.full.scalar_type());
  if (size() == 1) {
    u.full.copy_(u.gather_input);
    u.state = Unit::State::kGathering;
    return;
  }
  // Gloo moves bfloat16's 2-byte words as float16's (it only copies them).
  const bool as_half = u.full.scalar_type() == at::kBFloat16 && pg().backend() == "gloo";
  std::vector<at::Tensor> outs;
  for (int r = 0; r < size(); ++r) {
    at::Tensor out = u.full.narrow(0, r * u.shard_numel, u.shard_numel);
    outs.push_back(as_half ? out.view(at::kHalf) : out);
  }
  u.gathering = pg().all_gather_async(as_half ? u.gather_input.view(at::kHalf) : u.gather_input,
                                        outs, timeout());
  u.state = Unit::State::kGathering;
  ++gathers;
}

void FullyShardedDataParallel::Impl::finish_gather(size_t k) {
  Unit& u = units[k];
  if (u.params.empty() || u.state == Unit::State::kGathered) return;
  if (u.state == Unit::State::kFree) start_gather(k);
  if (u.gathering.valid()) u.gathering.wait();
  u.gather_input = at::Tensor();
  c10::AutoGradMode no_grad(false);
  for (size_t i : u.params) {
    Param& p = params[i];
    p.tensor.set_data(u.full.narrow(0, p.offset, p.numel).view(p.shape));
  }
  u.state = Unit::State::kGathered;
}

void FullyShardedDataParallel::Impl::free_unit(size_t k) {
  Unit& u = units[k];
  if (u.params.empty() || u.state == Unit::State::kFree) return;
  if (u.state == Unit::State::kGathering && u.gathering.valid()) u.gathering.wait();
  c10::AutoGradMode no_grad(false);
  const at::Tensor empty = at::empty({0}, u.full.options());
  for (size_t i : u.params) params[i].tensor.set_data(empty);
  c10::StorageImpl* storage = u.full.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, u.full.device()));
  storage->set_nbytes(0);
  u.gather_input = at::Tensor();
  u.state = Unit::State::kFree;
}

void FullyShardedDataParallel::Impl::abandon_step() {
  std::lock_guard<std::mutex> lock(mu);
  for (size_t k = 0; k < units.size(); ++k) {
    Unit& u = units[k];
    try {
      if (u.gathering.valid()) u.gathering.wait();
    } catch (...) {
    }
    try {
      if (u.reducing.valid()) u.reducing.wait();
    } catch (...) {
    }
    u.gathering = {};
    u.reducing = {};
    u.reduce_output = at::Tensor();
    if (u.state == Unit::State::kGathering) u.state = Unit::State::kGathered;
    free_unit(k);
    u.ran = false;
    u.reduced = false;
  }
  for (auto& p : params) {
    if (p.tensor.grad().defined()) p.tensor.mutable_grad() = at::Tensor();
  }
  in_forward = false;
  in_backward = false;
}

void FullyShardedDataParallel::Impl::begin_forward() {
  pg();  // (a model made without a group needs one first)
  bool leftover;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (in_forward) {
      throw std::logic_error("FullyShardedDataParallel: forward() inside forward()");
    }
    leftover = in_backward;
  }
  // A backward that failed before its end (or one never run: a forward
  // without backward) left units gathered: start clean.
  abandon_step();
  std::lock_guard<std::mutex> lock(mu);
  if (!leftover && !order.empty()) last_order = order;
  order.clear();
  next_reduce = 0;
  gathers = 0;
  reduce_scatters = 0;
  for (auto& u : units) {
    u.ran = false;
    u.reduced = false;
    u.grads_pending = u.params.size();
  }
  in_forward = true;
  // The root stays gathered until the end of backward.
  units[0].ran = true;
  order.push_back(0);
  try {
    finish_gather(0);
  } catch (...) {
    // (a failed gather: the next forward starts clean)
    in_forward = false;
    throw;
  }
}

void FullyShardedDataParallel::Impl::end_forward() {
  std::lock_guard<std::mutex> lock(mu);
  in_forward = false;
}

at::Tensor FullyShardedDataParallel::Impl::run_unit(size_t k,
                                                    const std::function<at::Tensor()>& fn) {
  {
    std::lock_guard<std::mutex> lock(mu);
    Unit& u = units[k];
    if (!in_forward) {
      throw std::logic_error("FullyShardedDataParallel: run('" + u.name +
                             "') outside forward(): call the model's forward through "
                             "forward(fn)");
    }
    if (u.ran) {
      throw std::logic_error("FullyShardedDataParallel: unit '" + u.name +
                             "' ran twice in one forward");
    }
    u.ran = true;
    order.push_back(k);
    finish_gather(k);
    // The unit that ran after this one last time (a Sequential: the next
    // child unit), gathered while this one computes.
    if (opt.prefetch) {
      auto it = std::find(last_order.begin(), last_order.end(), k);
      if (it != last_order.end() && it + 1 != last_order.end()) start_gather(*(it + 1));
    }
  }
  at::Tensor out = fn();
  std::lock_guard<std::mutex> lock(mu);
  const bool backward_follows = out.defined() && out.requires_grad();
  if (opt.reshard_after_forward || !backward_follows) free_unit(k);
  if (backward_follows) {
    out.register_hook([this, k](const at::Tensor& grad) {
      pre_backward(k);
      return grad;
    });
  } else {
    units[k].grads_pending = 0;  // no backward will come for it
  }
  return out;
}

void FullyShardedDataParallel::Impl::pre_backward(size_t k) {
  std::lock_guard<std::mutex> lock(mu);
  if (!in_backward) {
    in_backward = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
  }
  finish_gather(k);
  if (opt.prefetch) {
    // The unit that ran before this one runs its backward next.
    auto it = std::find(order.begin(), order.end(), k);
    if (it != order.begin() && it != order.end()) start_gather(*(it - 1));
  }
}

void FullyShardedDataParallel::Impl::grad_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mu);
  if (!in_backward) {
    in_backward = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_backward(); });
  }
  Unit& u = units[params[i].unit];
  if (u.grads_pending > 0) --u.grads_pending;
  launch_reduces();
}

void FullyShardedDataParallel::Impl::launch_reduces() {
  // Reverse forward order; a unit whose gradients have not all landed
  // holds back the ones after it (they go at the end of backward).
  while (next_reduce < order.size()) {
    const size_t k = order[order.size() - 1 - next_reduce];
    Unit& u = units[k];
    if (u.grads_pending > 0 || !u.ran) return;
    launch_reduce(k);
    ++next_reduce;
  }
}

void FullyShardedDataParallel::Impl::launch_reduce(size_t k) {
  Unit& u = units[k];
  if (u.reduced || u.params.empty()) return;
  u.reduced = true;
  c10::AutoGradMode no_grad(false);
  at::Tensor flat = at::zeros({u.padded}, u.full.options());
  for (size_t i : u.params) {
    Param& p = params[i];
    const at::Tensor& g = p.tensor.grad();
    if (g.defined()) flat.narrow(0, p.offset, p.numel).copy_(g.reshape({-1}));
    p.tensor.mutable_grad() = at::Tensor();
  }
  // Its backward is over: the whole parameters can go.
  free_unit(k);
  u.reduce_output = at::empty({u.shard_numel}, flat.options());
  if (size() == 1) {
    u.reduce_output.copy_(flat);
    return;
  }
  u.reducing = pg().reduce_scatter_async(flat, u.reduce_output, ReduceOp::kAvg, {}, timeout());
  ++reduce_scatters;
}

void FullyShardedDataParallel::Impl::finish_backward() {
  std::lock_guard<std::mutex> lock(mu);
  std::exception_ptr failed;
  try {
    // Units with a parameter that got no gradient, in the same order.
    while (next_reduce < order.size()) {
      launch_reduce(order[order.size() - 1 - next_reduce]);
      ++next_reduce;
    }
  } catch (...) {
    failed = std::current_exception();
  }
  c10::AutoGradMode no_grad(false);
  for (size_t n = 0; n < order.size(); ++n) {
    Unit& u = units[order[order.size() - 1 - n]];
    try {
      if (u.reducing.valid()) u.reducing.wait();
      if (u.reduce_output.defined() && !failed) {
        at::Tensor reduced = u.reduce_output.to(u.shard.scalar_type());
        // HSDP: averaged over the shard's replicas too (in the shard's dtype).
        if (opt.replicate_group && opt.replicate_group->size() > 1) {
          opt.replicate_group->all_reduce(reduced, ReduceOp::kAvg, timeout());
        }
        at::Tensor& g = u.shard.mutable_grad();
        if (g.defined()) {
          g.add_(reduced);
        } else {
          g = reduced;
        }
      }
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
    u.reduce_output = at::Tensor();
  }
  for (size_t k = 0; k < units.size(); ++k) free_unit(k);
  in_backward = false;
  if (failed) std::rethrow_exception(failed);
}

at::Tensor FullyShardedDataParallel::forward(const std::function<at::Tensor()>& fn) {
  impl_->begin_forward();
  try {
    at::Tensor out = fn();
    impl_->end_forward();
    return out;
  } catch (...) {
    impl_->end_forward();
    throw;
  }
}

at::Tensor FullyShardedDataParallel::forward(const at::Tensor& x) {
  if (!impl_->sequential) {
    throw std::logic_error(
        "FullyShardedDataParallel: forward(x) runs a Sequential model; for another model call "
        "forward(fn) with run(unit, fn) around each unit");
  }
  return forward([&] {
    // Mixed precision: a floating-point input in the compute dtype.
    at::Tensor h =
        impl_->opt.param_dtype && x.is_floating_point() ? x.to(*impl_->opt.param_dtype) : x;
    size_t i = 0;
    for (auto& child : *impl_->sequential) {
      const std::string name = std::to_string(i++);
      auto it = impl_->unit_of_name.find(name);
      if (it == impl_->unit_of_name.end()) {
        h = child.forward(h);
      } else {
        h = impl_->run_unit(it->second, [&] { return child.forward(h); });
      }
    }
    return h;
  });
}

at::Tensor FullyShardedDataParallel::run(const std::string& unit,
                                         const std::function<at::Tensor()>& fn) {
  auto it = impl_->unit_of_name.find(unit);
  if (it == impl_->unit_of_name.end()) {
    throw std::invalid_argument("FullyShardedDataParallel: run('" + unit + "'): no such unit");
  }
  return impl_->run_unit(it->second, fn);
}

void FullyShardedDataParallel::zero_grad() {
  for (auto& u : impl_->units) {
    if (u.shard.defined() && u.shard.grad().defined()) u.shard.mutable_grad() = at::Tensor();
  }
}

}  // namespace tandem::ddp
