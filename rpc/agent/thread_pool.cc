#include "tandem/rpc/thread_pool.h"

#include "tandem/rpc/agent/spin.h"
#include "tandem/rpc/stages.h"
#include "tandem/rpc/transport.h"

#include <cstdio>
#include <stdexcept>

namespace tandem::rpc {
namespace {
thread_local const ThreadPool* tls_pool = nullptr;
// One sleep on a connection at most (rpc/transport.h, 10.). post() and
// stop() ring the bell; the bound is only a backstop.
constexpr std::chrono::microseconds kConnectionSleepSlice{1000000};
}

ThreadPool::ThreadPool(int threads, std::chrono::microseconds spin, std::weak_ptr<Agent> owner)
    : spin_(spin), owner_(std::move(owner)) {
  if (threads < 1) throw std::invalid_argument("ThreadPool needs at least one thread");
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::post(std::function<void()> task) {
  TANDEM_STAGE(kPoolPosted);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      tasks_.push_back(std::move(task));
      queued_.store(tasks_.size(), std::memory_order_release);
      // A spinning thread takes it without a wake-up; wake one only for the
      // rest: one asleep on cv_, or else the one asleep on a connection
      // (which is awake when it posts, having read a request itself).
      const bool bell_here = bell_ && bell_thread_ == std::this_thread::get_id();
      const int awake = spinning_ - (bell_ && !bell_here ? 1 : 0);
      if (tasks_.size() > static_cast<size_t>(awake)) {
        if (waiting_ > 0 || !bell_ || bell_here) {
          cv_.notify_one();
        } else {
          bell_();
        }
      }
      return;
    }
  }
  task();
}

bool ThreadPool::sleep_on_connection() {
  // (mu_ not held.) One thread of the pool at a time sleeps on the
  // connection it last served (rpc/transport.h, 10.): the next request on
  // it wakes that thread, which reads it and runs it, where otherwise the
  // loop thread would wake and then wake a pool thread.
  ConnectionSleep sleep;
  if (!sleep.ok()) return false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (bell_ || stopping_ || !tasks_.empty()) return !tasks_.empty();
    bell_ = sleep.waker();
    bell_thread_ = std::this_thread::get_id();
  }
  const auto work = [this] { return queued_.load(std::memory_order_acquire) != 0; };
  bool stop = false;
  while (!work() && sleep.wait(kConnectionSleepSlice, work)) {
    std::lock_guard<std::mutex> lock(mu_);
    if ((stop = stopping_)) break;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    bell_ = nullptr;
  }
  // The connection's messages went to the loop thread (one it must deliver,
  // such as a request carrying RRefs): the task it posts comes soon, and
  // spinning for it saves a wake-up.
  if (!stop && !work()) spin_until(spin_, work);
  return work();
}

bool ThreadPool::in_pool() const { return tls_pool == this; }

void ThreadPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopping_ = true;
    stopped_ = true;
    cv_.notify_all();
    if (bell_) bell_();
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void ThreadPool::run() {
  tls_pool = this;
  std::unique_lock<std::mutex> lock(mu_);
  bool just_worked = false;
  for (;;) {
    if (just_worked && spin_.count() > 0 && tasks_.empty() && !stopping_) {
      ++spinning_;
      lock.unlock();
      // An idle thread reads the connection it last served itself
      // (rpc/transport.h, 8.): the next request needs no loop wake-up.
      {
        PollingSpin polling;
        if (!spin_until(spin_, [this] {
              poll_this_threads_connection();
              return queued_.load(std::memory_order_acquire) != 0;
            })) {
          sleep_on_connection();
        }
      }
      lock.lock();
      --spinning_;
    }
    ++waiting_;
    cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
    --waiting_;
    if (tasks_.empty()) return;  // stopping and drained
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    queued_.store(tasks_.size(), std::memory_order_release);
    just_worked = true;
    lock.unlock();
    TANDEM_STAGE(kPoolTaken);
    try {
      task();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tandem: uncaught exception in a pool task: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "tandem: uncaught exception in a pool task\n");
    }
    task = nullptr;
    lock.lock();
  }
}

}  // namespace tandem::rpc
