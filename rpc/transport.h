// The transport moves whole frames between processes; the agent above it
// decides what they mean. Backends live under rpc/transport/<name>/ (today:
// uv, TCP on a libuv loop; shm, same-host connections whose large tensors
// go through shared memory, on the same loop; faulty, a fault-injecting
// decorator for tests), and the agent takes whichever AgentOptions makes.
//
// Contract (tests/rpc/transport_test.cc checks it against every backend):
//  1. listen() binds and starts accepting; connect() opens an outgoing
//     connection (blocking the caller at most `timeout`) and returns it at
//     once usable for send().
//  2. send() may be called from any thread. It encodes nothing: it writes an
//     already encoded OutFrame, whose tensors it keeps alive until written.
//     Frames on one connection are written in the order send() was called.
//  3. Received messages and closed connections are reported through
//     Callbacks on the transport's own thread, which runs no user code: the
//     callbacks must be short and hand user work to a pool. A callback never
//     runs inline inside send(), close() or connect().
//  4. Connection::close() and Transport::close() are terminal and idempotent;
//     a connection is reported closed exactly once (also when the peer
//     closed it or vanished), and after that send() throws DisconnectedError.
//     Transport::close() closes every connection (each reported closed) and
//     returns once no callback runs any more.
//  5. A connection knows nothing of ranks or workers: the agent keeps its
//     own table of who is at the other end.
//  6. Retiring (how the agent closes the second connection of a pair whose
//     workers dialed each other at once, without losing what is in flight
//     on it): retire(last) writes `last`, after which send() of a request
//     frame throws RetiredError and leaves the frame to the caller (answers
//     still go through); answers_owed() counts the requests received on the
//     connection that want an answer (id != 0) and have not had one sent;
//     close_when_flushed() closes once everything queued is written.
//  7. A backend with a same-host path publishes local_endpoint() after
//     listen(); connect_local() to another transport's endpoint returns null
//     when that one is on another host (or network namespace), else a
//     connection with the promises above.
//  8. Polling (same-host connections of the shm backend): a thread that
//     spins anyway, waiting for an answer or for work, may call
//     Connection::poll_inline() to read what has arrived itself, saving
//     the transport thread's wake-up on the way. Messages that
//     Callbacks::inline_ok accepts are then delivered on that thread;
//     any other (and everything after it on that connection) goes to the
//     transport thread, so each connection's messages are still delivered
//     one at a time and in order. A callback that polls again meanwhile
//     reads nothing.
//  9. Liveness (Limits::peer_timeout): a connection is closed, and reported
//     closed with a reason saying so, when nothing has come on it for that
//     long; its stalled() is then true. To keep a silent but healthy peer
//     from looking stalled, the transport thread writes a heartbeat (a
//     frame the receiving decoder drops: rpc/message.h) on each connection
//     it has written nothing to for a tenth of that, at most a second (also
//     with no timeout of its own: its peers may have one).
//  10. Sleeping on a connection (same-host rings; Limits::poll_while_spinning):
//     a thread whose polling spin ran out with nothing come may sleep on the
//     connection it polls instead of behind the transport thread
//     (ConnectionSleep): the peer's next write wakes it, not the transport
//     thread, and it reads what came itself, as in 8. Other threads of the
//     process wake it through waker(). What it cannot read (8.'s hand-offs,
//     a closed connection) ends the sleep there, and the transport thread
//     reads on.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "tandem/rpc/limits.h"
#include "tandem/rpc/message.h"

namespace tandem::rpc {

// What a transport did to protect itself, counted since it started.
struct TransportStats {
  uint64_t read_pauses = 0;          // a peer's connection held for backpressure
  uint64_t handshake_timeouts = 0;   // connections closed for a handshake too slow
  uint64_t refused_connections = 0;  // accepted and closed at once: too many in handshake
  uint64_t accept_backoffs = 0;      // accept() failed for want of descriptors or memory
  uint64_t shared_tensors = 0;       // tensors sent through shared memory
  uint64_t shared_bytes = 0;         // and their bytes
  uint64_t shared_fallbacks = 0;     // large tensors sent inline: segments full or unavailable
  uint64_t bytes_sent = 0;           // frames written to sockets (queued ones included)
  uint64_t bytes_received = 0;       // frames read from sockets
  uint64_t polled_messages = 0;      // delivered by a thread polling its connection (8.)
  uint64_t ring_wakes = 0;           // 'W' bytes sent to wake a same-host ring's other side
  uint64_t ring_bells = 0;           // sleepers on a same-host ring woken directly (10.)
  uint64_t heartbeats = 0;           // written on connections that were idle (9.)
  uint64_t stalled_peers = 0;        // connections closed for their peer's silence (9.)
};

// send() of a request on a connection that was retired (6.): the frame was
// not taken; send it on the peer's current connection.
class RetiredError : public DisconnectedError {
 public:
  explicit RetiredError(const std::string& what) : DisconnectedError(what) {}
};

class Connection {
 public:
  virtual ~Connection() = default;
  virtual void send(OutFrame&& frame) = 0;
  // 6.
  virtual void retire(OutFrame&& last) = 0;
  virtual int64_t answers_owed() const = 0;
  virtual void close_when_flushed() = 0;
  virtual void close(const std::string& reason) = 0;
  // Unique among the connections of one transport.
  virtual uint64_t id() const = 0;
  // "tcp", or "shm" for a same-host connection of the shm backend.
  virtual const char* kind() const { return "tcp"; }
  virtual std::string peer_address() const = 0;
  // True once the connection is closed or closing: send() would throw.
  virtual bool closed() = 0;
  // 8.: reads and delivers what has arrived, on this thread; false when
  // nothing was delivered (or this connection does not poll).
  virtual bool poll_inline() { return false; }
  // 9.: closed because its peer was silent for Limits::peer_timeout.
  virtual bool stalled() const { return false; }
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
    // 8.: whether on_message may take `m` on a polling thread (null: never).
    std::function<bool(const Message& m)> inline_ok;
  };

