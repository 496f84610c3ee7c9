// A same-host connection of the shm backend: a Unix socket, a shared-memory
// ring each way (ring.h) and each side's segments for large tensors
// (segments.h), over the stream part every connection of the uv loop shares
// (rpc/transport/uv/stream_connection.h).
//
// Promises, threads, neighbours:
//  1. (uv_transport.h, 8.) Each side writes its frames into a ring it made
//     instead of the socket, and the reader feeds them to the same decoder,
//     with the same bounds and backpressure, as TCP; tensors of at least
//     Limits::min_shared_tensor_bytes go through shared-memory segments,
//     which the receiver's tensor lives in. The socket stays beside the ring
//     for what a ring cannot do: the first byte ('R' with the ring's
//     descriptor, or 'N' when no ring could be made and frames follow on the
//     socket), one-byte wake-ups for a sleeping reader or a writer waiting
//     for space, the segments' descriptors (SCM_RIGHTS), and liveness: the
//     kernel closes it when a process dies, however it dies. A writer that
//     finds the ring full queues the rest, as for a full socket, and the
//     loop writes it on when the reader's wake-up comes.
//  2. Polling (rpc/transport.h, 8.; uv_transport.h, 9.; with
//     Limits::poll_while_spinning and Callbacks::inline_ok set). A thread
//     that spins anyway (an rpc_sync caller waiting for its answer, an idle
//     pool thread after a task) calls poll_inline() inside a PollingSpin: it
//     takes read_mu_ if free (the loop thread holds it while it reads,
//     decodes and delivers) and runs the stream part's one drain as a
//     poller (stream_connection.h, 3.). While a thread spins it is counted
//     in the ring's pollers, so the writer sends no wake-up and neither side
//     makes a system call: a poll is two loads when nothing came. When the
//     spin ends it looks at the ring once more and posts what is left to the
//     loop thread. The loop thread never polls (nor does a poll's own
//     callback), and the descriptor is closed under read_mu_, so no poller
//     reads a closed or reused one.
//     A thread whose spin ran out may then sleep on the peer's ring
//     (ConnectionSleep, transport.h 10.; ring.h 3a.), still counted as its
//     poller: the peer's next write rings the ring's bell instead of
//     sending 'W', and the sleeper reads it as a poller does.
//  3. Threads: writes under write_mu_ on the sender's thread (the loop's
//     for what was queued); reads under read_mu_ on the loop thread or one
//     poller. The ring writer and our segments are the write side's; the
//     peer's ring, its segments and the socket's codes are the read side's.
//  4. Neighbours: the stream part calls the steps below where a same-host
//     connection differs (stream_connection.h, 5.); the transport makes it
//     (accepted on, or dialed to, an endpoint below) and sends its first
//     byte with say_hello().
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>

#include "tandem/rpc/transport/uv/stream_connection.h"

namespace tandem::rpc {

class RingReader;
class RingWriter;
class SegmentReader;

class LocalConnection final : public StreamConnection {
 public:
  LocalConnection(UvTransport* transport, int fd, uint64_t id, std::string peer, bool accepted);
  ~LocalConnection() override;

  const char* kind() const override { return "shm"; }
  bool poll_inline() override;

  // The first byte on the socket (ring.h, 1.): our ring, or that we have
  // none (logged once per transport). False (`why`) when the socket would
  // not take it.
  bool say_hello(std::string& why);

  // The stream part's steps (stream_connection.h, 5.).
  // Where large tensors go (null: inline), under write_mu_.
  SegmentWriter* segments_out() { return shared_out_.get(); }
  // Counts what a frame put in shared memory (and logs once why segments
  // could not be made).
  void count_shared(const PendingWrite& w);
  // Our frames go into a ring (else through the socket).
  bool writes_ring() const { return ring_out_ != nullptr; }
  // The peer's frames come through its ring (loop thread).
  bool peer_writes_ring() const { return peer_mode_ == PeerMode::kRing; }
  // With a ring, the socket brings the peer's wake-ups (ring.h, 3.), which
  // are read also while the ring itself is not; it is wanted writable only
  // for descriptors it would not take.
  void adjust_events(bool& readable, bool& writable) const;
  // write_locked() for this kind (write_mu_ held).
  bool write_local_locked(PendingWrite& w);
  // The drain for this kind (read_mu_ held): the socket's codes, then the
  // peer's ring, or the socket's frames when it has no ring.
  bool read_local_locked(Reader who);
  // One recvmsg() of frames on the socket, and the segment descriptors
  // beside them, adopted before the bytes are decoded (a frame may use one
  // it brought); `error` when they are not acceptable.
  ssize_t recv_socket(char* buf, size_t len, std::string& error);

