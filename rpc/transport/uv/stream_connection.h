// One connection of the uv and shm backends over a non-blocking stream
// socket: what TCP (tcp_connection.h) and same-host connections
// (rpc/transport/shm/local_connection.h) share. It owns both of its sides:
// the write side (frames written from the sender's thread, the queue the
// loop finishes) and the read side (the decoder, delivery, backpressure):
// stream_connection.cc holds the write side and the connection's life on
// the loop, stream_drain.cc the read side.
//
// Promises, threads, neighbours:
//  1. Writing (uv_transport.h, 3.): send() writes from the calling thread
//     with sendmsg() over the frame's buffers (preamble, envelope, each
//     tensor's storage): no copy and no hand-off to the loop on the common
//     path. Only what the socket would not take is queued, under write_mu_;
//     the loop thread finishes it when the socket is writable.
//  2. Reading (uv_transport.h, 2.): bytes go through a FrameDecoder: small
//     frames are read in 64 KiB gulps and parsed from a staging buffer; once
//     the decoder is inside a large tensor, the next read lands straight in
//     that tensor's storage.
//  3. One drain, two callers: drain_locked() reads what has arrived into the
//     decoder and delivers it. The transport's loop thread calls it when the
//     socket is readable (read_from_loop()); a thread that spins anyway
//     calls it through poll_inline() (rpc/transport.h, 8.; same-host
//     connections only). Either holds read_mu_ while it reads, decodes and
//     delivers, so a connection's messages are delivered one at a time and
//     in order. The two callers differ only where the contract says so: a
//     poller reads a few rounds, delivers on its own thread what
//     Callbacks::inline_ok accepts, and leaves everything else (the first
//     message it may not deliver and all after it, what would pause the
//     peer, the end of the connection, a protocol error) in deferred_ for
//     the loop thread, which delivers that first (uv_transport.h, 9.).
//  4. Backpressure (uv_transport.h, 5.) is decided here, per connection, on
//     the loop thread: deliver_from_loop() holds what the peer sends while
//     too many answers to it wait unwritten or too many of its requests
//     wait for answers, and past Limits::max_held_bytes stops reading;
//     resume_from_loop() delivers what was held once both drained to half.
//  5. The kind's own steps (same-host rings, codes, segments) are chosen by
//     a test of kind_ inside this part (local()), not by virtual calls: they
//     run for every frame written and every read, where a test is what the
//     single class had, and the two kinds are all there are.
//  6. Talks to its transport (UvTransport) through a few calls meant for
//     its connections: post() to run on the loop thread, limits(),
//     callbacks(), counters(), and, on the loop thread, the handshake count
//     and forget_from_loop() once the closed handle is gone. The transport
//     talks to it only through its public functions.
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>
#include <uv.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/rpc/transport.h"
#include "tandem/rpc/wire/wire.h"

namespace tandem::rpc {

// Puts `n` descriptors beside the bytes `msg` sends (SCM_RIGHTS), in
// `control`, which must hold CMSG_SPACE(sizeof(int) * n) bytes and outlive
// the sendmsg(). Both of a same-host connection's writers use it: the
// stream's frames (new segments) and the local connection's codes.
inline void attach_fds(msghdr& msg, char* control, const int* fds, size_t n) {
  const size_t fd_bytes = sizeof(int) * n;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(fd_bytes);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(fd_bytes);
  std::memcpy(CMSG_DATA(c), fds, fd_bytes);
}

class UvTransport;
class LocalConnection;
class SegmentWriter;

// A ConnectionSleep's work (rpc/transport.h, 10.) on the connection this
// thread polls, done the way its kind sleeps.
class ConnectionSleeper {
 public:
  virtual ~ConnectionSleeper() = default;
  virtual bool wait(std::chrono::microseconds timeout, const std::function<bool()>& done) = 0;
  virtual std::function<void()> waker() const = 0;
};

constexpr size_t kStagingBytes = 64 << 10;
// Below this many bytes left in a tensor, gulp into staging and copy instead.
constexpr size_t kDirectReadMin = 16 << 10;
constexpr int kReadRoundsPerWakeup = 64;
constexpr int kReadRoundsPerPoll = 4;  // a spinning thread reads a little; the rest is the loop's
// What a TCP poller reads at once (tcp_connection.h, 1.): frames larger are the loop's.
constexpr size_t kPollerGulp = 4 << 10;
// Descriptors one frame may announce; one read takes at most one frame's.
constexpr size_t kMaxFdsPerRead = 64;

// One frame being written: the iovecs over its buffers and how far we got.
struct PendingWrite {
  // With `shared`, tensors of at least min_shared_tensor_bytes go through
  // its segments where they fit (rpc/transport/shm/segments.h); the frame
  // then carries a table of where they are instead of their bytes.
  PendingWrite(OutFrame&& f, SegmentWriter* shared, const Limits& limits);
  void place_shared(SegmentWriter& shared, const Limits& limits);

