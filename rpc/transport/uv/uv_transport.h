// TCP transport on a libuv loop, and the shm backend on the same loop.
//
// Threads and ownership:
//  1. One loop thread per transport. It polls the listening socket and every
//     connection (uv_poll_t over our own non-blocking sockets), reads frames,
//     and calls Callbacks. It never runs user code.
//  2. Reads go through a FrameDecoder: small frames are read in 64 KiB gulps
//     and parsed from a staging buffer; once the decoder is inside a large
//     tensor, the next recv() lands straight in that tensor's storage.
//  3. send() writes from the calling thread with sendmsg() over the frame's
//     buffers (preamble, envelope, each tensor's storage): no copy and no
//     hand-off to the loop on the common path. Only what the socket would not
//     take is queued; the loop finishes it when the socket is writable.
//     (DESIGN.md sketches uv_write from the loop; writing from the caller
//     saves one thread hand-off per message, measured in bench/rpc_bench.)
//  4. Everything else that touches a handle is posted to the loop as a
//     command through one uv_async_t.
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
//     drain and it resumes.
//  6. Handshakes are bounded: a connection whose handshake frames have not
//     all come within Limits::handshake_timeout is closed (checked every
//     250 ms), and accepted connections still in their handshake are capped
//     at Limits::max_handshaking_connections (newer ones are closed at once).
//  7. When accept() fails for want of descriptors or memory (EMFILE ...),
//     the listener is not watched for 100 ms (once logged), instead of
//     spinning on a socket that stays readable.
//  8. With shared_memory (shm_transport()), listen() also opens an abstract
//     Unix socket, published as local_endpoint(); connect_local() dials one
//     on this host. On those connections each side writes its frames into a
//     shared-memory ring it made (rpc/transport/shm/ring.h) instead of the
//     socket, and the reader feeds them to the same decoder, with the same
//     bounds and backpressure, as TCP; tensors of at least
//     Limits::min_shared_tensor_bytes go through shared-memory segments
//     (segments.h), which the receiver's tensor lives in. The socket stays
//     beside the ring for what a ring cannot do: the first byte ('R' with
//     the ring's descriptor, or 'N' when no ring could be made and frames
//     follow on the socket), one-byte wake-ups for a sleeping reader or a
//     writer waiting for space, the segments' descriptors (SCM_RIGHTS), and
//     liveness: the kernel closes it when a process dies, however it dies.
//     A writer that finds the ring full queues the rest, as for a full
//     socket, and the loop writes it on when the reader's wake-up comes.
//  9. Polling (rpc/transport.h, 8.; same-host connections, with
//     Limits::poll_while_spinning and Callbacks::inline_ok set). A thread
//     that spins anyway (an rpc_sync caller waiting for its answer, an idle
//     pool thread after a task) calls poll_inline() inside a PollingSpin: it
//     takes the connection's read_mu_ if free (the loop thread holds it
//     while it reads, decodes and delivers), reads a few rounds itself, and
//     delivers what inline_ok() accepts on its own thread. The first
//     message it may not deliver (the agent's handshake, loop handlers,
//     RRefs), and every one after it, waits in deferred_ for the loop
//     thread, which delivers them first; so does what would pause the peer
//     (5.), and anything that must close the connection. While a thread
//     spins it is counted in the ring's pollers, so the writer sends no
//     wake-up and neither side makes a system call: a poll is two loads
//     when nothing came. When the spin ends it looks at the ring once more
//     and posts what is left to the loop thread. The loop thread never
//     polls (nor does a poll's own callback), and a connection's
//     descriptor is closed under read_mu_, so no poller reads a closed or
//     reused one.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tandem/rpc/transport.h"

namespace tandem::rpc {

class UvConnection;
struct PendingWrite;

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

 private:
  friend class UvConnection;
  struct Loop;

