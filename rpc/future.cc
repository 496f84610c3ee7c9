#include "tandem/rpc/future.h"

#include <atomic>
#include <condition_variable>
#include <mutex>

#include "tandem/rpc/errors.h"

namespace tandem::rpc {

bool wait_raw(const RawFuture& f, std::chrono::milliseconds timeout) {
  if (f->completed()) return true;
  if (timeout.count() <= 0) {
    f->wait();
    return true;
  }
  // c10's future has no timed wait: a callback wakes this thread instead.
  struct Waiter {
    std::mutex mu;
    std::condition_variable cv;
  };
  auto w = std::make_shared<Waiter>();
  f->addCallback([w](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(w->mu);
    w->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(w->mu);
  return w->cv.wait_for(lock, timeout, [&] { return f->completed(); });
}

void wait_raw_or_throw(const RawFuture& f, std::chrono::milliseconds timeout,
                       const std::string& what) {
  if (!wait_raw(f, timeout)) {
    throw TimeoutError(what + " did not complete within " + std::to_string(timeout.count()) +
                       " ms");
  }
  if (f->hasError()) std::rethrow_exception(f->exception_ptr());
}

RawFuture when_all_raw(const std::vector<RawFuture>& all) {
  auto out = make_raw_future();
  if (all.empty()) {
    out->markCompleted(c10::impl::GenericList(c10::AnyType::get()));
    return out;
  }
  auto left = std::make_shared<std::atomic<size_t>>(all.size());
  auto futures = std::make_shared<std::vector<RawFuture>>(all);
  for (const auto& f : all) {
    f->addCallback([left, futures, out](c10::ivalue::Future&) {
      if (left->fetch_sub(1) != 1) return;
      c10::impl::GenericList values(c10::AnyType::get());
      values.reserve(futures->size());
      for (const auto& g : *futures) {
        if (g->hasError()) {
          out->setError(g->exception_ptr());
          return;
        }
        values.push_back(g->constValue());
      }
      out->markCompleted(std::move(values));
    });
  }
  return out;
}

RawFuture when_any_raw(const std::vector<RawFuture>& any) {
  if (any.empty()) throw std::invalid_argument("when_any needs at least one future");
  auto out = make_raw_future();
  auto first = std::make_shared<std::atomic<bool>>(false);
  for (const auto& f : any) {
    f->addCallback([first, out](c10::ivalue::Future& g) {
      if (first->exchange(true)) return;
      if (g.hasError()) {
        out->setError(g.exception_ptr());
      } else {
        out->markCompleted(g.constValue());
      }
    });
  }
  return out;
}

void forward_raw(c10::ivalue::Future& from, const RawFuture& out) {
  if (from.hasError()) {
    out->setErrorIfNeeded(from.exception_ptr());
  } else if (!out->completed()) {
    out->markCompleted(from.constValue());
  }
}

RawFuture error_of(const RawFuture& f) {
  auto out = make_raw_future();
  f->addCallback([out](c10::ivalue::Future& g) {
    if (g.hasError()) out->setError(g.exception_ptr());
  });
  return out;
}

RawFuture done_of(const RawFuture& f) {
  auto out = make_raw_future();
  f->addCallback([out](c10::ivalue::Future& g) {
    if (g.hasError()) {
      out->setError(g.exception_ptr());
    } else {
      out->markCompleted(c10::IValue());
    }
  });
  return out;
}

}  // namespace tandem::rpc
