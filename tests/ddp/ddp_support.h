// Several ranks of a process group in one test process, one thread each.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "tandem/ddp/process_group.h"
#include "test_util.h"

namespace tandem::test {

// Runs fn(rank) for every rank at once, each on its own thread; rethrows the
// first failure after all have ended.
inline void on_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
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

// n gloo groups meeting at a store of their own (ephemeral port).
struct Groups {
  explicit Groups(int n, std::chrono::milliseconds timeout = std::chrono::seconds(20),
                  const std::string& backend = "gloo")
      : store(support::store_server()), groups(n) {
    on_ranks(n, [&](int r) {
      ddp::ProcessGroupOptions o;
      o.backend = backend;
      o.rank = r;
      o.world_size = n;
      o.timeout = timeout;
      o.store = support::store_client(store->getPort());
      groups[r] = ddp::ProcessGroup::create(o);
    });
  }
  // All at once: closing a group waits for its peers to close it too.
  ~Groups() {
    on_ranks(size(), [&](int r) { groups[r].reset(); });
  }
  Groups(const Groups&) = delete;
  Groups& operator=(const Groups&) = delete;
  ddp::ProcessGroup& operator[](int r) { return *groups[r]; }
  int size() const { return static_cast<int>(groups.size()); }

  c10::intrusive_ptr<c10d::TCPStore> store;
  std::vector<std::shared_ptr<ddp::ProcessGroup>> groups;
};

}  // namespace tandem::test
