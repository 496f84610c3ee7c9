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

// HSDP's groups over 4 ranks (threads): shard groups {0, 1} and {2, 3},
// replicate groups {0, 2} and {1, 3}; rank r is r % 2 in its shard group
// and r / 2 in its replicate group.
struct HsdpGroups {
  HsdpGroups() : store(support::store_server()), shard(4), replicate(4) {
    auto make = [&](int rank, int size, const std::string& name) {
      ddp::ProcessGroupOptions o;
      o.rank = rank;
      o.world_size = size;
      o.timeout = std::chrono::seconds(20);
      o.store = support::store_client(store->getPort());
      o.group_name = name;
      return ddp::ProcessGroup::create(o);
    };
    on_ranks(4, [&](int r) {
      shard[r] = make(r % 2, 2, "shard" + std::to_string(r / 2));
      replicate[r] = make(r / 2, 2, "replicate" + std::to_string(r % 2));
    });
  }
  ~HsdpGroups() {
    on_ranks(4, [&](int r) {
      shard[r].reset();
      replicate[r].reset();
    });
  }
  HsdpGroups(const HsdpGroups&) = delete;
  HsdpGroups& operator=(const HsdpGroups&) = delete;

  c10::intrusive_ptr<c10d::TCPStore> store;
  std::vector<std::shared_ptr<ddp::ProcessGroup>> shard, replicate;
};

}  // namespace tandem::test
