#include "tandem/rpc/rref_context.h"

#include "tandem/rpc/agent.h"
#include "tandem/rpc/layer.h"
#include "tandem/rpc/registry.h"

namespace tandem::rpc {
namespace {

// Control messages carry ids as pairs of ints.
void push_id(std::vector<c10::IValue>& v, const GloballyUniqueId& id) {
  v.emplace_back(static_cast<int64_t>(id.worker));
  v.emplace_back(static_cast<int64_t>(id.local));
}

GloballyUniqueId id_at(const std::vector<c10::IValue>& args, size_t i) {
  if (args.size() < i + 2 || !args[i].isInt() || !args[i + 1].isInt()) {
    throw std::invalid_argument("malformed RRef control message");
  }
  return {static_cast<int32_t>(args[i].toInt()), static_cast<uint64_t>(args[i + 1].toInt())};
}

c10::IValue list_of(std::vector<c10::IValue> items) {
  c10::impl::GenericList list(c10::AnyType::get());
  list.reserve(items.size());
  for (auto& i : items) list.push_back(std::move(i));
  return c10::IValue(std::move(list));
}

std::vector<c10::IValue> items_of(const c10::IValue& v) {
  if (!v.isList()) throw std::invalid_argument("malformed RRef control message");
  auto l = v.toList();
  return std::vector<c10::IValue>(l.begin(), l.end());
}

RawFuture completed_future() {
  auto f = make_raw_future();
  f->markCompleted(c10::IValue());
  return f;
}

// Completes `out` like `from` (value or error), unless `out` already is.
void forward(c10::ivalue::Future& from, const RawFuture& out) {
  if (from.hasError()) {
    out->setErrorIfNeeded(from.exception_ptr());
  } else if (!out->completed()) {
    out->markCompleted(from.constValue());
  }
}

// The first of: `result` completes, or `confirmed` fails (a creation that
// failed would otherwise leave the owner waiting for a value forever).
// `rref` stays referenced until the answer is in: a caller that drops its
// handle right after asking cannot make the owner free the value first.
RawFuture race_with_confirmation(const RRefPtr& rref, const RawFuture& result) {
  const RawFuture& confirmed = rref->confirmed();
  auto out = make_raw_future();
  auto once = std::make_shared<std::atomic<bool>>(false);
  // The RRef is held until the reply is in, and let go before the caller
  // wakes: a caller that drops its last handle right after must find the
  // handle gone (and the graceful-shutdown leak check must not see it).
  result->addCallback([out, once, keep = RRefPtr(rref)](c10::ivalue::Future& r) mutable {
    keep.reset();
    if (once->exchange(true)) return;
    if (r.hasError()) {
      out->setError(r.exception_ptr());
    } else {
      out->markCompleted(r.constValue());
    }
  });
  confirmed->addCallback([out, once](c10::ivalue::Future& c) {
    if (c.hasError() && !once->exchange(true)) out->setError(c.exception_ptr());
  });
  return out;
}

constexpr int kControlAttempts = 3;
constexpr auto kControlBackoff = std::chrono::microseconds(50000);
constexpr auto kDeleteBatchDelay = std::chrono::microseconds(500);

}  // namespace

// ---- RRefImpl ------------------------------------------------------------------

RRefImpl::~RRefImpl() {
  if (auto ctx = ctx_.lock()) ctx->on_dropped(*this);
}

bool RRefImpl::confirmedByOwner() const {
  if (kind_ == Kind::kLocal) return true;
  return confirmed_ && confirmed_->completed() && !confirmed_->hasError();
}

std::shared_ptr<RRefContext> RRefImpl::context() const {
  auto ctx = ctx_.lock();
  if (!ctx) throw ShutdownError("the agent that held " + str() + " is gone");
  return ctx;
}

std::string RRefImpl::str() const {
  return "RRef " + desc_.id.str() + " (owner " +
         (owner_name_.empty() ? "rank " + std::to_string(desc_.owner) : owner_name_) + ")";
}

// ---- RRefContext ---------------------------------------------------------------

RRefContext::RRefContext(Agent& agent) : agent_(agent), self_(agent.rank()) {}

RRefContext::~RRefContext() {
  // Values may hold RRefs: destroy them outside the lock. Their handles can
  // no longer reach this context (the weak pointers are expired by now).
  decltype(owners_) owners;
  decltype(pending_children_) children;
  {
    std::lock_guard<std::mutex> lock(mu_);
    owners.swap(owners_);
    children.swap(pending_children_);
  }
}

void RRefContext::register_handlers(Registry& internal) {
  auto bind = [this](c10::IValue (RRefContext::*fn)(std::vector<c10::IValue>&)) {
    return [this, fn](std::vector<c10::IValue>& args) { return (this->*fn)(args); };
  };
  internal.def_ivalue("tandem.rref.create", bind(&RRefContext::on_create));
  internal.def_ivalue("tandem.rref.fetch", bind(&RRefContext::on_fetch));
  internal.def_ivalue("tandem.rref.call", bind(&RRefContext::on_call));
  internal.def_ivalue("tandem.rref.fork", bind(&RRefContext::on_fork));
  internal.def_ivalue("tandem.rref.delete", bind(&RRefContext::on_delete));
  internal.def_ivalue("tandem.rref.child_accept", bind(&RRefContext::on_child_accept));
}

const std::shared_ptr<ThreadPool>& RRefContext::pool() const { return layer::pool(agent_); }

void RRefContext::spin_until_done(const RawFuture& f) const { layer::spin_until_done(agent_, f); }

WorkerInfo RRefContext::worker_info(int rank) const { return agent_.get_worker_info(rank); }

std::string RRefContext::worker_name(int rank) const { return agent_.get_worker_info(rank).name; }

ForkId RRefContext::new_id() { return {self_, next_local_.fetch_add(1)}; }

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

RRefPtr RRefContext::bind_new(const RRefDesc& desc, RRefImpl::Kind kind, RawFuture confirmed) {
  auto r = c10::make_intrusive<RRefImpl>(desc);
  r->kind_ = kind;
  r->is_owner_ = desc.owner == self_;
  r->owner_name_ = worker_name(desc.owner);
  r->confirmed_ = std::move(confirmed);
  r->ctx_ = weak_from_this();
  return r;
}

void RRefContext::finish_outstanding_locked(int n) {
  outstanding_ -= n;
  if (outstanding_ == 0) idle_cv_.notify_all();
}

void RRefContext::finish_outstanding(int n) {
  std::lock_guard<std::mutex> lock(mu_);
  finish_outstanding_locked(n);
}

bool RRefContext::control(std::function<void(std::function<void()> done)> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return false;
    ++outstanding_;
  }
  auto self = shared_from_this();
  auto done = [self] { self->finish_outstanding(); };
  // Control messages may connect to a peer: never on the loop thread.
  pool()->post([fn = std::move(fn), done] {
    try {
      fn(done);
    } catch (...) {
      done();
    }
  });
  return true;
}

