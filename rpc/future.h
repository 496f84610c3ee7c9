// Future<T>: the typed result of an asynchronous call, a thin wrapper over
// LibTorch's c10::ivalue::Future.
//
// Promises:
//  1. A future completes exactly once: with a value, or with an error
//     (RemoteError, TimeoutError, DisconnectedError, ...). wait() returns the
//     value converted to T, or rethrows the error with its type intact.
//  2. then(fn) runs fn(Future<T>) on the agent's thread pool once this future
//     completes, never inline in the call to then(), and returns a future of
//     what fn returns; if fn throws, that future carries the exception. If fn
//     returns a Future<U>, the result is a Future<U> that completes with it.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <type_traits>

#include "rpc/convert.h"
#include "rpc/thread_pool.h"

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

template <class T = c10::IValue>
class Future {
 public:
  Future() = default;
  Future(RawFuture raw, std::shared_ptr<ThreadPool> pool)
      : raw_(std::move(raw)), pool_(std::move(pool)) {}

  // Blocks until complete; returns the value or rethrows the error.
  T wait() const {
    raw_->wait();
    if (raw_->hasError()) std::rethrow_exception(raw_->exception_ptr());
    if constexpr (std::is_void_v<T>) {
      return;
    } else {
      return from_ivalue<T>(raw_->constValue(), "result");
    }
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
    raw_->addCallback([self, child, fn = std::move(fn)](c10::ivalue::Future&) mutable {
      auto task = [self, child, fn = std::move(fn)]() mutable {
        try {
          if constexpr (std::is_void_v<R>) {
            fn(self);
            child->markCompleted(c10::IValue());
          } else if constexpr (is_future<R>::value) {
            R inner = fn(self);
            inner.raw()->addCallback([child](c10::ivalue::Future& f) {
              if (f.hasError()) {
                child->setError(f.exception_ptr());
              } else {
                child->markCompleted(f.constValue());
              }
            });
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
  RawFuture raw_;
  std::shared_ptr<ThreadPool> pool_;
};

}  // namespace tandem::rpc
