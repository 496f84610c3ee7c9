// ConnectionTable: who is at the other end of each of an agent's
// connections, and the one connection the agent uses to reach each peer.
//
//  1. A connection's rank is known from the start for one this agent opened
//     (set before its first frame is written) and from the peer's accepted
//     handshake for one it accepted. Until then rank_of() says -1.
//  2. to(rank) is the connection calls to that peer go on: the first open
//     one registered for it (opened by either side). A closed one is
//     forgotten (forget(), from the transport's on_closed), and the next
//     call opens a new one; connect_mutex(rank) makes that one connect at a
//     time per peer.
//  3. Transports keep no ranks (rpc/transport.h): this table is the only
//     place that maps connections to workers.
//  4. One connection per pair of workers. A worker that has not dialed a
//     peer calls it on the connection the peer dialed. When both dial at
//     once, the lower rank keeps the one it dialed: the higher rank, on
//     accepting it, calls on it from then on and retires its own (closed by
//     the agent once the calls still on it have their answers).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tandem/rpc/transport.h"

namespace tandem::rpc {

class ConnectionTable {
 public:
  explicit ConnectionTable(int world_size);

  // The open connection calls to `rank` go on, or null.
  ConnectionPtr to(int rank);
  std::mutex& connect_mutex(int rank) { return *connect_mu_.at(rank); }
  // `conn`, dialed by this agent, reaches `rank`; with `use`, it becomes
  // to(rank) if that has none. A connection that closed meanwhile is not
  // kept. It is added (as its gate, rpc/handshake.h) before its handshake
  // is written, so that nothing that comes back on it is unknown; the gate
  // keeps calls from overtaking the handshake. Connections are matched by
  // id(): a gate stands for the transport's connection it wraps.
  void add(const ConnectionPtr& conn, int rank, bool use = true);
  // An accepted connection from `rank` has passed its handshake. With
  // `take_over`, it becomes to(rank) even when one this agent dialed is in
  // use, and that one is returned (to be retired, 4.); otherwise null.
  ConnectionPtr add_accepted(const ConnectionPtr& conn, int rank, bool take_over);
  // Retired connections (4.): remembered until the agent closes them.
  void retire(const ConnectionPtr& conn);
  // The retired connection with this id, taken out of the table, when
  // `idle` says it may close now; else null.
  ConnectionPtr take_retired_if(uint64_t id, const std::function<bool()>& idle);
  bool any_retired() const { return retired_count_.load(std::memory_order_relaxed) > 0; }
  uint64_t crossings() const { return crossings_.load(); }
  // -1 until the rank is known.
  int rank_of(const Connection& conn) const;
  // `conn` closed: forgets it; returns its rank (or -1).
  int forget(const Connection& conn);
  // Every connection to(rank) returns now (for shutdown and tests).
  std::vector<ConnectionPtr> current() const;
  void clear();

 private:
  mutable std::shared_mutex mu_;
  std::vector<ConnectionPtr> peers_;                 // by rank
  std::unordered_map<uint64_t, int> rank_of_conn_;   // by connection id
  std::vector<std::unique_ptr<std::mutex>> connect_mu_;
  std::unordered_set<uint64_t> dialed_;                  // ids of the ones add() took
  std::unordered_map<uint64_t, ConnectionPtr> retired_;  // by id, under mu_
  std::atomic<size_t> retired_count_{0};
  std::atomic<uint64_t> crossings_{0};
};

}  // namespace tandem::rpc