  // Runs `fn` on the loop thread. False once the loop is gone.
  bool post(std::function<void()> fn);
  void run_commands();
  void listen_local();
  // Hands a listening socket to the loop (closes it when the loop is gone).
  bool start_listening(int fd, bool local);
  void accept_from_loop(bool local);
  // Adopts the segment descriptors a read brought; false (connection
  // closed) when they are not acceptable.
  bool take_descriptors(const std::shared_ptr<UvConnection>& conn, msghdr& msg);
  // The same without closing: false and `error` when they are not acceptable.
  bool adopt_descriptors(const std::shared_ptr<UvConnection>& conn, msghdr& msg,
                         std::string& error);
  // The same for descriptors already collected: each is adopted (and
  // counted) or, once one fails or `error` is set, closed.
  bool adopt_fds(const std::shared_ptr<UvConnection>& conn, std::vector<int> fds,
                 std::string& error);
  // Counts what a frame put in shared memory (and logs once why segments
  // could not be made).
  void count_shared(const PendingWrite& w, const std::string& unavailable,
                    const std::string& peer);
  void adopt_from_loop(const std::shared_ptr<UvConnection>& conn);
  void close_from_loop(const std::shared_ptr<UvConnection>& conn, const std::string& reason);
  void read_from_loop(const std::shared_ptr<UvConnection>& conn);
  void read_some_from_loop(const std::shared_ptr<UvConnection>& conn);  // read_mu_ held
  // What the decoder holds, delivered (the handshake's end counted first).
  void deliver_decoded_from_loop(const std::shared_ptr<UvConnection>& conn);
  // Why reading ended: the peer closed (`err` 0) or the read failed.
  static std::string end_of_reading(const UvConnection& conn, int err);
  // Writes the peer's ring reader cannot wake (it has no ring: 'N'), tried
  // again after kRingRetry.
  void retry_ring_from_loop(const std::shared_ptr<UvConnection>& conn);
  // rpc/transport.h, 8.: a spinning thread's read (conn->read_mu_ held).
  bool read_inline(const std::shared_ptr<UvConnection>& conn);
  // A poll's message: delivered on this thread, or left in deferred_ for
  // the loop thread (read_mu_ held). True when delivered.
  bool deliver_inline_locked(const std::shared_ptr<UvConnection>& conn, Message&& m);
  // What a poller could not finish goes to the loop thread: deferred
  // messages, or the close (with `close_reason`).
  void hand_to_loop(const std::shared_ptr<UvConnection>& conn, const std::string& close_reason);
  // Same-host connections (rpc/transport/shm/ring.h), read_mu_ held. The
  // socket's codes: the peer's first byte, wake-ups, segment descriptors.
  // On the loop thread a problem closes the connection (its end first
  // drains the ring); on a poller it goes to `error`, and the end is left
  // to the loop. False when reading must stop.
  bool read_codes_locked(const std::shared_ptr<UvConnection>& conn, bool poller,
                         std::string& error);
  // The peer's ring into the decoder, and its messages delivered (or, on a
  // poller, handed on as read_inline does). `drain`: all of it, not
  // arming (the socket ended). True when a poller delivered something.
  bool read_ring_locked(const std::shared_ptr<UvConnection>& conn, bool poller, bool drain);
  // The first byte of a same-host connection (ring.h, 1.), logging once
  // when it has no ring. False (`why`) when it could not be sent.
  bool say_hello(UvConnection& conn, std::string& why);
  // The bytes a read brought, into the decoder; false (`error`) on a protocol error.
  bool feed_decoder(UvConnection& conn, bool direct, const char* buf, size_t n,
                    std::string& error);
  // The next decoded message, counted (bytes received; an answer owed).
  Message take_message(UvConnection& conn);
  // What a poll left for this thread, delivered in order (read_mu_ held).
  void deliver_deferred_locked(const std::shared_ptr<UvConnection>& conn);
  // Whether pollers may read `conn` now (read_mu_ held).
  void update_inline_locked(const std::shared_ptr<UvConnection>& conn);
  // Whether delivering one more message would pause `conn` (5.).
  bool would_pause(const UvConnection& conn) const;
  // Hands `m` to on_message, or holds it while the connection is paused (5.).
  void deliver_from_loop(const std::shared_ptr<UvConnection>& conn, Message&& m);
  // Delivers what was held and reads again, once the answers have drained.
  void resume_from_loop(const std::shared_ptr<UvConnection>& conn);
  void resume_locked(const std::shared_ptr<UvConnection>& conn);  // read_mu_ held
  void sweep_handshakes_from_loop();
  void watch_listener_from_loop();
  void stop_from_loop();

  Limits limits_;
  Callbacks callbacks_;
  const bool shared_memory_;
  std::unique_ptr<Loop> loop_;
  std::thread thread_;
  std::thread::id thread_id_;  // thread_'s, fixed once started

  mutable std::mutex mu_;
  std::vector<std::function<void()>> commands_;
  std::string local_endpoint_;  // under mu_: "shm:<boot id>:<net ns>:<name>"
  std::string local_name_;      // under mu_: the abstract socket's name
  bool closing_ = false;    // close() was called
  bool loop_gone_ = false;  // the wake-up handle is closed; post() fails

  int listen_fd_ = -1;
  int local_fd_ = -1;
  bool stopped_ = false;  // loop thread only: stop_from_loop() ran
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, std::shared_ptr<UvConnection>> conns_;  // loop thread only
  std::vector<std::weak_ptr<UvConnection>> ring_retry_;                // loop thread only
  std::vector<char> staging_;                                          // loop thread only
  std::atomic<size_t> live_connections_{0};
  size_t handshaking_ = 0;            // loop thread only: accepted, handshake unfinished
  bool accept_error_logged_ = false;  // loop thread only
  std::atomic<uint64_t> stats_read_pauses_{0};
  std::atomic<uint64_t> stats_handshake_timeouts_{0};
  std::atomic<uint64_t> stats_refused_{0};
  std::atomic<uint64_t> stats_accept_backoffs_{0};
  std::atomic<uint64_t> stats_shared_tensors_{0};
  std::atomic<uint64_t> stats_shared_bytes_{0};
  std::atomic<uint64_t> stats_shared_fallbacks_{0};
  std::atomic<uint64_t> stats_bytes_sent_{0};
  std::atomic<uint64_t> stats_bytes_received_{0};
  std::atomic<uint64_t> stats_polled_messages_{0};
  std::atomic<uint64_t> stats_ring_wakes_{0};
  std::atomic<bool> shared_unavailable_logged_{false};
  std::atomic<bool> ring_unavailable_logged_{false};
};

}  // namespace tandem::rpc
