#include "tandem/rpc/thread_pool.h"

#include "tandem/rpc/agent/spin.h"
#include "tandem/rpc/transport.h"

#include <cstdio>
#include <stdexcept>

namespace tandem::rpc {
namespace {
thread_local const ThreadPool* tls_pool = nullptr;
}

ThreadPool::ThreadPool(int threads, std::chrono::microseconds spin, std::weak_ptr<Agent> owner)
    : spin_(spin), owner_(std::move(owner)) {
  if (threads < 1) throw std::invalid_argument("ThreadPool needs at least one thread");
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      tasks_.push_back(std::move(task));
      queued_.store(tasks_.size(), std::memory_order_release);
      // A spinning thread takes it without a wake-up; wake one only for the rest.
      if (tasks_.size() > static_cast<size_t>(spinning_)) cv_.notify_one();
      return;
    }
  }
  task();
}

bool ThreadPool::in_pool() const { return tls_pool == this; }

void ThreadPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopping_ = true;
    stopped_ = true;
    cv_.notify_all();
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
        spin_until(spin_, [this] {
          poll_this_threads_connection();
          return queued_.load(std::memory_order_acquire) != 0;
        });
      }
      lock.lock();
      --spinning_;
    }
    cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopping and drained
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    queued_.store(tasks_.size(), std::memory_order_release);
    just_worked = true;
    lock.unlock();
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
