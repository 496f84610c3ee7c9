// join() (ddp/reducer/impl.h): while a scope is open every forward counts
// the ranks still training; a rank out of inputs shadows the others' steps
// with zero gradients until all are out, then every rank takes the state of
// the rank that trained last.
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include "tandem/ddp/reducer/impl.h"

namespace tandem::ddp::detail {

std::pair<int, int> Reducer::Impl::join_round_sums(bool training, bool averaging) {
  at::Tensor t = at::zeros({2}, at::kInt);
  t[0] = training ? 1 : 0;
  t[1] = averaging ? 1 : 0;
  t = t.to(comm_device);
  group->all_reduce(t, ReduceOp::kSum, timeout());
  t = t.cpu();
  ++join_round;
  return {t[0].item<int>(), t[1].item<int>()};
}

void Reducer::Impl::finish_join() {
  for (;;) {
    auto [training, averaging] = join_round_sums(false, false);
    if (training == 0) break;
    begin_iteration();
    if (averaging == 0) continue;
    for (auto& b : buckets) {
      b.buffer.zero_();
      b.work = opt.comm_hook(*group, b.buffer);
    }
    next_bucket = buckets.size();
    ProcessGroup::Pending used_work;
    at::Tensor used;
    if (opt.find_unused_parameters) {
      used = used_map(/*joined=*/true);
      used_work = group->all_reduce_async(used, ReduceOp::kSum, timeout());
    }
    wait_launched();
    if (used_work.valid()) used_work.wait();
    reset_iteration();
    first_sync_done();
  }
  at::Tensor last =
      at::full({1}, last_real_round * group->size() + group->rank(), at::kLong).to(comm_device);
  group->all_reduce(last, ReduceOp::kMax, timeout());
  const int src = static_cast<int>(last.item<int64_t>() % group->size());
  broadcast_coalesced(state(), *group, timeout(), src);
}

void Reducer::begin_join() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->join_enabled)
    throw std::logic_error("DistributedDataParallel: join() scopes do not nest");
  if (impl_->sharded) {
    throw std::logic_error(
        "DistributedDataParallel: join() is not supported with sharded "
        "gradients (gradient_owner)");
  }
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

}  // namespace tandem::ddp::detail
