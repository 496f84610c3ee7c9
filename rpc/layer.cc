#include "tandem/rpc/layer.h"

#include "tandem/rpc/agent/agent_impl.h"
#include "tandem/rpc/agent/call_table.h"
#include "tandem/rpc/agent/connection_table.h"

namespace tandem::rpc {

const std::vector<std::shared_ptr<AgentExtension>>& LayerAccess::extensions(const Agent& a) {
  return a.impl_->extensions_;
}

const std::shared_ptr<ThreadPool>& LayerAccess::pool(const Agent& a) { return a.impl_->pool_; }

void LayerAccess::notify(Agent& a, const std::string& to, const std::string& fn,
                         std::vector<c10::IValue> args) {
  a.impl_->notify(to, fn, std::move(args));
}

void LayerAccess::schedule_after(Agent& a, std::chrono::microseconds delay,
                                 std::function<void()> fn) {
  if (a.impl_->calls_) a.impl_->calls_->schedule_after(delay, std::move(fn));
}

std::shared_ptr<const Handler> LayerAccess::find_handler(const Agent& a, const std::string& fn) {
  return a.impl_->find_handler(fn);
}

void LayerAccess::spin_until_done(const Agent& a, const RawFuture& f) {
  a.impl_->spin_until_done(f);
}

bool LayerAccess::on_loop_thread(const Agent& a) {
  const auto& t = a.impl_->transport_;
  return t && (t->on_transport_thread() || AgentImpl::delivering_here());
}

size_t LayerAccess::pending_calls(const Agent& a) {
  return a.impl_->calls_ ? a.impl_->calls_->size() : 0;
}

size_t LayerAccess::live_connections(const Agent& a) {
  return a.impl_->transport_ ? a.impl_->transport_->live_connections() : 0;
}

uint64_t LayerAccess::crossed_connections(const Agent& a) {
  return a.impl_->conns_ ? a.impl_->conns_->crossings() : 0;
}

void LayerAccess::drop_connection(Agent& a, int rank) {
  auto& conns = a.impl_->conns_;
  if (auto c = conns ? conns->to(rank) : nullptr) c->close("dropped by test");
}

}  // namespace tandem::rpc
