// The transport moves whole Messages between processes; the agent above it
// decides what they mean.
//
// Contract:
//  1. listen() binds and starts accepting; connect() opens an outgoing
//     connection (blocking the caller at most `timeout`) and returns at once
//     usable for send().
//  2. send() may be called from any thread. It encodes nothing: it writes an
//     already encoded OutFrame, whose tensors it keeps alive until written.
//     Frames on one connection are written in the order send() was called.
//  3. Received messages and closed connections are reported through
//     Callbacks on the transport's own thread, which runs no user code: the
//     callbacks must be short and hand user work to a pool.
//  4. Connection::close() and Transport::close() are terminal and idempotent;
//     a connection is reported closed exactly once, and after that send()
//     throws DisconnectedError.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "tandem/rpc/wire.h"

namespace tandem::rpc {

class Connection {
 public:
  virtual ~Connection() = default;
  virtual void send(OutFrame&& frame) = 0;
  virtual void close(const std::string& reason) = 0;
  virtual uint64_t id() const = 0;
  virtual std::string peer_address() const = 0;
  // True once the connection is closed or closing: send() would throw.
  virtual bool closed() = 0;

  // The rank at the other end: set by the agent before it sends on an
  // outgoing connection, or once the peer's handshake is accepted.
  std::atomic<int> peer_rank{-1};
};

using ConnectionPtr = std::shared_ptr<Connection>;

class Transport {
 public:
  struct Callbacks {
    // Called on the transport thread for every complete message.
    std::function<void(const ConnectionPtr&, Message&&)> on_message;
    // Called on the transport thread once per connection, after it closed.
    // `reason` is empty for an orderly close by this side.
    std::function<void(const ConnectionPtr&, const std::string& reason)> on_closed;
  };

  virtual ~Transport() = default;
  // Returns the bound port (useful with port 0).
  virtual int listen(const std::string& host, int port) = 0;
  // `peer_rank` is stored on the connection before the loop can see it.
  virtual ConnectionPtr connect(const std::string& host, int port,
                                std::chrono::milliseconds timeout, int peer_rank = -1) = 0;
  virtual void close() = 0;
};

}  // namespace tandem::rpc