  virtual ~Transport() = default;
  // Returns the bound port (useful with port 0).
  virtual int listen(const std::string& host, int port) = 0;
  virtual ConnectionPtr connect(const std::string& host, int port,
                                std::chrono::milliseconds timeout) = 0;
  virtual void close() = 0;
  virtual size_t live_connections() const = 0;
  // True on the thread that runs the callbacks (for debug assertions).
  virtual bool on_transport_thread() const = 0;
  virtual TransportStats stats() const { return {}; }
  // Where transports on this host reach this one without TCP (7.); empty
  // when it has no such path.
  virtual std::string local_endpoint() const { return {}; }
  virtual ConnectionPtr connect_local(const std::string& endpoint,
                                      std::chrono::milliseconds timeout) {
    (void)endpoint;
    (void)timeout;
    return nullptr;
  }
};

// 8.: the connection this thread last sent a request on or took one from,
// which it polls while it spins (poll_this_threads_connection()).
void remember_connection_for_polling(const ConnectionPtr& conn);
bool poll_this_threads_connection();

// 8.: brackets a spin that polls. While it lasts, the thread counts as a
// reader of the connection it polls, so the peer's writes to a same-host
// ring need not wake that connection's transport thread; when it ends,
// whatever the spin left unread goes to the transport thread.
class PollingSpin {
 public:
  PollingSpin();
  ~PollingSpin();
  PollingSpin(const PollingSpin&) = delete;
  PollingSpin& operator=(const PollingSpin&) = delete;
};

class ConnectionSleeper;

// 10.: inside a PollingSpin, a sleep on the connection this thread polls
// (a same-host ring it has looked at: a futex in the ring; a TCP socket:
// ppoll() on it and an eventfd). ok() is false where there is none: the
// thread sleeps its usual way then.
//
//   PollingSpin polling;
//   if (!spin_until(spin, done)) {
//     ConnectionSleep sleep;
//     register(sleep.waker());        // whatever else makes done() true calls it
//     while (!done() && sleep.wait(slice, done)) {}
//   }
class ConnectionSleep {
 public:
  ConnectionSleep();
  ~ConnectionSleep();
  ConnectionSleep(const ConnectionSleep&) = delete;
  ConnectionSleep& operator=(const ConnectionSleep&) = delete;

  bool ok() const { return sleeper_ != nullptr; }
  // Wakes the sleeper from any thread of this process; callable at any time,
  // also after the sleep ended (then it costs a wake of nobody).
  std::function<void()> waker() const;
  // Reads what has come (as poll_this_threads_connection()), and unless it
  // read something or `done()` holds, sleeps until the peer writes, waker()
  // runs, or `timeout` passes. False when the connection cannot be read
  // here any more (closed, or its messages went to the transport thread):
  // stop sleeping on it then.
  bool wait(std::chrono::microseconds timeout, const std::function<bool()>& done);

 private:
  std::unique_ptr<ConnectionSleeper> sleeper_;  // the connection kind's
};

// Makes a transport that checks frames against `limits` and reports to `callbacks`.
using TransportFactory =
    std::function<std::unique_ptr<Transport>(const Limits& limits, Transport::Callbacks callbacks)>;

// TCP on a libuv loop (rpc/transport/uv/).
TransportFactory tcp_transport();
// TCP, plus same-host connections whose frames travel through shared-memory
// rings and whose large tensors through shared-memory segments, with a
// Unix socket beside them for wake-ups and liveness (rpc/transport/shm/):
// the agent's default.
TransportFactory shm_transport();

}  // namespace tandem::rpc
