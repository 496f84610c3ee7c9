// RRef<T>: a reference to a value that lives on one worker (its owner).
//
//   auto w = rpc::remote<at::Tensor>("worker1", "make_weights", 1024);  // returns at once
//   at::Tensor copy = w.to_here();                  // fetch the value
//   at::Tensor y = w.rpc_sync<at::Tensor>("matmul", x);  // matmul(value, x) runs on worker1
//   rpc::rpc_sync("worker2", "consume", w);         // RRefs travel as arguments and results
//   rpc::RRef<at::Tensor> mine(at::ones({3}));     // a local owner reference
//
// The owner keeps the value while any reference to it is alive anywhere, and
// frees it when the last one goes (rpc/rref_context.h has the protocol). A
// remote() whose creation failed raises that error at the first use of the
// reference. Operations on a reference whose owner died fail with
// DisconnectedError. Copies of an RRef<T> in one process share one handle.
#pragma once

#include "tandem/rpc/api.h"
#include "tandem/rpc/rref_context.h"

namespace tandem::rpc {

template <class T = c10::IValue>
class RRef {
 public:
  RRef() = default;
  explicit RRef(RRefPtr impl) : impl_(std::move(impl)) {}
  // A local owner reference on the current agent.
  explicit RRef(T value) : RRef(make_local(*current_agent(), std::move(value))) {}

  static RRef make_local(Agent& agent, T value) {
    return RRef(agent.rrefs().make_local(to_ivalue(std::move(value))));
  }

  bool valid() const { return impl_.defined(); }
  // The owner's worker info (name, rank, address).
  WorkerInfo owner() const { return ctx()->worker_info(impl().desc().owner); }
  int owner_rank() const { return impl().desc().owner; }
  std::string owner_name() const { return impl().ownerName(); }
  bool is_owner() const { return impl().isOwner(); }
  bool confirmed_by_owner() const { return impl().confirmedByOwner(); }
  // Completes once the owner confirmed this reference; carries the error of a
  // failed creation.
  Future<void> confirmation() const { return Future<void>(impl().confirmed(), ctx()->pool()); }
  // Blocks until confirmed (spinning briefly first, like rpc_sync); rethrows
  // the error of a failed creation.
  void wait_confirmed() const {
    auto c = ctx();
    c->spin_until_done(impl().confirmed());
    confirmation().wait();
  }

  // A copy of the value, from the owner.
  T to_here(std::chrono::milliseconds timeout = kDefaultTimeout) const {
    auto f = to_here_async(timeout);
    ctx()->spin_until_done(f.raw());
    return f.wait();
  }
  Future<T> to_here_async(std::chrono::milliseconds timeout = kDefaultTimeout) const {
    auto c = ctx();
    return Future<T>(c->fetch(impl_, timeout), c->pool());
  }
  // The value itself; only on its owner (std::logic_error elsewhere).
  T local_value(std::chrono::milliseconds timeout = kNoTimeout) const {
    return from_ivalue<T>(ctx()->local_value(impl_, timeout), "local_value");
  }

  // Method proxies: run the registered `fn` on the owner with the value as
  // its first argument.
  template <class R = c10::IValue, class... A>
  R rpc_sync(const std::string& fn, A&&... args) const {
    auto f = rpc_async<R>(fn, std::forward<A>(args)...);
    ctx()->spin_until_done(f.raw());
    return f.wait();
  }
  template <class R = c10::IValue, class... A>
  Future<R> rpc_async(const std::string& fn, A&&... args) const {
    return rpc_async<R>(CallOptions{}, fn, std::forward<A>(args)...);
  }
  // With a timeout of the call's own (kNoTimeout: none).
  template <class R = c10::IValue, class... A>
  R rpc_sync(const CallOptions& opts, const std::string& fn, A&&... args) const {
    auto f = rpc_async<R>(opts, fn, std::forward<A>(args)...);
    ctx()->spin_until_done(f.raw());
    return f.wait();
  }
  template <class R = c10::IValue, class... A>
  Future<R> rpc_async(const CallOptions& opts, const std::string& fn, A&&... args) const {
    auto c = ctx();
    return Future<R>(c->call(impl_, fn, to_ivalues(std::forward<A>(args)...), opts.timeout),
                     c->pool());
  }
  // Creates fn(value, args...) on the owner and returns a reference to it.
  template <class R = c10::IValue, class... A>
  RRef<R> remote(const std::string& fn, A&&... args) const {
    return RRef<R>(ctx()->remote(owner_rank(), fn, to_ivalues(std::forward<A>(args)...),
                                 kDefaultTimeout, impl_));
  }

  const RRefPtr& impl_ptr() const { return impl_; }

  // For convert.h: RRefs travel inside IValues.
  static RRef from_ivalue_checked(const c10::IValue& v, const std::string& what) {
    if (!v.isRRef()) throw std::invalid_argument(what + ": expected RRef, got " + v.tagKind());
    auto* impl = dynamic_cast<RRefImpl*>(v.toRRef().get());
    if (!impl) throw std::invalid_argument(what + ": not a Tandem RRef");
    return RRef(RRefPtr::reclaim_copy(impl));
  }
  c10::IValue to_ivalue_checked() const {
    return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(impl_));
  }

 private:
  const RRefImpl& impl() const {
    if (!impl_) throw std::logic_error("empty RRef");
    return *impl_;
  }
  std::shared_ptr<RRefContext> ctx() const { return impl().context(); }
  RRefPtr impl_;
};

template <class T>
struct is_rref<RRef<T>> : std::true_type {};

// remote(): create `fn(args...)` on worker `to`; returns at once.
template <class R = c10::IValue, class... A>
RRef<R> remote(Agent& agent, const CallOptions& opts, const std::string& to, const std::string& fn,
               A&&... args) {
  return RRef<R>(agent.rrefs().remote(agent.get_worker_info(to).rank, fn,
                                      to_ivalues(std::forward<A>(args)...), opts.timeout));
}
template <class R = c10::IValue, class... A>
RRef<R> remote(Agent& agent, const std::string& to, const std::string& fn, A&&... args) {
  return remote<R>(agent, CallOptions{}, to, fn, std::forward<A>(args)...);
}
template <class R = c10::IValue, class... A>
RRef<R> remote(const std::string& to, const std::string& fn, A&&... args) {
  return remote<R>(*current_agent(), CallOptions{}, to, fn, std::forward<A>(args)...);
}
template <class R = c10::IValue, class... A>
RRef<R> remote(const CallOptions& opts, const std::string& to, const std::string& fn, A&&... args) {
  return remote<R>(*current_agent(), opts, to, fn, std::forward<A>(args)...);
}

}  // namespace tandem::rpc
