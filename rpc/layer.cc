#include "tandem/rpc/layer.h"

#include "tandem/rpc/call_table.h"
#include "tandem/rpc/connection_table.h"

namespace tandem::rpc {

void LayerAccess::schedule_after(Agent& a, std::chrono::microseconds delay,
                                 std::function<void()> fn) {
  if (a.calls_) a.calls_->schedule_after(delay, std::move(fn));
}

size_t LayerAccess::pending_calls(const Agent& a) { return a.calls_ ? a.calls_->size() : 0; }

size_t LayerAccess::live_connections(const Agent& a) {
  return a.transport_ ? a.transport_->live_connections() : 0;
}

uint64_t LayerAccess::crossed_connections(const Agent& a) {
  return a.conns_ ? a.conns_->crossings() : 0;
}

void LayerAccess::drop_connection(Agent& a, int rank) {
  if (auto c = a.conns_ ? a.conns_->to(rank) : nullptr) c->close("dropped by test");
}

}  // namespace tandem::rpc
