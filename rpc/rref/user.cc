// The user's side of RRefs: creating values on owners, fetching and calling
// them, forking references into messages, and deleting forks (batched).
#include "tandem/rpc/rref_context.h"

#include "tandem/rpc/layer.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rref/detail.h"

namespace tandem::rpc {
using namespace rref_detail;
namespace {
// The first of: `result` completes, or `confirmed` fails (a creation that
// failed would otherwise leave the owner waiting for a value forever).
// `rref` stays referenced until the answer is in, and is let go before the
// caller wakes: a caller that drops its handle right after asking cannot make
// the owner free the value first, and a caller that drops its last handle
// right after must find it gone (the graceful-shutdown leak check too).
RawFuture race_with_confirmation(const RRefPtr& rref, const RawFuture& result) {
  // Callbacks run in the order they were added: this one before the one
  // that completes what the caller waits on.
  result->addCallback([keep = RRefPtr(rref)](c10::ivalue::Future&) mutable { keep.reset(); });
  const RawFuture& confirmed = rref->confirmed();
  if (confirmed->completed() && !confirmed->hasError()) {  // the usual case: no race
    auto out = make_raw_future();
    result->addCallback([out](c10::ivalue::Future& r) { forward_raw(r, out); });
    return out;
  }
  return when_any_raw({result, error_of(confirmed)});
}
}  // namespace

RRefPtr RRefContext::remote(int owner, const std::string& fn, std::vector<c10::IValue> args,
                            std::chrono::milliseconds timeout, const RRefPtr& self) {
  RRefDesc d;
  d.owner = owner;
  d.id = new_id();
  d.fork = d.id;  // the creator's fork is the RRef's own id
  d.parent = self_;
  RawFuture confirmed = make_raw_future();
  RRefPtr r = new_handle(d, RRefImpl::Kind::kFork, confirmed);
  c10::optional<WireId> from;
  if (self) from = wire(self->desc().id);
  std::vector<c10::IValue> msg =
      to_ivalues(wire(d.id), wire(d.fork), fn, from, list_of(std::move(args)));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw ShutdownError("agent " + agent_.name() + " is shut down");
    users_[d.fork] = d;
    ++outstanding_;
  }
  auto ctx = shared_from_this();
  auto done = [ctx] { ctx->finish_outstanding(); };
  RawFuture reply;
  try {
    // From the caller's thread: no hand-off before the request leaves.
    reply = agent_.call(worker_name(owner), "tandem.rref.create", std::move(msg), timeout).raw();
  } catch (...) {
    confirmed->setError(std::current_exception());
    done();
    return r;
  }
  // `self` (the value the function starts from) stays referenced until the
  // owner has answered, even if the caller drops it at once.
  reply->addCallback([confirmed, done, self](c10::ivalue::Future& f) {
    if (f.hasError()) {
      confirmed->setError(f.exception_ptr());
    } else {
      confirmed->markCompleted(c10::IValue());
    }
    done();
  });
  return r;
}

// A reference whose creation (or registration) failed raises that error
// without asking the owner.
static RawFuture failed_already(const RRefPtr& rref) {
  const RawFuture& c = rref->confirmed();
  if (c->completed() && c->hasError()) {
    auto out = make_raw_future();
    out->setError(c->exception_ptr());
    return out;
  }
  return RawFuture();
}

RawFuture RRefContext::fetch(const RRefPtr& rref, std::chrono::milliseconds timeout) {
  if (auto f = failed_already(rref)) return f;
  std::vector<c10::IValue> msg = to_ivalues(wire(rref->desc().id));
  auto f =
      agent_.call(worker_name(rref->desc().owner), "tandem.rref.fetch", std::move(msg), timeout);
  return race_with_confirmation(rref, f.raw());
}

RawFuture RRefContext::call(const RRefPtr& rref, const std::string& fn,
                            std::vector<c10::IValue> args, std::chrono::milliseconds timeout) {
  if (auto f = failed_already(rref)) return f;
  std::vector<c10::IValue> msg = to_ivalues(wire(rref->desc().id), fn, list_of(std::move(args)));
  auto f =
      agent_.call(worker_name(rref->desc().owner), "tandem.rref.call", std::move(msg), timeout);
  return race_with_confirmation(rref, f.raw());
}

