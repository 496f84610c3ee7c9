// TCP transport on a libuv loop, and the shm backend on the same loop: the
// transport object (listening, accepting, dialing, the loop thread, stats).
// Its connections are the stream part (stream_connection.h) over TCP
// (tcp_connection.h) or, same-host, over a Unix socket and shared-memory
// rings (rpc/transport/shm/local_connection.h).
//
// Threads and ownership:
//  1. One loop thread per transport. It polls the listening sockets and
//     every connection (uv_poll_t over our own non-blocking sockets), reads
//     frames, and calls Callbacks. It never runs user code.
//  2. Reads go through a FrameDecoder: small frames are read in 64 KiB gulps
//     and parsed from a staging buffer; once the decoder is inside a large
//     tensor, the next recv() lands straight in that tensor's storage
//     (stream_connection.h, 2.).
//  3. send() writes from the calling thread with sendmsg() over the frame's
//     buffers (preamble, envelope, each tensor's storage): no copy and no
//     hand-off to the loop on the common path. Only what the socket would not
//     take is queued; the loop finishes it when the socket is writable.
//     (uv_write from the loop would be the plain libuv way; writing from the
//     caller saves one thread hand-off per message, measured in
//     bench/rpc_bench.)
//  4. Everything else that touches a handle is posted to the loop as a
//     command through one uv_async_t (post()).
//  5. Backpressure. A peer that sends requests but does not read our
//     answers would make us queue answers without bound, and one that sends
//     calls faster than they are served would fill the pool's queue. Once
//     more than Limits::max_queued_reply_bytes of answers to a peer wait
//     unwritten, or more than Limits::max_unanswered_requests of its
//     requests wait for their answers, what that peer sends is held, in
//     order, instead of delivered; past Limits::max_held_bytes held, its
//     socket is not read at all. When both drain to half their bound, the
//     held messages are delivered and reading resumes
//     (TransportStats::read_pauses counts the pauses).
//     Holding before not reading is what keeps two loaded workers from
//     deadlocking: while one holds, it still reads, so the other's answers
//     drain and it resumes. (Per connection: stream_connection.h, 4.)
//  6. Handshakes are bounded: a connection whose handshake frames have not
//     all come within Limits::handshake_timeout is closed (checked every
//     250 ms), and accepted connections still in their handshake are capped
//     at Limits::max_handshaking_connections (newer ones are closed at once).
//  7. When accept() fails for want of descriptors or memory (EMFILE ...),
//     the listener is not watched for 100 ms (once logged), instead of
//     spinning on a socket that stays readable.
//  8. With shared_memory (shm_transport()), listen() also opens an abstract
//     Unix socket, published as local_endpoint(); connect_local() dials one
//     on this host. Those connections carry their frames through
//     shared-memory rings and their large tensors through shared-memory
//     segments, with the socket beside them for wake-ups, descriptors and
//     liveness (local_connection.h, 1.). A full ring whose reader sends no
//     wake-ups (it has no ring of its own) is retried here on a 1 ms timer.
//  9. Polling (rpc/transport.h, 8.; same-host connections, with
//     Limits::poll_while_spinning and Callbacks::inline_ok set): a thread
//     that spins anyway calls poll_inline(), which runs the connection's one
//     drain on that thread (stream_connection.h, 3.; local_connection.h, 2.).
//     The first message it may not deliver (the agent's handshake, loop
//     handlers, RRefs), and every one after it, waits for the loop thread,
//     which delivers them first; so does what would pause the peer (5.),
//     and anything that must close the connection. The loop thread never
//     polls.
//
// 10. Liveness (rpc/transport.h, 9.; Limits::peer_timeout): every 250 ms
//     the loop thread writes a heartbeat on each connection it has written
//     nothing to for a tenth of the timeout (at most a second; a second
//     with no timeout, for peers that have one), and closes, as stalled,
//     each one from which nothing has come for the whole timeout, after
//     reading it once more (this thread may itself have been held up). A
//     connection not read for backpressure (5.) is judged by whether the
//     peer takes what waits for it instead. Nothing is judged in a sweep
//     that comes more than 2 s after the one before: then this process was
//     the one stopped, and its peers' heartbeats wait unread. A connection
//     this transport dialed whose handshake does not come within
//     Limits::handshake_timeout is closed as stalled too.
//
// Talking to its connections: the transport makes them, registers them
// with the loop (adopt_from_loop), closes them on stop and forgets them
// once their handle is gone; everything else goes through their public
// functions. They call back only the few functions marked below.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tandem/rpc/transport.h"

