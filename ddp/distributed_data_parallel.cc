// The Reducer's own methods (ddp/distributed_data_parallel.h): each locks its
// state and calls into it (ddp/reducer/impl.h says which file does what).
#include "tandem/ddp/distributed_data_parallel.h"

#include <mutex>

#include "tandem/ddp/reducer/impl.h"

namespace tandem::ddp::detail {

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
    s.bucket_bytes.push_back(static_cast<size_t>(b.numel) * b.element_size);
    s.bucket_params.push_back(b.params);
  }
  s.rebuilt = m.rebuilt;
  s.backward_ms = m.backward_ms;
  s.tail_wait_ms = m.tail_wait_ms;
  s.allreduce_ms = m.allreduce_ms;
  return s;
}

}  // namespace tandem::ddp::detail
