// The RRef protocol's plumbing: the context's life, its handlers, and the
// control messages (sent idempotently and retried on timeouts), shared by
// the owner's side (owner.cc) and the user's side (user.cc).
#include "tandem/rpc/rref_context.h"

#include "tandem/rpc/layer.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/rref/detail.h"

namespace tandem::rpc {
using namespace rref_detail;

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

RRefContext::RRefContext(Agent& agent)
    : agent_(agent), self_(agent.rank()), tombstones_(std::make_unique<Tombstones>()) {}

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
  // Every argument a peer sent is checked by its type here (a mismatch fails
  // that request, naming the argument), and every id against the world's
  // size, known once the agent has met the others (after this runs).
  auto check = [this](const WireId& w) { return id_of(w, agent_.world_size()); };
  internal.def("tandem.rref.create", [this, check](WireId id, WireId fork, std::string fn,
                                                   c10::optional<WireId> self, c10::IValue args) {
    c10::optional<RRefId> from;
    if (self) from = check(*self);
    return Future<void>(on_create(check(id), check(fork), fn, from, items_of(args)), nullptr);
  });
  internal.def("tandem.rref.fetch", [this, check](WireId id) {
    return Future<c10::IValue>(on_fetch(check(id)), nullptr);
  });
  internal.def("tandem.rref.call", [this, check](WireId id, std::string fn, c10::IValue args) {
    return Future<c10::IValue>(on_call(check(id), fn, items_of(args)), nullptr);
  });
  internal.def("tandem.rref.fork",
               [this, check](WireId id, WireId fork) { on_fork(check(id), check(fork)); });
  internal.def("tandem.rref.delete", [this, check](std::vector<int64_t> flat) {
    // (id worker, id local, fork worker, fork local) per deleted fork.
    if (flat.size() % 4 != 0) {
      throw std::invalid_argument("malformed RRef delete: " + std::to_string(flat.size()) +
                                  " numbers, not a multiple of 4");
    }
    std::vector<std::pair<RRefId, ForkId>> batch;
    for (size_t i = 0; i < flat.size(); i += 4) {
      batch.emplace_back(check({flat[i], flat[i + 1]}), check({flat[i + 2], flat[i + 3]}));
    }
    on_delete(batch);
  });
  internal.def("tandem.rref.child_accept",
               [this, check](WireId fork) { on_child_accept(check(fork)); });
}

const std::shared_ptr<ThreadPool>& RRefContext::pool() const { return layer::pool(agent_); }

void RRefContext::spin_until_done(const RawFuture& f) const { layer::spin_until_done(agent_, f); }

WorkerInfo RRefContext::worker_info(int rank) const { return agent_.get_worker_info(rank); }

std::string RRefContext::worker_name(int rank) const { return agent_.get_worker_info(rank).name; }

ForkId RRefContext::new_id() { return {self_, next_local_.fetch_add(1)}; }

RRefPtr RRefContext::new_handle(const RRefDesc& desc, RRefImpl::Kind kind, RawFuture confirmed) {
  return c10::make_intrusive<RRefImpl>(desc, kind, worker_name(desc.owner), std::move(confirmed),
                                       weak_from_this(), desc.owner == self_);
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
      // (not a peer found stalled: it would not answer the next try either)
      try {
        if (retry && !ctx->agent_.stalled(ctx->worker_name(to)).empty()) retry = false;
      } catch (const std::exception&) {
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

bool RRefContext::wait_idle(std::chrono::milliseconds limit) {
  std::unique_lock<std::mutex> lock(mu_);
  return idle_cv_.wait_for(lock, limit, [this] { return outstanding_ == 0; });
}

void RRefContext::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
}

void RRefContext::on_child_accept(const ForkId& fork) {
  RRefPtr held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_children_.find(fork);
    if (it == pending_children_.end()) return;
    held = std::move(it->second);
    pending_children_.erase(it);
  }
  // Let go outside the lock (it may be our last handle, whose delete is
  // counted as outstanding), and only then count the hand-over done: in the
  // other order, graceful shutdown could see nothing outstanding between the
  // two and close before that delete went out.
  held.reset();
  finish_outstanding();
}

}  // namespace tandem::rpc
