// Future<T>: the typed result of an asynchronous call, a thin wrapper over
// LibTorch's c10::ivalue::Future, and the waiting helpers every layer uses.
//
// Promises:
//  1. A future completes exactly once: with a value, or with an error
//     (RemoteError, TimeoutError, DisconnectedError, ...). wait() returns the
//     value converted to T, or rethrows the error with its type intact;
//     wait(timeout) throws TimeoutError if it has not completed by then.
//  2. then(fn) runs fn(Future<T>) on the agent's thread pool once this future
//     completes, never inline in the call to then(), and returns a future of
//     what fn returns; if fn throws, that future carries the exception. If fn
//     returns a Future<U>, the result is a Future<U> that completes with it.
//  3. fn runs in the scope that was current where then() was called (the
//     autograd context and the deadline; rpc/scope.h), acting for the agent
//     whose future this is.
//  4. when_all(fs) completes once every future in fs has: with their values,
//     or with the error of the first (in order) that failed. when_any(fs)
//     completes as the first of them does.
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "tandem/rpc/convert.h"
#include "tandem/rpc/scope.h"
#include "tandem/rpc/thread_pool.h"

namespace tandem::rpc {

template <class T>
class Future;

template <class T>
struct is_future : std::false_type {};
template <class T>
struct is_future<Future<T>> : std::true_type {};

namespace detail {
template <class R>
struct then_result {
  using type = Future<R>;
};
template <class U>
struct then_result<Future<U>> {
  using type = Future<U>;
};
template <>
struct then_result<void> {
  using type = Future<void>;
};
}  // namespace detail

using RawFuture = c10::intrusive_ptr<c10::ivalue::Future>;

inline RawFuture make_raw_future() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
}

// Blocks until `f` completes or `timeout` passes (0: no limit); true if it completed.
bool wait_raw(const RawFuture& f, std::chrono::milliseconds timeout);
// Throws `f`'s error, or TimeoutError naming `what` if it did not complete
// within `timeout` (0: no limit).
void wait_raw_or_throw(const RawFuture& f, std::chrono::milliseconds timeout,
                       const std::string& what);
// Untyped when_all / when_any: when_all's value is a list of the values.
RawFuture when_all_raw(const std::vector<RawFuture>& all);
RawFuture when_any_raw(const std::vector<RawFuture>& any);
// Completes `out` as `from` completed (its value or its error), unless `out`
// already has. Call it from one of `from`'s callbacks.
void forward_raw(c10::ivalue::Future& from, const RawFuture& out);
// Fails as `f` fails; never completes if `f` succeeds (for when_any_raw:
// "the first of: a result, or a failure of f").
RawFuture error_of(const RawFuture& f);
// Completes as `f` does, with None in place of its value.
RawFuture done_of(const RawFuture& f);

template <class T = c10::IValue>
class Future {
 public:
  Future() = default;
  Future(RawFuture raw, std::shared_ptr<ThreadPool> pool)
      : raw_(std::move(raw)), pool_(std::move(pool)) {}

  // Blocks until complete; returns the value or rethrows the error.
  T wait() const {
    raw_->wait();
    return value();
  }
  // Like wait(), but throws TimeoutError once `timeout` has passed (0: no limit).
  T wait(std::chrono::milliseconds timeout) const {
    wait_raw_or_throw(raw_, timeout, "future");
    return value();
  }

  bool done() const { return raw_->completed(); }
  bool has_error() const { return raw_->completed() && raw_->hasError(); }
  bool valid() const { return raw_.defined(); }
  const RawFuture& raw() const { return raw_; }
  const std::shared_ptr<ThreadPool>& pool() const { return pool_; }

