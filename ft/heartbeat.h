// The replicas' liveness, as one replica sees it (internal to ft/).
//
// Every replica's Manager runs one thread that, each interval, adds 1 to
// its counter at the store (hb/<id>) and reads every other replica's. A
// replica whose counter has not moved for the timeout is gone; so, at once,
// is one on this host whose process has exited (who/<id> names its host,
// pid and the process's start time, published when it starts). The thread
// also reads the newest quorum's number, so that a replica held up in an
// old quorum (it was stopped) learns that the others moved on.
//
// Liveness is judged per process, not per id: a replacement started under a
// dead member's id must not make the member look alive. Each process starts
// its counter in an incarnation of its own (the counter's high 32 bits, one
// more than the previous process's), publishing who/<id> first; a reader
// that sees the incarnation change reads who/<id> again. A quorum's member
// is the process its join named (members()): once who/<id> names another,
// that member is gone.
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
  // `id` is this process's index among `max_replicas` (the processes of
  // all replicas, `per_replica` of them each: the texts name a process by
  // its replica and rank).
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int id, int max_replicas,
            std::chrono::milliseconds interval, std::chrono::milliseconds timeout,
            int per_replica = 1);
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
  // Whether replica `id` is alive now as the process (host, pid, start):
  // the newest process of that id is that one, and alive.
  bool alive_as(int id, const std::string& host, int64_t pid, const std::string& start) const;
  // Whether the process (host, pid, start) of replica `id` is gone for
  // good: another process has its id now, or it exited on this host (a
  // silent one may be stopped and come back: not gone for good).
  bool gone_for_good(int id, const std::string& host, int64_t pid, const std::string& start) const;
  // "<pid> <start> <host>": this process, as join records carry it.
  std::string me() const;
  // A process, as a quorum's record names it.
  struct Process {
    int id = -1;
    std::string host;
    int64_t pid = 0;
    std::string start;
  };
  // The quorum's members are these processes, alive now (they joined): from
  // now on, each is gone once its id is another process's, and the ids not
  // among them are judged by their newest process.
  void members(const std::vector<Process>& members);
  // The store stopped answering (its host is gone): the text, else "".
  std::string store_error() const;
  // Keys nobody reads any more (a finished vote's): deleted at the next
  // tick, off the step's path.
  void discard(std::vector<std::string> keys);

 private:
  struct Peer {
    int64_t count = -1;           // the counter as last read; -1: never
    Clock::time_point changed{};  // when it last moved
    // The id's newest process, as who/<id> gave it for incarnation `inc`
    // (-1: to be read at the next tick).
    int64_t inc = -1;
    std::string host;
    int64_t pid = 0;
    std::string start;  // the process's start time, from /proc
    bool exited = false;
    // The process the current quorum has as this id's member (pid 0: none).
    std::string member_host;
    int64_t member_pid = 0;
    std::string member_start;
  };
  // Why `id` is gone, judging its newest process, and with `as_member` also
  // whether that is still the process its quorum has as the member.
  std::string why_gone_locked(int id, bool as_member = true) const;
  void run();
  void tick();

  c10::intrusive_ptr<c10d::Store> store_;
  int id_;
  int max_;
  int per_replica_;
  std::chrono::milliseconds interval_, timeout_;
  std::string my_host_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<Peer> peers_;
  std::string store_error_;
  std::vector<std::string> discard_;
  std::atomic<int64_t> epoch_{0};
  // When this replica last looked (a stopped process's view is stale: it
  // judges nobody until it has looked again).
  Clock::time_point looked_{};
  std::thread thread_;
};

}  // namespace tandem::ft