  OutFrame frame;
  std::vector<SharedRef> table;   // tensors placed in shared memory
  uint64_t shared_bytes = 0;      // their bytes
  uint64_t shared_fallbacks = 0;  // large tensors left in the body (pool full or unavailable)
  std::vector<int> fds;           // segments announced with this frame (owned by the writer)
  bool fds_sent = false;
  uint64_t reply_bytes = 0;  // the whole frame when it answers the peer, else 0
  std::vector<iovec> iov;
  size_t next = 0;
};

class StreamConnection : public Connection, public std::enable_shared_from_this<StreamConnection> {
 public:
  enum class Kind { kTcp, kLocal };
  // Who drains: the transport's loop thread, or a thread polling (3.).
  enum class Reader { kLoop, kPoller };
  using Clock = std::chrono::steady_clock;

  // Connection (rpc/transport.h).
  void send(OutFrame&& frame) override;
  void retire(OutFrame&& last) override;
  int64_t answers_owed() const override;
  void close_when_flushed() override;
  void close(const std::string& reason) override;
  uint64_t id() const override { return id_; }
  std::string peer_address() const override { return peer_; }
  bool closed() override;

  bool accepted() const { return accepted_; }

  // For the transport, on its loop thread. Registers the socket with the
  // loop (`counted_handshaking`: the transport counts it until its
  // handshake ends).
  void adopt_from_loop(uv_loop_t* loop, bool counted_handshaking);
  // The transport stopped before adopting it: closes the socket only.
  void drop_unadopted();
  void close_from_loop(const std::string& reason);
  bool closed_on_loop() const { return loop_closed_; }
  bool handshake_overdue(Clock::time_point now, std::chrono::milliseconds timeout) const;
  // Liveness (uv_transport.h, 10.): a heartbeat when nothing was written
  // for a tenth of `timeout` (at most 1 s); closed as stalled when nothing
  // came for `timeout` and a last read finds nothing either. `held_up`:
  // this process was stopped since the last sweep, so nobody is judged.
  void keep_alive_from_loop(Clock::time_point now, std::chrono::milliseconds timeout, bool held_up);
  bool stalled() const override { return stalled_.load(std::memory_order_acquire); }
  // Closes it as stalled (10.), saying `reason`.
  void close_stalled_from_loop(const std::string& reason);
  // The socket is readable, or a read was posted: drains (3.), then lets
  // writes that waited for the peer go on.
  void read_from_loop();
  // Delivers what was held and reads again, once the answers have drained (4.).
  void resume_from_loop();
  // Writes what is queued, if anything.
  void flush_if_queued_from_loop();

  // True where polling must not happen: on the loop thread (it reads
  // anyway, holding read_mu_), and inside a poll's own deliveries.
  static bool& no_polling_here();

  // Polling and sleeping on a connection (rpc/transport.h, 8. and 10.).
  // A thread's PollingSpin: how deep, and the connection it polls now.
  struct PollingState {
    int depth = 0;
    std::shared_ptr<StreamConnection> entered;
  };
  static PollingState& polling_state();
  // What each kind does: this thread's spin ended (what it left goes on),
  virtual void leave_polling_spin() {}
  // a sleep of this thread on it, if it polls it now and may sleep there,
  virtual std::unique_ptr<ConnectionSleeper> sleeper_here() { return nullptr; }
  // what wakes every thread asleep on it (its end),
  virtual void wake_sleepers() {}
  // and, on the loop thread woken for its bytes, whether a sleeper reads
  // them instead (the loop comes back while they wait: its watch is level).
  virtual bool yield_read_from_loop() { return false; }

 protected:
  StreamConnection(UvTransport* transport, Kind kind, int fd, uint64_t id, std::string peer,
                   bool accepted);

  // The same-host kind's steps (5.); kind_ == Kind::kLocal.
  LocalConnection& local();

  // Inside a PollingSpin, makes this the connection this thread polls
  // (the one before leaves its spin): true when it was not already.
  bool enter_polling_here();
  // The poll both kinds share, once a kind has looked: read_mu_ if free,
  // and the drain as a poller (3.).
  bool poll_if_free();

