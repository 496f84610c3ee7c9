// A fixed pool of threads that run user code for an agent: request handlers
// and future callbacks. The transport's loop thread never runs user code; it
// posts here.
//
// A thread that finishes a task spins for `spin` before it sleeps, so a task
// posted soon after (the next message of a conversation) starts without a
// wake-up, which costs more than a loopback round trip on an idle core.
// Then one of them at a time sleeps on the same-host connection it last
// served (rpc/transport.h, 10.), so that the next request there wakes it
// directly; post() wakes it like any sleeping thread.
//
// Lifetime: stop() runs what was already queued, then joins every thread.
// A task posted after stop() runs inline on the posting thread, so a callback
// attached to a future after its agent shut down still runs exactly once.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::rpc {

class Agent;

class ThreadPool {
 public:
  // `owner`: the agent whose handlers and callbacks this pool runs (the
  // agent a Future::then callback acts for; see rpc/scope.h).
  explicit ThreadPool(int threads, std::chrono::microseconds spin = {},
                      std::weak_ptr<Agent> owner = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void post(std::function<void()> task);
  // Idempotent. Must not be called from one of the pool's own threads.
  void stop();
  bool in_pool() const;
  // Tasks waiting for a thread.
  size_t queued() const { return queued_.load(std::memory_order_relaxed); }
  std::shared_ptr<Agent> owner() const { return owner_.lock(); }

 private:
  void run();
  // After a spin with nothing to do: sleeps on a connection (above); true
  // when there is a task after all.
  bool sleep_on_connection();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<size_t> queued_{0};  // tasks_.size(), readable without mu_
  int spinning_ = 0;               // threads spinning for a task, asleep on a connection too (under mu_)
  int waiting_ = 0;                // threads asleep on cv_ (under mu_)
  std::function<void()> bell_;     // wakes the thread asleep on a connection (under mu_)
  std::thread::id bell_thread_;    // which thread that is (under mu_, while bell_ is set)
  const std::chrono::microseconds spin_;
  const std::weak_ptr<Agent> owner_;
  bool stopping_ = false;
  bool stopped_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace tandem::rpc