  // ConnectionSleep::wait (transport.h, 10.; ring.h, 3a.) on the thread
  // that polls this connection now.
  bool sleep_polling(std::chrono::microseconds timeout, const std::function<bool()>& done);
  // Wakes whoever sleeps on the peer's ring (ring.h, 3a.).
  void ring_bell();
  void wake_sleepers() override { ring_bell(); }
  // Whether this thread polls this connection now (its PollingSpin entered
  // it), and may sleep on the peer's ring (Limits::sleep_on_connection).
  bool sleepable_here() const;
  std::unique_ptr<ConnectionSleeper> sleeper_here() override;

  // Inside a PollingSpin (transport.h), this thread counts as reading the
  // ring until the spin ends (ring.h, 3.): writers need not wake the loop.
  void enter_polling_spin(RingReader* ring);
  // The spin ended: hands what it left in the ring to the loop thread.
  void leave_polling_spin() override;

 private:
  // Writes one code byte (with descriptors) to the socket: 1 sent, 0 the
  // socket is full, -1 failed (errno).
  int send_code(char code, const std::vector<int>& fds);
  // write_local_locked() through our ring (ring.h): descriptors on the
  // socket first, then the bytes, waking the reader where it sleeps. False
  // when the ring is full (the reader's 'W' brings the loop back) or the
  // socket would not take the descriptors (wait_socket_: it waits for
  // writable).
  bool write_ring(PendingWrite& w);
  // Makes what the ring holds visible, and wakes the reader if it sleeps.
  void publish_locked();
  // Asks the loop to try the queued writes again in a moment.
  void retry_ring_later();
  // The socket's codes: the peer's first byte, wake-ups, segment
  // descriptors. On the loop thread a problem closes the connection (its
  // end first drains the ring); on a poller it goes to `error`, and the end
  // is left to the loop. False when reading must stop.
  bool read_codes_locked(Reader who, std::string& error);
  // The peer's ring into the decoder, and its messages delivered (or, on a
  // poller, handed on). `drain`: all of it, not arming (the socket ended).
  // True when a poller delivered something.
  bool read_ring_locked(Reader who, bool drain);
  // Adopts the segment descriptors a read brought (each adopted and
  // counted or, once one fails or `error` is set, closed).
  bool adopt_descriptors(msghdr& msg, std::string& error);
  bool adopt_fds(std::vector<int> fds, std::string& error);

  // Shared memory: our segments, under write_mu_; the peer's, under read_mu_.
  std::unique_ptr<SegmentWriter> shared_out_;
  std::unique_ptr<SegmentReader> shared_in_;
  // Rings (ring.h). Ours, under write_mu_ (null: our frames go through the
  // socket, and ring_unavailable_ says why). The peer's, under read_mu_,
  // once its first byte brought it; ring_in_ready_ publishes it to pollers.
  // peer_mode_: what that first byte said (written by the loop thread
  // under read_mu_).
  enum class PeerMode { kUnknown, kRing, kStream };
  std::unique_ptr<RingWriter> ring_out_;
  std::string ring_unavailable_;
  bool wait_socket_ = false;  // under write_mu_: a queued write waits for the socket
  std::unique_ptr<RingReader> ring_in_;
  std::atomic<RingReader*> ring_in_ready_{nullptr};
  PeerMode peer_mode_ = PeerMode::kUnknown;
  // The peer said 'N': its socket carries frames, so no wake-ups for our
  // ring's space (set once, by the loop thread; read by writers).
  std::atomic<bool> peer_streams_{false};
  uint64_t fds_adopted_ = 0;  // segment descriptors taken off the socket (under read_mu_)
};

// Where a shm backend is, as the rendezvous publishes it: this boot of this
// machine and this network namespace (abstract sockets live in one); empty
// when either cannot be read. Read once per process.
const std::string& local_host_key();
// The abstract Unix socket address (sun_path[0] == 0) named `name`, and its length.
std::pair<sockaddr_un, socklen_t> abstract_address(const std::string& name);

}  // namespace tandem::rpc