c10::IValue RRefContext::local_value(const RRefPtr& rref, std::chrono::milliseconds timeout) {
  if (rref->desc().owner != self_) {
    throw std::logic_error("local_value() on " + agent_.name() + " of " + rref->str() +
                           ": only the owner has the value; use to_here()");
  }
  RawFuture value;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = owners_.find(rref->desc().id);
    if (it == owners_.end()) {
      throw std::logic_error(rref->str() + " is not held by its owner any more");
    }
    value = it->second.value;
  }
  wait_raw_or_throw(value, timeout, "value of " + rref->str());
  return value->constValue();
}

RRefDesc RRefContext::fork_for_send(const RRefPtr& rref, int dest) {
  (void)dest;
  if (rref->confirmed()->completed() && rref->confirmed()->hasError()) {
    std::rethrow_exception(rref->confirmed()->exception_ptr());  // a failed remote()
  }
  RRefDesc d = rref->desc();
  d.fork = new_id();
  d.parent = self_;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw ShutdownError("agent " + agent_.name() + " is shut down");
  if (d.owner == self_) {
    record_locked(d.id).forks.insert(d.fork);  // the owner counts the new fork itself
  } else {
    pending_children_[d.fork] = rref;  // hold our own reference until the owner knows the child
    ++outstanding_;                    // ... and graceful shutdown waits for that
  }
  return d;
}

void RRefContext::abort_forks(const std::vector<RRefDesc>& forks) {
  std::vector<RRefPtr> held;
  std::vector<std::unique_ptr<OwnerRecord>> dead;  // both released outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& d : forks) {
      if (d.owner == self_) {
        auto it = owners_.find(d.id);
        if (it == owners_.end()) continue;
        it->second.forks.erase(d.fork);
        if (auto r = release_if_unused_locked(d.id)) dead.push_back(std::move(r));
      } else {
        auto it = pending_children_.find(d.fork);
        if (it == pending_children_.end()) continue;
        held.push_back(std::move(it->second));
        pending_children_.erase(it);
      }
    }
  }
  // As in on_child_accept: let go first, then count the hand-overs done.
  const int undone = static_cast<int>(held.size());
  held.clear();
  if (undone) finish_outstanding(undone);
}

void RRefContext::validate(const RRefDesc& d, int from) const {
  const int world = agent_.world_size();
  if (d.owner >= world || d.parent >= world || d.id.worker >= world || d.fork.worker >= world) {
    throw ProtocolError("RRef descriptor names a worker outside the world");
  }
  if (d.parent != from) {
    throw ProtocolError("RRef forked by rank " + std::to_string(d.parent) + " arrived from rank " +
                        std::to_string(from));
  }
}

RRefPtr RRefContext::adopt_received(const RRefDesc& d) {
  if (d.owner == self_) {
    RRefPtr rref = new_handle(d, RRefImpl::Kind::kLocal, completed_future());
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& rec = record_locked(d.id);
      ++rec.local_handles;
      if (d.parent == self_) rec.forks.erase(d.fork);  // it was counted when we sent it
    }
    if (d.parent != self_) {
      // A user forked it to us, the owner: our local handle now keeps the
      // value, so the parent may let go.
      RRefDesc desc = d;
      control([this, desc](std::function<void()> done) {
        std::vector<c10::IValue> msg = to_ivalues(wire(desc.fork));
        send_control(desc.parent, "tandem.rref.child_accept", std::move(msg),
                     [done](std::exception_ptr) { done(); });
      });
    }
    return rref;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    users_[d.fork] = d;
  }
  if (d.parent == d.owner) {
    // The owner counted it when it sent it.
    return new_handle(d, RRefImpl::Kind::kFork, completed_future());
  }
  RawFuture confirmed = make_raw_future();
  RRefPtr rref = new_handle(d, RRefImpl::Kind::kFork, confirmed);
  RRefDesc desc = d;
  bool started = control([this, desc, confirmed](std::function<void()> done) {
    std::vector<c10::IValue> msg = to_ivalues(wire(desc.id), wire(desc.fork));
    auto ctx = shared_from_this();
    send_control(desc.owner, "tandem.rref.fork", std::move(msg),
                 [ctx, desc, confirmed, done](std::exception_ptr error) {
                   if (error) {
                     confirmed->setError(error);
                   } else {
                     confirmed->markCompleted(c10::IValue());
                   }
                   // Either way the parent may let go now (an owner that cannot
                   // be reached has nothing left to protect).
                   std::vector<c10::IValue> accept = to_ivalues(wire(desc.fork));
                   ctx->pool()->post([ctx, desc, accept, done]() mutable {
                     ctx->send_control(desc.parent, "tandem.rref.child_accept", std::move(accept),
                                       [done](std::exception_ptr) { done(); });
                   });
                 });
  });
  if (!started) {
    // Shutting down: this reference can never be confirmed; say so rather
    // than leave a waiter hanging.
    confirmed->setError(std::make_exception_ptr(
        ShutdownError("agent " + agent_.name() + " is shutting down; " + rref->str() +
                      " cannot be registered with its owner")));
  }
  return rref;
}