  // The one drain (3.), read_mu_ held. True when a poller delivered something.
  bool drain_locked(Reader who);
  // The socket's bytes into the decoder and on, for `who` (read_mu_ held):
  // TCP, and a same-host peer without a ring.
  bool read_socket_locked(Reader who);
  // Scratch for reads that do not land in a tensor: the loop's, or this
  // polling thread's.
  char* staging(Reader who);
  // The bytes a read brought, into the decoder; false (`error`) on a protocol error.
  bool feed_decoder(bool direct, const char* buf, size_t n, std::string& error);
  // The next decoded message, counted (bytes received; an answer owed).
  Message take_message();
  // What the decoder holds, delivered (the handshake's end counted first).
  void deliver_decoded_from_loop();
  // A poll's message: delivered on this thread, or left in deferred_ for
  // the loop thread (read_mu_ held). True when delivered.
  bool deliver_inline_locked(Message&& m);
  // What a poller could not finish goes to the loop thread: deferred
  // messages, or the close (with `close_reason`).
  void hand_to_loop(const std::string& close_reason);
  // A read went wrong: the loop thread closes; a poller hands the close on.
  void fail_read(Reader who, const std::string& reason);
  // Why reading ended: the peer closed (`err` 0) or the read failed.
  std::string end_of_reading(int err) const;
  // What a poll left for the loop thread, delivered in order (read_mu_ held).
  void deliver_deferred_locked();
  // Whether pollers may read now (read_mu_ held).
  void update_inline_locked();
  // Whether delivering one more message would pause the peer (4.).
  bool would_pause() const;
  // Hands `m` to on_message, or holds it while paused (4.).
  void deliver_from_loop(Message&& m);
  void resume_locked();  // read_mu_ held
  // Requests handed to the layer above and not answered yet.
  uint64_t in_progress() const;

  void send_locked(OutFrame&& frame);  // write_mu_ held
  // Writes as much of `w` as the kind's channel takes now (the socket, or
  // a same-host ring). True when all of it went. write_mu_ held. On a hard
  // error, marks the connection closed, asks the loop to close it, and
  // throws DisconnectedError.
  bool write_locked(PendingWrite& w);
  // write_locked() through the socket.
  bool write_socket_locked(PendingWrite& w);
  [[noreturn]] void fail_write_locked(const std::string& reason);
  void clear_queue_locked();
  void flush_from_loop();
  void flush_locked();
  void update_poll_from_loop();
  void start_poll_locked();
  static void on_poll(uv_poll_t* handle, int status, int events);

  UvTransport* const transport_;
  const Kind kind_;
  const int fd_;
  const uint64_t id_;
  const std::string peer_;
  const bool accepted_;
  const Clock::time_point opened_at_;

  // Reading: the loop thread, or one polling thread (3.), holds read_mu_
  // while it reads, decodes and delivers; the decoder, the peer's segments
  // and deferred_ are under it. inline_ok_: pollers may read (handshake
  // done, not paused, nothing deferred, not closed), set under read_mu_.
  std::mutex read_mu_;
  std::atomic<bool> inline_ok_{false};
  std::deque<Message> deferred_;  // a poll's messages for the loop thread, in order
  FrameDecoder decoder_;

  // Loop thread only.
  uv_poll_t poll_;
  bool polling_ = false;
  bool loop_closed_ = false;
  bool counted_handshaking_ = false;  // in the transport's count of handshakes
  // Backpressure (4.): while our answers to this peer pile up unwritten,
  // what it sends is held here, in order, and past Limits::max_held_bytes
  // the socket is not read at all.
  bool paused_ = false;
  bool reading_stopped_ = false;
  // Liveness (uv_transport.h, 10.): when bytes last came (any reader) and
  // when a frame was last written (any sender), steady-clock nanoseconds.
  std::atomic<int64_t> heard_ns_{0};
  std::atomic<int64_t> wrote_ns_{0};
  // When bytes last left for the peer (a socket or ring took them).
  std::atomic<int64_t> moved_ns_{0};
  void note_written() {
    moved_ns_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  }
  std::atomic<bool> stalled_{false};
  std::deque<Message> held_;
  uint64_t held_bytes_ = 0;

  // Retiring (transport.h, 6.): requests received wanting an answer (loop
  // thread) and answers sent (under write_mu_).
  std::atomic<uint64_t> requests_in_{0};
  std::atomic<uint64_t> requests_delivered_{0};  // of those, handed to on_message
  std::atomic<uint64_t> answers_out_{0};
  std::atomic<bool> paused_flag_{false};  // paused_, for the senders

  std::mutex write_mu_;
  bool retired_ = false;             // no more requests (under write_mu_)
  bool close_when_flushed_ = false;  // close once queue_ drains (under write_mu_)
  std::deque<std::unique_ptr<PendingWrite>> queue_;
  // Bytes of queued frames that answer the peer (changed under write_mu_).
  std::atomic<uint64_t> queued_reply_bytes_{0};
  bool closed_ = false;
  bool want_writable_ = false;
};

}  // namespace tandem::rpc
