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
#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tandem/rpc/agent.h"
#include "tandem/rpc/testing.h"

namespace tandem::test {

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
    for (int i = 0; i < 100 && (thread_count() != threads_ || fd_count() != fds_); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
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
                 std::function<void(rpc::AgentOptions&)> tweak = {}) {
    c10d::TCPStoreOptions so;
    so.port = 0;
    so.isServer = true;
    so.numWorkers = n;
    so.waitWorkers = false;
    so.timeout = std::chrono::seconds(30);
    server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    port = server->getPort();
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
          agents[r] = rpc::Agent::create(o, registry, client_store());
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

  c10::intrusive_ptr<c10d::Store> client_store() const {
    c10d::TCPStoreOptions so;
    so.port = port;
    so.isServer = false;
    so.timeout = std::chrono::seconds(30);
    return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
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

  c10::intrusive_ptr<c10d::TCPStore> server;
  int port = 0;
  std::shared_ptr<rpc::Registry> registry;
  std::vector<std::shared_ptr<rpc::Agent>> agents;
};

// Path of this test binary (for tests that start worker processes).
std::string self_exe();
// Starts this binary again with the environment plus `env_extra`
// ("TANDEM_TEST_WORKER=mode" makes it a worker: see main.cc).
pid_t spawn_worker(const std::vector<std::string>& env_extra);

// A store on an ephemeral port, and this binary started again as worker 1
// of 2 in `mode`, meeting there; the test is worker 0.
struct ChildWorker {
  c10::intrusive_ptr<c10d::TCPStore> store;
  pid_t pid = -1;
};
inline ChildWorker start_child_worker(const std::string& mode) {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.timeout = std::chrono::seconds(30);
  ChildWorker w;
  w.store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  w.pid = spawn_worker({"TANDEM_TEST_WORKER=" + mode, "RANK=1", "WORLD_SIZE=2",
                        "MASTER_ADDR=127.0.0.1",
                        "MASTER_PORT=" + std::to_string(w.store->getPort())});
  return w;
}

}  // namespace tandem::test
