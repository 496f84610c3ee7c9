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
//  4. One connection per pair of workers carries their calls. A worker that
//     has not dialed a peer calls it on the connection the peer dialed. When
//     both dial at once, both call on the one the lower rank dialed: the
//     lower prefers its own dial, the higher takes the lower's over when it
//     accepts it. add() and add_accepted() return the connection that lost
//     (the higher's dial), and each side retires it: it writes a notice
//     that it sends no more requests there (a request that still tries is
//     sent again on the current connection), and once each side has the
//     other's notice, has its own calls on it answered and owes no answer
//     on it, it closes it (Agent::retire; transport.h, 6.). Nothing in
//     flight is lost, and a crossed pair ends with one socket.
#pragma once

#include <atomic>
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
  // kept. It is added (as its gate, rpc/agent/handshake.h) before its handshake
  // is written, so that nothing that comes back on it is unknown; the gate
  // keeps calls from overtaking the handshake. Connections are matched by
  // id(): a gate stands for the transport's connection it wraps.
  // With `prefer` (this agent is the lower rank), it replaces an accepted
  // connection in use.
  // Returns the connection that is not to(rank) because of this call (the
  // one replaced, or `conn` when it was not taken), or null.
  ConnectionPtr add(const ConnectionPtr& conn, int rank, bool use = true, bool prefer = false);
  // An accepted connection from `rank` has passed its handshake. With
  // `take_over` (the peer is the lower rank), it becomes to(rank) even when
  // one this agent dialed is in use (4.).
  // Returns what lost, as add() does.
  ConnectionPtr add_accepted(const ConnectionPtr& conn, int rank, bool take_over);
  // How often add_accepted took over from this agent's own dial.
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
  std::vector<ConnectionPtr> peers_;                // by rank
  std::unordered_map<uint64_t, int> rank_of_conn_;  // by connection id
  std::vector<std::unique_ptr<std::mutex>> connect_mu_;
  std::unordered_set<uint64_t> dialed_;  // ids of the ones add() took
  std::atomic<uint64_t> crossings_{0};
};

}  // namespace tandem::rpc