RRefPtr RRefContext::remote(int owner, const std::string& fn, std::vector<c10::IValue> args,
                            std::chrono::milliseconds timeout, const RRefPtr& self) {
  RRefDesc d;
  d.owner = owner;
  d.id = new_id();
  d.fork = d.id;  // the creator's fork is the RRef's own id
  d.parent = self_;
  RawFuture confirmed = make_raw_future();
  RRefPtr r = bind_new(d, RRefImpl::Kind::kFork, confirmed);
  std::vector<c10::IValue> msg;
  push_id(msg, d.id);
  push_id(msg, d.fork);
  msg.emplace_back(fn);
  push_id(msg, self ? self->desc().id : GloballyUniqueId{-1, 0});
  msg.push_back(list_of(std::move(args)));
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
  return bind_new(d, RRefImpl::Kind::kLocal, completed_future());
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
  std::vector<c10::IValue> msg;
  push_id(msg, rref->desc().id);
  auto f = agent_.call(worker_name(rref->desc().owner), "tandem.rref.fetch", std::move(msg), timeout);
  return race_with_confirmation(rref, f.raw());
}

RawFuture RRefContext::call(const RRefPtr& rref, const std::string& fn,
                            std::vector<c10::IValue> args, std::chrono::milliseconds timeout) {
  if (auto f = failed_already(rref)) return f;
  std::vector<c10::IValue> msg;
  push_id(msg, rref->desc().id);
  msg.emplace_back(fn);
  msg.push_back(list_of(std::move(args)));
  auto f = agent_.call(worker_name(rref->desc().owner), "tandem.rref.call", std::move(msg), timeout);
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
  if (rref->kind() == RRefImpl::Kind::kUnbound) throw std::logic_error("unbound RRef");
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
    ++outstanding_;                     // ... and graceful shutdown waits for that
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
        finish_outstanding_locked();
      }
    }
  }
}

