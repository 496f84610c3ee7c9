// Shared set-up for Tandem's test suites. LibTorch comes first: glog's CHECK
// (pulled in by LibTorch) would otherwise replace doctest's.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/local_job.h"
#include "tandem/rpc/agent.h"
#include "tandem/rpc/testing.h"

namespace tandem::test {

// Waits until `cond` holds, at most `limit`; returns whether it held. For
// things that happen asynchronously (reference counting, a peer's clean-up,
// a thread's exit): wait for the thing, never a fixed time.
inline bool eventually(const std::function<bool()>& cond,
                       std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  auto until = std::chrono::steady_clock::now() + limit;
  while (!cond()) {
    if (std::chrono::steady_clock::now() >= until) return cond();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// Threads and open file descriptors of this process: what a test must give back.
inline int count_dir(const char* path) {
  int n = 0;
  if (DIR* d = opendir(path)) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}
inline int thread_count() { return count_dir("/proc/self/task"); }
inline int fd_count() { return count_dir("/proc/self/fd"); }
inline std::string fd_list() {
  std::string out;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      char target[512] = {};
      std::string path = std::string("/proc/self/fd/") + e->d_name;
      if (readlink(path.c_str(), target, sizeof(target) - 1) > 0) {
        out += std::string(e->d_name) + "->" + target + " ";
      }
    }
    closedir(d);
  }
  return out;
}

// Records threads and fds at construction; a test asserts nothing leaked with
// check() once everything it made is gone. Threads die asynchronously after
// join returns only in the kernel's bookkeeping, so allow a short settle.
class LeakCheck {
 public:
  LeakCheck() : threads_(thread_count()), fds_(fd_count()) {}
  void check() const {
    eventually([&] { return thread_count() == threads_ && fd_count() == fds_; },
               std::chrono::seconds(1));
    CHECK(thread_count() == threads_);
    INFO("open fds: " << fd_list());
    CHECK(fd_count() == fds_);
  }

 private:
  int threads_;
  int fds_;
};

// N agents in this process, meeting at a TCPStore on an ephemeral port.
struct World {
  explicit World(int n, std::function<void(rpc::Registry&)> define = {},
                 std::function<void(rpc::AgentOptions&)> tweak = {})
      : store(support::store_server()), port(store->getPort()) {
    registry = std::make_shared<rpc::Registry>();
    if (define) define(*registry);
    agents.resize(n);
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(n);
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
          rpc::AgentOptions o;
          o.rank = r;
          o.world_size = n;
          o.num_worker_threads = 2;
          o.rpc_timeout = std::chrono::seconds(20);
          o.init_timeout = std::chrono::seconds(30);
          if (tweak) tweak(o);
          agents[r] = rpc::Agent::create(o, registry, support::store_client(port));
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }

  // Every agent shuts down at once (graceful waits for the others).
  // Rethrows the first error any of them raised.
  void shutdown(bool graceful = true) {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(agents.size());
    for (size_t i = 0; i < agents.size(); ++i) {
      if (agents[i]) {
        threads.emplace_back([this, i, graceful, &errors] {
          try {
            agents[i]->shutdown(graceful);
          } catch (...) {
            errors[i] = std::current_exception();
          }
        });
      }
    }
    for (auto& t : threads) t.join();
    agents.clear();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }

  ~World() {
    if (!agents.empty()) shutdown(false);
  }

  rpc::Agent& operator[](int r) { return *agents[r]; }

  c10::intrusive_ptr<c10d::TCPStore> store;  // the rendezvous, hosted here
  int port = 0;
  std::shared_ptr<rpc::Registry> registry;
  std::vector<std::shared_ptr<rpc::Agent>> agents;
};

// ---- a worker process ------------------------------------------------------------

// This test binary started again as worker 1 of 2 in `mode`
// ("TANDEM_TEST_WORKER=mode" makes it a worker: see main.cc), meeting the
// test (worker 0) at `store`. The destructor kills and reaps it if the test
// did not wait for it.
struct ChildWorker {
  explicit ChildWorker(const std::string& mode)
      : store(support::store_server()),
        pid(support::spawn_self([&] {
          auto env = support::worker_env(1, 2, store->getPort());
          env.push_back("TANDEM_TEST_WORKER=" + mode);
          return env;
        }())) {}
  ChildWorker(const ChildWorker&) = delete;
  ChildWorker& operator=(const ChildWorker&) = delete;
  ~ChildWorker() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      wait();
    }
  }
  // Waits for the worker to end; returns its waitpid status.
  int wait() {
    int status = support::wait_exit(pid);
    pid = -1;
    return status;
  }

  c10::intrusive_ptr<c10d::TCPStore> store;
  pid_t pid = -1;
};

}  // namespace tandem::test