namespace tandem::rpc {

class StreamConnection;

// What a transport counts, shared with its connections (TransportStats),
// and what it logs once.
struct TransportCounters {
  std::atomic<uint64_t> read_pauses{0};
  std::atomic<uint64_t> handshake_timeouts{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> accept_backoffs{0};
  std::atomic<uint64_t> shared_tensors{0};
  std::atomic<uint64_t> shared_bytes{0};
  std::atomic<uint64_t> shared_fallbacks{0};
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> polled_messages{0};
  std::atomic<uint64_t> ring_wakes{0};
  std::atomic<uint64_t> ring_bells{0};
  std::atomic<uint64_t> heartbeats{0};
  std::atomic<uint64_t> stalled_peers{0};
  std::atomic<bool> shared_unavailable_logged{false};
  std::atomic<bool> ring_unavailable_logged{false};
};

class UvTransport final : public Transport {
 public:
  UvTransport(Limits limits, Callbacks callbacks, bool shared_memory = false);
  ~UvTransport() override;

  int listen(const std::string& host, int port) override;
  ConnectionPtr connect(const std::string& host, int port,
                        std::chrono::milliseconds timeout) override;
  void close() override;
  size_t live_connections() const override { return live_connections_.load(); }
  bool on_transport_thread() const override;
  TransportStats stats() const override;
  std::string local_endpoint() const override;
  ConnectionPtr connect_local(const std::string& endpoint,
                              std::chrono::milliseconds timeout) override;

  // For its connections (stream_connection.h, 6.).
  // Runs `fn` on the loop thread. False once the loop is gone.
  bool post(std::function<void()> fn);
  const Limits& limits() const { return limits_; }
  const Callbacks& callbacks() const { return callbacks_; }
  TransportCounters& counters() { return counters_; }
  // The loop thread's scratch for reads (kStagingBytes).
  char* staging_from_loop() { return staging_.data(); }
  // An accepted connection finished its handshake, or closed before (6.).
  void handshake_ended_from_loop() { --handshaking_; }
  // A closed connection's handle is gone: unregistered and reported.
  void forget_from_loop(const std::shared_ptr<StreamConnection>& conn, const std::string& reason);
  // Writes the peer's ring reader cannot wake (it has no ring: 'N'), tried
  // again after kRingRetry (8.).
  void retry_ring_from_loop(const std::shared_ptr<StreamConnection>& conn);

 private:
  struct Loop;

  void run_commands();
  void listen_local();
  // Hands a listening socket to the loop (closes it when the loop is gone).
  bool start_listening(int fd, bool local);
  void accept_from_loop(bool local);
  void adopt_from_loop(const std::shared_ptr<StreamConnection>& conn);
  // Every kSweepPeriod: handshakes too slow (6.), heartbeats and silence (10.).
  void sweep_from_loop();
  void watch_listener_from_loop();
  void stop_from_loop();

  Limits limits_;
  Callbacks callbacks_;
  const bool shared_memory_;
  TransportCounters counters_;
  std::unique_ptr<Loop> loop_;
  std::thread thread_;
  std::thread::id thread_id_;  // thread_'s, fixed once started

  mutable std::mutex mu_;
  std::vector<std::function<void()>> commands_;
  std::string local_endpoint_;  // under mu_: "shm:<boot id>:<net ns>:<name>"
  std::string local_name_;      // under mu_: the abstract socket's name
  bool closing_ = false;        // close() was called
  bool loop_gone_ = false;      // the wake-up handle is closed; post() fails

  int listen_fd_ = -1;
  int local_fd_ = -1;
  bool stopped_ = false;  // loop thread only: stop_from_loop() ran
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<StreamConnection>> conns_;  // loop thread only
  std::vector<std::weak_ptr<StreamConnection>> ring_retry_;                // loop thread only
  std::vector<char> staging_;                                              // loop thread only
  std::atomic<size_t> live_connections_{0};
  size_t handshaking_ = 0;            // loop thread only: accepted, handshake unfinished
  std::chrono::steady_clock::time_point last_sweep_{};  // loop thread only (10.)
  bool accept_error_logged_ = false;  // loop thread only
};

}  // namespace tandem::rpc