void RRefContext::send_control(int to, const std::string& fn, std::vector<c10::IValue> msg,
                               std::function<void(std::exception_ptr)> then, int attempt) {
  RawFuture f;
  try {
    f = agent_.call(worker_name(to), fn, msg).raw();
  } catch (...) {
    then(std::current_exception());
    return;
  }
  auto ctx = shared_from_this();
  f->addCallback([ctx, to, fn, msg = std::move(msg), then = std::move(then),
                  attempt](c10::ivalue::Future& r) mutable {
    std::exception_ptr error = r.hasError() ? r.exception_ptr() : nullptr;
    bool retry = false;
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const TimeoutError&) {
        retry = attempt < kControlAttempts;  // control messages are idempotent: try again
      } catch (const DisconnectedError&) {
        retry = attempt < kControlAttempts;  // the connection may drop while the peer lives
      } catch (...) {
      }
    }
    {
      std::lock_guard<std::mutex> lock(ctx->mu_);
      if (ctx->closed_) retry = false;
    }
    if (retry) {
      layer::schedule_after(ctx->agent_, kControlBackoff * attempt,
                                 [ctx, to, fn, msg = std::move(msg), then, attempt]() mutable {
                                   ctx->send_control(to, fn, std::move(msg), then, attempt + 1);
                                 });
    } else {
      then(error);
    }
  });
}

void RRefContext::validate(const RRefPtr& rref, int from) const {
  const RRefDesc& d = rref->desc();
  const int world = agent_.world_size();
  if (d.owner >= world || d.parent >= world || d.id.worker >= world || d.fork.worker >= world) {
    throw ProtocolError("RRef descriptor names a worker outside the world");
  }
  if (d.parent != from) {
    throw ProtocolError("RRef forked by rank " + std::to_string(d.parent) + " arrived from rank " +
                        std::to_string(from));
  }
}

