// Limits: what an agent accepts from its peers and how much it holds for
// them. Every length read from the wire is checked against these before it
// is used (docs/security.md lists the checks); AgentOptions::limits sets
// them per agent.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace tandem::rpc {

struct Limits {
  uint64_t max_envelope_bytes = 64ull << 20;
  uint64_t max_body_bytes = 16ull << 30;
  // Cap'n Proto reader limits: how deep a value tree may nest, and how many
  // words one envelope may make the reader visit.
  int nesting_limit = 64;
  uint64_t traversal_limit_words = 16ull << 20;
  // The handshake's frames come first: before they have been checked,
  // nothing larger is read and nothing is allocated for tensors.
  uint64_t max_handshake_bytes = 4096;
  // A connection whose handshake frames have not all come by then is closed;
  // at most this many accepted connections may be in their handshake at once.
  std::chrono::milliseconds handshake_timeout{5000};
  size_t max_handshaking_connections = 64;
  // Liveness (rpc/transport/uv/uv_transport.h, 10.): a connection from which
  // nothing at all has come for this long is closed as stalled, its peer's
  // process stopped, frozen or swapped out. A busy peer is not silent: its
  // loop thread, which runs no user code, writes a heartbeat on every
  // connection it has written nothing to for peer_timeout / 10 (at most 1 s
  // apart). 0: never. AgentOptions::peer_timeout sets it for an agent.
  std::chrono::milliseconds peer_timeout{30000};
  // Backpressure (rpc/transport/uv/uv_transport.h): past this many bytes of
  // answers to one peer waiting unwritten, what the peer sends is held;
  // past max_held_bytes held, its connection is not read until they drain.
  uint64_t max_queued_reply_bytes = 32ull << 20;
  uint64_t max_held_bytes = 32ull << 20;
  // Likewise past this many of a peer's requests handed on and not yet
  // answered (a flood of calls to a slow function would otherwise queue
  // without bound in the pool). Held messages include answers to our own
  // calls, so a bound this far above any real fan-out keeps handlers that
  // wait on the same peer from waiting on what is held.
  uint64_t max_unanswered_requests = 65536;
  // Shared memory (rpc/transport/shm/segments.h): tensors of at least this
  // many bytes travel through a segment instead of the socket; each side of
  // a connection maps at most max_shared_bytes in at most
  // max_shared_segments segments (0 bytes: never use segments).
  uint64_t min_shared_tensor_bytes = 32ull << 10;
  uint64_t max_shared_bytes = 1ull << 30;
  uint32_t max_shared_segments = 32;
  // Each direction of a same-host connection carries its frames (all but
  // the tensors in segments) through a ring of this many bytes, a power of
  // two (rpc/transport/shm/ring.h); 0: through the socket. A peer's ring
  // may be at most max_ring_bytes.
  uint64_t shm_ring_bytes = 512ull << 10;
  uint64_t max_ring_bytes = 64ull << 20;
  // Threads that spin waiting (an rpc_sync caller, an idle pool thread)
  // read their connection themselves (rpc/transport.h, 8.): a same-host
  // ring, or a TCP socket's small frames. TANDEM_POLL_WHILE_SPINNING=0
  // turns it off for every agent.
  bool poll_while_spinning = true;
  // And when their spin runs out, they sleep on that connection, where the
  // peer's next write wakes them directly (rpc/transport.h, 10.), instead
  // of behind the loop thread. Needs poll_while_spinning;
  // TANDEM_SLEEP_ON_CONNECTION=0 turns it off for every agent.
  bool sleep_on_connection = true;
};

}  // namespace tandem::rpc
