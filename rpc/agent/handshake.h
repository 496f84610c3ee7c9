// The agent's side of the connection handshake (the protocol is in
// rpc/common/auth.h): what each half-greeted connection is waiting for, and the
// gate that holds a dialed connection's calls until its peer has proved
// the cluster token.
//
//  1. connection_to() dials, registers the connection as Dialed, puts a
//     GatedConnection in the connection table at once and writes step 1 on
//     the raw connection. Calls made meanwhile (from any thread, the loop
//     thread included) queue in the gate: nothing waits for the answer.
//  2. The loop thread gets step 2, checks the acceptor's proof and opens
//     the gate: step 3 first, then every queued frame in order, then later
//     frames straight through. A wrong proof closes the connection instead,
//     and its calls fail with DisconnectedError naming why.
//  3. An accepted connection is registered as Accepted at step 1 and joins
//     the connection table only when step 3's proof holds.
//  4. The transport closes a connection whose handshake frames have not all
//     come within Limits::handshake_timeout; its entry goes with on_closed.
#pragma once

#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tandem/rpc/transport.h"

namespace tandem::rpc {

class GatedConnection final : public Connection {
 public:
  explicit GatedConnection(ConnectionPtr inner) : inner_(std::move(inner)) {}

  void send(OutFrame&& frame) override;
  void close(const std::string& reason) override { inner_->close(reason); }
  uint64_t id() const override { return inner_->id(); }
  const char* kind() const override { return inner_->kind(); }
  // Before the gate opens, `last` waits behind the held frames.
  void retire(OutFrame&& last) override;
  int64_t answers_owed() const override { return inner_->answers_owed(); }
  void close_when_flushed() override { inner_->close_when_flushed(); }
  std::string peer_address() const override { return inner_->peer_address(); }
  bool closed() override { return inner_->closed(); }
  // The transport's own rule keeps a poll off the connection until its
  // handshake is read (rpc/transport.h, 8.).
  bool poll_inline() override { return inner_->poll_inline(); }
  bool stalled() const override { return inner_->stalled(); }

  // Writes `first`, then every held frame, and lets later frames through.
  // A connection that broke meanwhile drops them (its on_closed fails the
  // calls they belonged to).
  void open(OutFrame&& first);
  // The handshake failed: held frames are dropped, and send() throws
  // DisconnectedError saying `why` (the connection is being closed).
  void refuse(const std::string& why);

 private:
  ConnectionPtr inner_;
  std::atomic<bool> open_{false};
  std::mutex mu_;
  std::vector<OutFrame> held_;
  std::string refused_;                  // why the handshake failed; empty while it has not
  std::optional<OutFrame> held_retire_;  // a retire() waiting for the gate to open
};

struct HandshakeTable {
  struct Dialed {
    int rank = -1;
    std::string nonce;
    std::shared_ptr<GatedConnection> gate;
  };
  struct Accepted {
    int rank = -1;
    std::string dialer_nonce;
    std::string nonce;
  };
  std::mutex mu;
  std::unordered_map<uint64_t, Dialed> dialed;      // by connection id
  std::unordered_map<uint64_t, Accepted> accepted;  // by connection id
};

}  // namespace tandem::rpc