void RRefContext::bind_received(const RRefPtr& rref, int from) {
  (void)from;  // validate() checked it is the parent
  const RRefDesc& d = rref->desc();
  rref->ctx_ = weak_from_this();
  rref->is_owner_ = d.owner == self_;
  rref->owner_name_ = worker_name(d.owner);
  if (d.owner == self_) {
    rref->kind_ = RRefImpl::Kind::kLocal;
    rref->confirmed_ = completed_future();
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
        std::vector<c10::IValue> msg;
        push_id(msg, desc.fork);
        send_control(desc.parent, "tandem.rref.child_accept", std::move(msg),
                     [done](std::exception_ptr) { done(); });
      });
    }
    return;
  }
  rref->kind_ = RRefImpl::Kind::kFork;
  {
    std::lock_guard<std::mutex> lock(mu_);
    users_[d.fork] = d;
  }
  if (d.parent == d.owner) {
    rref->confirmed_ = completed_future();  // the owner counted it when it sent it
    return;
  }
  RawFuture confirmed = make_raw_future();
  rref->confirmed_ = confirmed;
  RRefDesc desc = d;
  bool started = control([this, desc, confirmed](std::function<void()> done) {
    std::vector<c10::IValue> msg;
    push_id(msg, desc.id);
    push_id(msg, desc.fork);
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
                   std::vector<c10::IValue> accept;
                   push_id(accept, desc.fork);
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
  if (rref.kind() != RRefImpl::Kind::kFork) return;
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
  std::vector<c10::IValue> flat;
  for (const auto& q : batch) {
    push_id(flat, q.id);
    push_id(flat, q.fork);
  }
  auto ctx = shared_from_this();
  // Whatever the answer (an owner that is gone has nothing left to delete),
  // this batch is done; deletes that queued meanwhile go next.
  send_control(owner, "tandem.rref.delete", {list_of(std::move(flat))},
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

bool RRefContext::wait_idle(std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_cv_.wait_for(lock, limit, [this] { return outstanding_ == 0; });
}

void RRefContext::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
}

std::vector<std::string> RRefContext::live_user_refs() const {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [fork, d] : users_) {
    out.push_back("RRef " + d.id.str() + " (owner " + worker_name(d.owner) + ")");
  }
  return out;
}

size_t RRefContext::owned_values() const {
  std::lock_guard<std::mutex> lock(mu_);
  return owners_.size();
}

// ---- handlers ------------------------------------------------------------------

RawFuture RRefContext::apply_when_ready(RawFuture value, const std::string& fn,
                                        std::vector<c10::IValue> args, bool with_value) {
  auto out = make_raw_future();
  auto handler = agent_.registry().find(fn);
  if (!handler) {
    out->setError(std::make_exception_ptr(UnknownFunctionError(
        "no function '" + fn + "' is registered")));
    return out;
  }
  std::weak_ptr<Agent> weak_agent = agent_.weak_from_this();
  auto run = [weak_agent, handler, out, args = std::move(args)](const c10::IValue* self) mutable {
    auto agent = weak_agent.lock();
    if (!agent) {
      out->setError(std::make_exception_ptr(ShutdownError("the agent is gone")));
      return;
    }
    std::vector<c10::IValue> all;
    all.reserve(args.size() + 1);
    if (self) all.push_back(*self);
    for (auto& a : args) all.push_back(std::move(a));
    layer::run_as_handler(*agent, [&] {
      try {
        HandlerResult r = (*handler)(all);
        if (r.future) {
          r.future->addCallback([out](c10::ivalue::Future& f) { forward(f, out); });
        } else {
          out->markCompleted(std::move(r.value));
        }
      } catch (...) {
        out->setError(std::current_exception());
      }
    });
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

c10::IValue RRefContext::on_create(std::vector<c10::IValue>& args) {
  if (args.size() != 8 || !args[4].isString()) {
    throw std::invalid_argument("malformed RRef control message");
  }
  RRefId id = id_at(args, 0);
  ForkId fork = id_at(args, 2);
  std::string fn = args[4].toStringRef();
  RRefId self_id = id_at(args, 5);
  std::vector<c10::IValue> user_args = items_of(args[7]);
  if (id.worker < 0 || id.worker >= agent_.world_size()) {
    throw std::invalid_argument("malformed RRef id");
  }
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
    if (self_id.worker >= 0) self_value = record_locked(self_id).value;
  }
  if (first && !value->completed()) {  // a retried create runs nothing twice
    RawFuture produced = self_value ? apply_when_ready(self_value, fn, std::move(user_args), true)
                                    : apply_when_ready(RawFuture(), fn, std::move(user_args), false);
    produced->addCallback([value](c10::ivalue::Future& f) { forward(f, value); });
  }
  // The creator hears when the value exists (or why it does not), not the value.
  auto reply = make_raw_future();
  value->addCallback([reply](c10::ivalue::Future& f) {
    if (f.hasError()) {
      reply->setError(f.exception_ptr());
    } else {
      reply->markCompleted(c10::IValue());
    }
  });
  return c10::IValue(reply);
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
  dead->value->setError(std::make_exception_ptr(std::runtime_error(
      "RRef " + id.str() + " is not known to its owner " + agent_.name())));
}

c10::IValue RRefContext::on_fetch(std::vector<c10::IValue>& args) {
  return c10::IValue(value_for_request(id_at(args, 0)));
}

c10::IValue RRefContext::on_call(std::vector<c10::IValue>& args) {
  if (args.size() != 4 || !args[2].isString()) {
    throw std::invalid_argument("malformed RRef control message");
  }
  RawFuture value = value_for_request(id_at(args, 0));
  return c10::IValue(apply_when_ready(value, args[2].toStringRef(), items_of(args[3]), true));
}

bool RRefContext::take_tombstone_locked(const ForkId& fork) {
  return tombstones_.erase(fork);
}

c10::IValue RRefContext::on_fork(std::vector<c10::IValue>& args) {
  RRefId id = id_at(args, 0);
  ForkId fork = id_at(args, 2);
  std::lock_guard<std::mutex> lock(mu_);
  if (take_tombstone_locked(fork)) return c10::IValue();  // its holder already let go
  record_locked(id).forks.insert(fork);
  return c10::IValue();
}

c10::IValue RRefContext::on_delete(std::vector<c10::IValue>& args) {
  if (args.size() != 1) throw std::invalid_argument("malformed RRef control message");
  std::vector<c10::IValue> flat = items_of(args[0]);
  if (flat.size() % 4 != 0) throw std::invalid_argument("malformed RRef control message");
  std::vector<std::unique_ptr<OwnerRecord>> dead;  // freed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < flat.size(); i += 4) {
      RRefId id = id_at(flat, i);
      ForkId fork = id_at(flat, i + 2);
      auto it = owners_.find(id);
      if (it == owners_.end() || it->second.forks.erase(fork) == 0) {
        // Not known (yet): remember, so a create or fork that arrives later
        // for it does not resurrect it. Repeated deletes stay harmless.
        tombstones_.insert(fork);
        if (it == owners_.end()) continue;
      }
      if (auto d = release_if_unused_locked(id)) dead.push_back(std::move(d));
    }
  }
  return c10::IValue();
}

c10::IValue RRefContext::on_child_accept(std::vector<c10::IValue>& args) {
  ForkId fork = id_at(args, 0);
  RRefPtr held;  // released outside the lock: it may be our last handle
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_children_.find(fork);
    if (it == pending_children_.end()) return c10::IValue();
    held = std::move(it->second);
    pending_children_.erase(it);
    finish_outstanding_locked();
  }
  return c10::IValue();
}

}  // namespace tandem::rpc
