// The replicas' liveness, as one replica sees it (internal to ft/).
//
// Every replica's Manager runs one thread that, each interval, adds 1 to
// its counter at the store (hb/<id>) and reads every other replica's. A
// replica whose counter has not moved for the timeout is gone; so, at once,
// is one on this host whose process has exited (who/<id> names its host,
// pid and the process's start time, published when it starts). The thread
// also reads the newest quorum's number, so that a replica held up in an
// old quorum (it was stopped) learns that the others moved on.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tandem::ft {

class Heartbeat {
 public:
  using Clock = std::chrono::steady_clock;
  // Publishes who this replica is and starts the thread. `store` is the
  // thread's own client, under the job's prefix.
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int id, int max_replicas,
            std::chrono::milliseconds interval, std::chrono::milliseconds timeout);
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // Whether replica `id` is alive now: its heartbeat seen, and fresh (this
  // one always is).
  bool alive(int id) const;
  // Why replica `id` is gone: "replica 2 is gone (its process exited)",
  // "replica 2 sent no heartbeat for 2100 ms"; "" when it is not (or has
  // not been seen yet: no verdict).
  std::string why_gone(int id) const;
  // The newest quorum number the store has (the "epoch" key), as last read.
  int64_t newest_epoch() const { return epoch_.load(); }
  // "<pid> <start> <host>": this process, as join records carry it.
  std::string me() const;
  // Replica `id` is alive now as this process (it joined a quorum).
  void saw(int id, const std::string& host, int64_t pid, const std::string& start);
  // The store stopped answering (its host is gone): the text, else "".
  std::string store_error() const;

 private:
  struct Peer {
    int64_t count = -1;           // the counter as last read; -1: never
    Clock::time_point changed{};  // when it last moved
    std::string host;
    int64_t pid = 0;
    std::string start;  // the process's start time, from /proc
    bool exited = false;
  };
  void run();
  void tick();
  void read_who(int id, Peer& peer);

  c10::intrusive_ptr<c10d::Store> store_;
  int id_;
  int max_;
  std::chrono::milliseconds interval_, timeout_;
  std::string my_host_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<Peer> peers_;
  std::string store_error_;
  std::atomic<int64_t> epoch_{0};
  // When this replica last looked (a stopped process's view is stale: it
  // judges nobody until it has looked again).
  Clock::time_point looked_{};
  std::thread thread_;
};

}  // namespace tandem::ft
