// The owner's side of RRefs: the value records, their forks and local
// handles, and the requests that create, fetch, call, fork and delete.
#include "tandem/rpc/rref_context.h"
#include "tandem/rpc/scope.h"

#include "tandem/rpc/layer.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rref/detail.h"

namespace tandem::rpc {
using namespace rref_detail;

RRefContext::OwnerRecord& RRefContext::record_locked(const RRefId& id) {
  auto it = owners_.find(id);
  if (it == owners_.end()) {
    it = owners_.emplace(id, OwnerRecord{}).first;
    it->second.value = make_raw_future();
  }
  return it->second;
}

std::unique_ptr<RRefContext::OwnerRecord> RRefContext::release_if_unused_locked(const RRefId& id) {
  auto it = owners_.find(id);
  if (it == owners_.end() || !it->second.forks.empty() || it->second.local_handles > 0) {
    return nullptr;
  }
  auto dead = std::make_unique<OwnerRecord>(std::move(it->second));
  owners_.erase(it);
  return dead;
}

RRefPtr RRefContext::make_local(c10::IValue value) {
  RRefDesc d;
  d.owner = self_;
  d.id = new_id();
  d.fork = d.id;
  d.parent = self_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& rec = record_locked(d.id);
    rec.value->markCompleted(std::move(value));
    ++rec.local_handles;
  }
  return new_handle(d, RRefImpl::Kind::kLocal, completed_future());
}

RawFuture RRefContext::apply_when_ready(RawFuture value, const std::string& fn,
                                        std::vector<c10::IValue> args, bool with_value) {
  auto out = make_raw_future();
  // A layer's own "tandem.*" function may run on a value too (a
  // RemoteModule's forward runs on the module its RRef holds).
  auto handler = layer::find_handler(agent_, fn);
  if (!handler) {
    out->setError(
        std::make_exception_ptr(UnknownFunctionError("no function '" + fn + "' is registered")));
    return out;
  }
  std::weak_ptr<Agent> weak_agent = agent_.weak_from_this();
  // The function runs in the scope current here (a request's: its caller,
  // deadline and autograd context; or the user thread's), also when it
  // runs later, on a pool thread, once the value is ready.
  const CallScope scope = current_scope();
  auto run = [weak_agent, handler, out, scope,
              args = std::move(args)](const c10::IValue* self) mutable {
    auto agent = weak_agent.lock();
    if (!agent) {
      out->setError(std::make_exception_ptr(ShutdownError("the agent is gone")));
      return;
    }
    std::vector<c10::IValue> all;
    all.reserve(args.size() + 1);
    if (self) all.push_back(*self);
    for (auto& a : args) all.push_back(std::move(a));
    CallScope here = scope;
    here.agent = agent.get();
    ScopeGuard guard(here);
    try {
      HandlerResult r = (*handler)(all);
      if (r.future) {
        r.future->addCallback([out](c10::ivalue::Future& f) { forward_raw(f, out); });
      } else {
        out->markCompleted(std::move(r.value));
      }
    } catch (...) {
      out->setError(std::current_exception());
    }
  };
  if (!with_value) {
    run(nullptr);
    return out;
  }
  auto pool = layer::pool(agent_);
  value->addCallback([pool, run, out](c10::ivalue::Future& f) mutable {
    RawFuture ready = c10::intrusive_ptr<c10::ivalue::Future>::reclaim_copy(&f);
    pool->post([ready, run, out]() mutable {
      if (ready->hasError()) {
        out->setError(ready->exception_ptr());
        return;
      }
      c10::IValue v = ready->constValue();
      run(&v);
    });
  });
  return out;
}

RawFuture RRefContext::on_create(const RRefId& id, const ForkId& fork, const std::string& fn,
                                 c10::optional<RRefId> self_id,
                                 std::vector<c10::IValue> user_args) {
  RawFuture value;
  RawFuture self_value;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (take_tombstone_locked(fork)) {
      throw std::runtime_error("RRef " + id.str() + " was deleted before its creation arrived");
    }
    auto& rec = record_locked(id);
    first = rec.forks.insert(fork).second;
    value = rec.value;
    if (self_id) self_value = record_locked(*self_id).value;
  }
  if (first && !value->completed()) {  // a retried create runs nothing twice
    RawFuture produced = self_value
                             ? apply_when_ready(self_value, fn, std::move(user_args), true)
                             : apply_when_ready(RawFuture(), fn, std::move(user_args), false);
    produced->addCallback([value](c10::ivalue::Future& f) { forward_raw(f, value); });
  }
  // The creator hears when the value exists (or why it does not), not the value.
  return done_of(value);
}

RawFuture RRefContext::value_for_request(const RRefId& id) {
  bool fresh = false;
  RawFuture value;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fresh = owners_.find(id) == owners_.end();
    value = record_locked(id).value;
  }
  if (fresh) {
    auto life = agent_.options().rpc_timeout;
    if (life.count() <= 0) life = std::chrono::milliseconds(60000);
    auto ctx = shared_from_this();
    layer::schedule_after(agent_, life, [ctx, id] { ctx->drop_placeholder(id); });
  }
  return value;
}

void RRefContext::drop_placeholder(const RRefId& id) {
  std::unique_ptr<OwnerRecord> dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owners_.find(id);
    if (it == owners_.end() || !it->second.forks.empty() || it->second.local_handles > 0 ||
        it->second.value->completed()) {
      return;  // claimed (or already gone) meanwhile
    }
    dead = std::make_unique<OwnerRecord>(std::move(it->second));
    owners_.erase(it);
  }
  dead->value->setError(std::make_exception_ptr(
      std::runtime_error("RRef " + id.str() + " is not known to its owner " + agent_.name())));
}

RawFuture RRefContext::on_fetch(const RRefId& id) { return value_for_request(id); }

RawFuture RRefContext::on_call(const RRefId& id, const std::string& fn,
                               std::vector<c10::IValue> args) {
  return apply_when_ready(value_for_request(id), fn, std::move(args), true);
}

bool RRefContext::take_tombstone_locked(const ForkId& fork) {
  return tombstones_->forks.erase(fork);
}

void RRefContext::on_fork(const RRefId& id, const ForkId& fork) {
  std::lock_guard<std::mutex> lock(mu_);
  if (take_tombstone_locked(fork)) return;  // its holder already let go
  record_locked(id).forks.insert(fork);
}

void RRefContext::on_delete(const std::vector<std::pair<RRefId, ForkId>>& batch) {
  std::vector<std::unique_ptr<OwnerRecord>> dead;  // freed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, fork] : batch) {
      auto it = owners_.find(id);
      if (it == owners_.end() || it->second.forks.erase(fork) == 0) {
        // Not known (yet): remember, so a create or fork that arrives later
        // for it does not resurrect it. Repeated deletes stay harmless.
        tombstones_->forks.insert(fork);
        if (it == owners_.end()) continue;
      }
      if (auto d = release_if_unused_locked(id)) dead.push_back(std::move(d));
    }
  }
}

size_t RRefContext::owned_values() const {
  std::lock_guard<std::mutex> lock(mu_);
  return owners_.size();
}

}  // namespace tandem::rpc
