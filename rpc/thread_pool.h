// A fixed pool of threads that run user code for an agent: request handlers
// and future callbacks. The transport's loop thread never runs user code; it
// posts here.
//
// Lifetime: stop() runs what was already queued, then joins every thread.
// A task posted after stop() runs inline on the posting thread, so a callback
// attached to a future after its agent shut down still runs exactly once.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::rpc {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void post(std::function<void()> task);
  // Idempotent. Must not be called from one of the pool's own threads.
  void stop();
  bool in_pool() const;

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  bool stopped_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace tandem::rpc