  template <class F>
  auto then(F fn) const -> typename detail::then_result<std::invoke_result_t<F, Future<T>>>::type {
    using R = std::invoke_result_t<F, Future<T>>;
    using Out = typename detail::then_result<R>::type;
    RawFuture child = make_raw_future();
    Future<T> self = *this;
    raw_->addCallback([self, child, scope = current_scope(),
                       fn = std::move(fn)](c10::ivalue::Future&) mutable {
      auto task = [self, child, scope, fn = std::move(fn)]() mutable {
        CallScope s = scope;
        std::shared_ptr<Agent> owner = self.pool_ ? self.pool_->owner() : nullptr;
        if (owner) {
          // A deadline belongs to the agent whose handler set it.
          if (s.agent != owner.get()) s.has_deadline = false;
          s.agent = owner.get();
        }
        ScopeGuard guard(s);
        try {
          if constexpr (std::is_void_v<R>) {
            fn(self);
            child->markCompleted(c10::IValue());
          } else if constexpr (is_future<R>::value) {
            R inner = fn(self);
            inner.raw()->addCallback([child](c10::ivalue::Future& f) { forward_raw(f, child); });
          } else {
            child->markCompleted(to_ivalue(fn(self)));
          }
        } catch (...) {
          child->setError(std::current_exception());
        }
      };
      if (self.pool_) {
        self.pool_->post(std::move(task));
      } else {
        task();
      }
    });
    return Out(child, pool_);
  }

 private:
  T value() const {
    if (raw_->hasError()) std::rethrow_exception(raw_->exception_ptr());
    if constexpr (std::is_void_v<T>) {
      return;
    } else {
      return from_ivalue<T>(raw_->constValue(), "result");
    }
  }

  RawFuture raw_;
  std::shared_ptr<ThreadPool> pool_;
};

// The writing end of a Future, for a value that comes later: a handler can
// return promise.future() and another handler (or any thread) completes it.
//
//   rpc::Promise<int64_t> ready;
//   reg->def("wait_ready", [&] { return ready.future(); });   // answers once set
//   reg->def("set_ready", [&](int64_t v) { ready.set_value(v); });
//
// A promise completes once: a second set_value or set_error throws
// std::logic_error. Its future's then() callbacks run on the thread that
// completes it.
template <class T = c10::IValue>
class Promise {
 public:
  Promise() : raw_(make_raw_future()) {}

  Future<T> future() const { return Future<T>(raw_, nullptr); }
  bool done() const { return raw_->completed(); }

  template <class U = T, class = std::enable_if_t<!std::is_void_v<U>>>
  void set_value(U value) {
    complete([&] { raw_->markCompleted(to_ivalue(std::move(value))); });
  }
  template <class U = T, class = std::enable_if_t<std::is_void_v<U>>>
  void set_value() {
    complete([&] { raw_->markCompleted(c10::IValue()); });
  }
  void set_error(std::exception_ptr error) {
    complete([&] { raw_->setError(std::move(error)); });
  }

 private:
  template <class F>
  void complete(F set) {
    std::lock_guard<std::mutex> lock(*mu_);
    if (raw_->completed()) throw std::logic_error("this promise was completed already");
    set();
  }
  RawFuture raw_;
  std::shared_ptr<std::mutex> mu_ = std::make_shared<std::mutex>();
};

// Completes once every future in `all` has: with their values in order, or
// with the first error (in order) among them. An empty list completes at once.
template <class T>
auto when_all(const std::vector<Future<T>>& all)
    -> Future<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>> {
  using Out = std::conditional_t<std::is_void_v<T>, void, std::vector<T>>;
  std::vector<RawFuture> raw;
  raw.reserve(all.size());
  for (const auto& f : all) raw.push_back(f.raw());
  return Future<Out>(when_all_raw(raw), all.empty() ? nullptr : all.front().pool());
}

// Completes as the first future in `any` does (with its value or error).
// Throws std::invalid_argument for an empty list.
template <class T>
Future<T> when_any(const std::vector<Future<T>>& any) {
  std::vector<RawFuture> raw;
  raw.reserve(any.size());
  for (const auto& f : any) raw.push_back(f.raw());
  return Future<T>(when_any_raw(raw), any.empty() ? nullptr : any.front().pool());
}

}  // namespace tandem::rpc