void RRefContext::on_dropped(RRefImpl& rref) {
  const RRefDesc d = rref.desc();
  if (rref.kind() == RRefImpl::Kind::kLocal) {
    std::unique_ptr<OwnerRecord> dead;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = owners_.find(d.id);
      if (it == owners_.end()) return;
      --it->second.local_handles;
      dead = release_if_unused_locked(d.id);
    }
    return;  // `dead` (and the value) goes here, outside the lock
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    users_.erase(d.fork);
  }
  // A fork is deleted only once the owner knows it (or never will).
  RawFuture confirmed = rref.confirmed();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    ++outstanding_;  // until the delete is queued
  }
  auto ctx = shared_from_this();
  confirmed->addCallback([ctx, d](c10::ivalue::Future&) {
    ctx->queue_delete(d);
    ctx->finish_outstanding();
  });
}

void RRefContext::queue_delete(const RRefDesc& d) {
  bool schedule = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    delete_queue_[d.owner].push_back({d.id, d.fork});
    ++outstanding_;  // until its batch is answered
    schedule = delete_scheduled_.insert(d.owner).second;
  }
  if (schedule) {
    auto ctx = shared_from_this();
    int owner = d.owner;
    layer::schedule_after(agent_, kDeleteBatchDelay, [ctx, owner] { ctx->flush_deletes(owner); });
  }
}

void RRefContext::flush_deletes(int owner) {
  std::vector<QueuedDelete> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(delete_queue_[owner]);
    if (batch.empty()) {
      delete_scheduled_.erase(owner);
      return;
    }
  }
  std::vector<int64_t> flat;
  flat.reserve(4 * batch.size());
  for (const auto& q : batch) {
    flat.insert(flat.end(), {q.id.worker, static_cast<int64_t>(q.id.local), q.fork.worker,
                             static_cast<int64_t>(q.fork.local)});
  }
  auto ctx = shared_from_this();
  // Whatever the answer (an owner that is gone has nothing left to delete),
  // this batch is done; deletes that queued meanwhile go next.
  send_control(owner, "tandem.rref.delete", to_ivalues(std::move(flat)),
               [ctx, owner, n = batch.size()](std::exception_ptr) {
                 bool again = false;
                 {
                   std::lock_guard<std::mutex> lock(ctx->mu_);
                   ctx->finish_outstanding_locked(static_cast<int>(n));
                   again = !ctx->delete_queue_[owner].empty() && !ctx->closed_;
                   if (!again) ctx->delete_scheduled_.erase(owner);
                 }
                 if (again) ctx->pool()->post([ctx, owner] { ctx->flush_deletes(owner); });
               });
}

std::vector<std::string> RRefContext::live_user_refs() const {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [fork, d] : users_) {
    out.push_back("RRef " + d.id.str() + " (owner " + worker_name(d.owner) + ")");
  }
  return out;
}

}  // namespace tandem::rpc
