#include "tandem/rpc/transport/uv/uv_transport.h"

#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/common/dial.h"
#include "tandem/rpc/common/host.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/transport/shm/ring.h"
#include "tandem/rpc/transport/shm/segments.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include <cerrno>
#include <cstdio>
#include <algorithm>
#include <cassert>
#include <cstring>
#include <deque>

namespace tandem::rpc {
namespace {

constexpr size_t kStagingBytes = 64 << 10;
// Below this many bytes left in a tensor, gulp into staging and copy instead.
constexpr size_t kDirectReadMin = 16 << 10;
constexpr int kReadRoundsPerWakeup = 64;
constexpr int kReadRoundsPerPoll = 4;  // a spinning thread reads a little; the rest is the loop's

std::string errno_text(int err) { return std::strerror(err); }

void set_socket_options(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // A peer host that vanishes without a FIN is noticed within ~16 s: by
  // keepalive probes while the connection is idle, and by the user timeout
  // while data sent to it stays unacknowledged.
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 10, interval = 2, count = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  unsigned int user_timeout_ms = 16000;
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

std::string address_of(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

const char kZeros[kTensorAlignment] = {};
// Descriptors one frame may announce; one read takes at most one frame's.
constexpr size_t kMaxFdsPerRead = 64;

}  // namespace

// One frame being written: the iovecs over its buffers and how far we got.
struct PendingWrite {
  // With `shared`, tensors of at least min_shared_tensor_bytes go through
  // its segments where they fit (rpc/transport/shm/segments.h); the frame
  // then carries a table of where they are instead of their bytes.
  PendingWrite(OutFrame&& f, SegmentWriter* shared, const Limits& limits)
      : frame(std::move(f)) {
    if (shared) place_shared(*shared, limits);
    const bool reply = frame.kind == MessageKind::kResponse || frame.kind == MessageKind::kError;
    reply_bytes = reply ? frame.total_bytes() + frame.preamble.table_bytes : 0;
    iov.reserve(3 + 2 * frame.tensors.size());
    iov.push_back({&frame.preamble, kPreambleBytes});
    if (!table.empty()) iov.push_back({table.data(), table.size() * sizeof(SharedRef)});
    iov.push_back({const_cast<char*>(frame.envelope.bytes()), frame.envelope.byte_size()});
    uint64_t offset = 0;
    for (const auto& t : frame.tensors) {
      uint64_t pad = padding_before(offset);
      if (pad) iov.push_back({const_cast<char*>(kZeros), pad});
      uint64_t n = t.nbytes();
      if (n) iov.push_back({t.data_ptr(), n});
      offset += pad + n;
    }
  }

  void place_shared(SegmentWriter& shared, const Limits& limits) {
    std::vector<at::Tensor> body;
    for (size_t i = 0; i < frame.tensors.size(); ++i) {
      const at::Tensor& t = frame.tensors[i];
      std::optional<SharedRef> ref;
      if (t.nbytes() > 0 && t.nbytes() >= limits.min_shared_tensor_bytes &&
          table.size() < kMaxSharedRefs && fds.size() < kMaxFdsPerRead) {
        ref = shared.place(t, static_cast<uint32_t>(i), fds);
      }
      if (ref) {
        table.push_back(*ref);
        shared_bytes += t.nbytes();
      } else {
        if (t.nbytes() >= limits.min_shared_tensor_bytes) ++shared_fallbacks;
        body.push_back(t);
      }
    }
    if (table.empty()) return;
    uint64_t offset = 0;
    for (const auto& t : body) offset += padding_before(offset) + t.nbytes();
    frame.tensors = std::move(body);
    frame.preamble.body_bytes = offset;
    frame.preamble.flags |= kFlagSharedTensors;
    frame.preamble.table_bytes = static_cast<uint32_t>(table.size() * sizeof(SharedRef));
  }

  OutFrame frame;
  std::vector<SharedRef> table;  // tensors placed in shared memory
  uint64_t shared_bytes = 0;     // their bytes
  uint64_t shared_fallbacks = 0;  // large tensors left in the body (pool full or unavailable)
  std::vector<int> fds;          // segments announced with this frame (owned by the writer)
  bool fds_sent = false;
  uint64_t reply_bytes = 0;  // the whole frame when it answers the peer, else 0
  std::vector<iovec> iov;
  size_t next = 0;
};

namespace {

// One recvmsg() of a same-host socket: the bytes into `buf`, with room for
// the segment descriptors that come beside them (taken before the bytes
// are decoded: a frame may use one it brought).
struct LocalRead {
  iovec iov{};
  msghdr msg{};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRead)];
  ssize_t recv(int fd, char* buf, size_t len) {
    iov = {buf, len};
    msg = msghdr{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    return ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  }
};

// Where a shm backend is, as the rendezvous publishes it: this boot of this
// machine and this network namespace (abstract sockets live in one), then
// the socket's name. Read once per process.
const std::string& host_key() {
  static const std::string key = [] {
    const std::string& boot = boot_id();
    char ns[128] = {};
    ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
    if (boot.empty() || n <= 0) return std::string();
    return boot + ":" + std::string(ns, static_cast<size_t>(n));
  }();
  return key;
}

// The abstract Unix socket address (sun_path[0] == 0) named `name`, and its length.
std::pair<sockaddr_un, socklen_t> abstract_address(const std::string& name) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  return {addr, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())};
}



using Clock = std::chrono::steady_clock;
constexpr auto kSweepPeriod = std::chrono::milliseconds(250);
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);
constexpr auto kRingRetry = std::chrono::milliseconds(1);

}  // namespace

struct UvTransport::Loop {
  uv_loop_t loop;
  uv_async_t wake;
  uv_poll_t listen_poll;
  bool listening = false;
  uv_poll_t local_poll;  // the shm backend's same-host listener
  bool local_listening = false;
  uv_timer_t sweep;         // closes handshakes that took too long
  uv_timer_t accept_retry;  // restarts accepting after a back-off (EMFILE)
  uv_timer_t ring_retry;    // full rings whose reader sends no wake-ups (ring.h, 3.)
  bool ring_retry_active = false;
};

class UvConnection final : public Connection, public std::enable_shared_from_this<UvConnection> {
 public:
  UvConnection(UvTransport* transport, int fd, uint64_t id, std::string peer, bool accepted,
               bool local)
      : transport_(transport), fd_(fd), id_(id), peer_(std::move(peer)), accepted_(accepted),
        local_(local), opened_at_(Clock::now()),
        decoder_(transport->limits_, /*handshake_frames=*/accepted ? 2 : 1) {
    poll_.data = nullptr;
    if (local_) {
      if (transport->limits_.max_shared_bytes > 0 && transport->limits_.max_shared_segments > 0) {
        shared_out_ = std::make_unique<SegmentWriter>(transport->limits_);
      }
      shared_in_ = std::make_unique<SegmentReader>(transport->limits_);
      decoder_.set_shared_resolver([in = shared_in_.get()](const SharedRef& ref,
                                                           c10::ScalarType dtype,
                                                           const std::vector<int64_t>& shape,
                                                           uint64_t nbytes) {
        return in->tensor(ref, dtype, shape, nbytes);
      });
      decoder_.set_cuda_ipc(true);  // the peer is on this host (rpc/wire/device.h)
      const uint64_t ring = transport->limits_.shm_ring_bytes;
      ring_unavailable_ = testing::shared_segments_failure();
      if (ring == 0) {
        ring_unavailable_ = "Limits::shm_ring_bytes is 0";
      } else if (ring_unavailable_.empty()) {
        ring_out_ = RingWriter::create(ring, ring_unavailable_);
      }
    }
  }

  // The first byte on a same-host socket (ring.h, 1.): our ring, or that
  // we have none. False (`why`) when the socket would not take it.
  bool send_hello(std::string& why) {
    const char code = ring_out_ ? kRingHello : kNoRingHello;
    std::vector<int> fds;
    if (ring_out_) fds.push_back(ring_out_->fd());
    const int rc = send_code(code, fds);
    if (rc == 1) return true;
    why = rc == 0 ? "the socket would not take its first byte" : errno_text(errno);
    return false;
  }

  // Writes one code byte (with descriptors) to the socket: 1 sent, 0 the
  // socket is full, -1 failed (errno).
  int send_code(char code, const std::vector<int>& fds) {
    iovec iov{&code, 1};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRead)];
    if (!fds.empty()) {
      const size_t fd_bytes = sizeof(int) * fds.size();
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(fd_bytes);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(fd_bytes);
      std::memcpy(CMSG_DATA(c), fds.data(), fd_bytes);
    }
    for (;;) {
      const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n == 1) return 1;
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
      return -1;
    }
  }

  void send(OutFrame&& frame) override {
    std::lock_guard<std::mutex> lock(write_mu_);
    send_locked(std::move(frame));
  }

  void retire(OutFrame&& last) override {
    std::lock_guard<std::mutex> lock(write_mu_);
    send_locked(std::move(last));
    retired_ = true;
  }

  // Requests handed to the layer above and not answered yet.
  uint64_t in_progress() const {
    const uint64_t in = requests_delivered_.load(std::memory_order_acquire);
    const uint64_t out = answers_out_.load(std::memory_order_acquire);
    return in > out ? in - out : 0;
  }

  int64_t answers_owed() const override {
    return static_cast<int64_t>(requests_in_.load(std::memory_order_acquire)) -
           static_cast<int64_t>(answers_out_.load(std::memory_order_acquire));
  }

  void close_when_flushed() override {
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      if (closed_) return;
      if (!queue_.empty()) {
        close_when_flushed_ = true;  // flush_from_loop closes once the queue drains
        return;
      }
    }
    close("");
  }

  // write_mu_ held.
  void send_locked(OutFrame&& frame) {
    // Retired first: one retired and then closed by the peer still sends
    // a late request to the current connection.
    if (retired_ && frame.kind == MessageKind::kRequest) {
      throw RetiredError("connection to " + peer_ + " is retired");  // frame not taken
    }
    if (closed_) throw DisconnectedError("connection to " + peer_ + " is closed");
    const bool answer = frame.kind == MessageKind::kResponse || frame.kind == MessageKind::kError;
    // Placed under the lock: segments are announced in the order frames
    // are written, which is the order the peer numbers them in.
    auto w = std::make_unique<PendingWrite>(std::move(frame), shared_out_.get(), transport_->limits_);
    if (shared_out_) transport_->count_shared(*w, shared_out_->unavailable(), peer_);
    transport_->stats_bytes_sent_.fetch_add(w->frame.total_bytes() + w->frame.preamble.table_bytes,
                                            std::memory_order_relaxed);
    if (answer) {
      answers_out_.fetch_add(1, std::memory_order_release);
      // Held for too many unanswered requests (uv_transport.h, 5.): resume
      // once half of them are answered.
      if (paused_flag_.load(std::memory_order_acquire) &&
          in_progress() <= transport_->limits_.max_unanswered_requests / 2) {
        auto self = shared_from_this();
        transport_->post([self] { self->transport_->resume_from_loop(self); });
      }
    }
    if (queue_.empty()) {
      if (write_some(*w)) return;
    }
    queued_reply_bytes_.fetch_add(w->reply_bytes, std::memory_order_relaxed);
    queue_.push_back(std::move(w));
    if (!want_writable_) {
      want_writable_ = true;
      auto self = shared_from_this();
      transport_->post([self] { self->update_poll_from_loop(); });
    }
  }

  void close(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      if (closed_) return;
      closed_ = true;
      clear_queue_locked();
    }
    auto self = shared_from_this();
    transport_->post([self, reason] { self->transport_->close_from_loop(self, reason); });
  }

  uint64_t id() const override { return id_; }
  const char* kind() const override { return local_ ? "shm" : "tcp"; }

  // rpc/transport.h, 8.
  bool poll_inline() override {
    if (!inline_ok_.load(std::memory_order_acquire) || no_polling_here()) return false;
    if (RingReader* ring = ring_in_ready_.load(std::memory_order_acquire)) {
      enter_polling_spin(ring);
      // A look at two counters instead of a system call.
      if (!ring->maybe_readable()) return false;
    }
    std::unique_lock<std::mutex> lock(read_mu_, std::try_to_lock);
    if (!lock.owns_lock() || !inline_ok_.load(std::memory_order_acquire)) return false;
    return transport_->read_inline(shared_from_this());
  }
  // True where polling must not happen: on the loop thread (it reads
  // anyway, holding read_mu_), and inside a poll's own deliveries.
  static bool& no_polling_here() {
    thread_local bool inside = false;
    return inside;
  }
  bool closed() override {
    std::lock_guard<std::mutex> lock(write_mu_);
    return closed_;
  }

  // Inside a PollingSpin (transport.h), this thread counts as reading the
  // ring until the spin ends (ring.h, 3.): writers need not wake the loop.
  void enter_polling_spin(RingReader* ring);
  // The spin ended: hands what it left in the ring to the loop thread.
  void leave_polling_spin() {
    RingReader* ring = ring_in_ready_.load(std::memory_order_acquire);
    ring->leave_polling();
    if (ring->maybe_readable()) {
      auto self = shared_from_this();
      transport_->post([self] { self->transport_->read_from_loop(self); });
    }
  }
  std::string peer_address() const override { return peer_; }

  // Writes as much of `w` as the socket takes now. True when all of it went.
  // Caller holds write_mu_. On a hard socket error, marks the connection
  // closed, asks the loop to close it, and throws DisconnectedError.
  bool write_some(PendingWrite& w) {
    if (ring_out_) return write_ring(w);
    while (w.next < w.iov.size()) {
      msghdr msg{};
      msg.msg_iov = &w.iov[w.next];
      msg.msg_iovlen = std::min<size_t>(w.iov.size() - w.next, IOV_MAX);
      // New segments' descriptors ride on the frame's first bytes.
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRead)];
      if (!w.fds.empty() && !w.fds_sent) {
        const size_t fd_bytes = sizeof(int) * w.fds.size();
        msg.msg_control = control;
        msg.msg_controllen = CMSG_SPACE(fd_bytes);
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(fd_bytes);
        std::memcpy(CMSG_DATA(c), w.fds.data(), fd_bytes);
      }
      ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) w.fds_sent = true;
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
        const std::string reason = "write to " + peer_ + " failed: " + errno_text(errno);
        closed_ = true;
        clear_queue_locked();
        auto self = shared_from_this();
        transport_->post([self, reason] { self->transport_->close_from_loop(self, reason); });
        throw DisconnectedError(reason);
      }
      size_t left = static_cast<size_t>(n);
      while (left > 0 && left >= w.iov[w.next].iov_len) {
        left -= w.iov[w.next].iov_len;
        ++w.next;
      }
      if (left > 0) {
        w.iov[w.next].iov_base = static_cast<char*>(w.iov[w.next].iov_base) + left;
        w.iov[w.next].iov_len -= left;
      }
    }
    return true;
  }

  // Marks the connection closed after a failed write, asks the loop to
  // close it, and throws DisconnectedError (write_mu_ held).
  [[noreturn]] void fail_write_locked(const std::string& reason) {
    closed_ = true;
    clear_queue_locked();
    auto self = shared_from_this();
    transport_->post([self, reason] { self->transport_->close_from_loop(self, reason); });
    throw DisconnectedError(reason);
  }

  // write_some() through our ring (ring.h): descriptors on the socket first,
  // then the bytes, waking the reader where it sleeps. False when the ring
  // is full (the reader's 'W' brings the loop back) or the socket would not
  // take the descriptors (wait_socket_: it waits for writable).
  bool write_ring(PendingWrite& w) {
    wait_socket_ = false;
    if (!w.fds.empty() && !w.fds_sent) {
      const int rc = send_code(kRingFds, w.fds);
      if (rc < 0) fail_write_locked("write to " + peer_ + " failed: " + errno_text(errno));
      if (rc == 0) {
        wait_socket_ = true;
        return false;
      }
      w.fds_sent = true;
      ring_out_->announce(w.fds.size());
    }
    try {
      bool unpublished = false;
      while (w.next < w.iov.size()) {
        iovec& v = w.iov[w.next];
        const size_t k = ring_out_->write(static_cast<const char*>(v.iov_base), v.iov_len);
        unpublished |= k > 0;
        if (k == v.iov_len) {
          ++w.next;
          continue;
        }
        v.iov_base = static_cast<char*>(v.iov_base) + k;
        v.iov_len -= k;
        // Full: what is in goes out now, and the reader calls us back.
        if (unpublished) publish_locked();
        unpublished = false;
        if (!ring_out_->wait_for_space()) {
          // A peer without a ring of its own sends frames on the socket,
          // and no 'W': the loop looks again on a timer.
          if (peer_streams_.load(std::memory_order_acquire)) retry_ring_later();
          return false;
        }
      }
      if (unpublished) publish_locked();
    } catch (const ProtocolError& e) {
      fail_write_locked("protocol error from " + peer_ + ": " + e.what());
    }
    return true;
  }

  // Makes what the ring holds visible, and wakes the reader if it sleeps.
  void publish_locked() {
    ring_out_->publish();
    if (!ring_out_->reader_needs_wake()) return;
    transport_->stats_ring_wakes_.fetch_add(1, std::memory_order_relaxed);
    // A full socket already holds wake-ups; a dead peer shows on the loop.
    (void)send_code(kRingWake, {});
  }

  void clear_queue_locked() {
    queue_.clear();
    queued_reply_bytes_.store(0, std::memory_order_relaxed);
  }

  void flush_from_loop() {
    std::lock_guard<std::mutex> lock(write_mu_);
    flush_locked();
  }

  // Asks the loop to try the queued writes again in a moment.
  void retry_ring_later() {
    auto self = shared_from_this();
    transport_->post([self] { self->transport_->retry_ring_from_loop(self); });
  }

  // A ring's writes wait for the reader's 'W', which comes as readable.
  void flush_if_queued_from_loop() {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (!queue_.empty()) flush_locked();
  }

  void flush_locked() {
    try {
      while (!queue_.empty()) {
        if (!write_some(*queue_.front())) {
          if (ring_out_) start_poll_locked();  // writable wanted only for the socket
          return;
        }
        queued_reply_bytes_.fetch_sub(queue_.front()->reply_bytes, std::memory_order_relaxed);
        queue_.pop_front();
      }
    } catch (const DisconnectedError&) {
      return;  // the close is already posted
    }
    want_writable_ = false;
    start_poll_locked();
    if (close_when_flushed_ && !closed_) {
      closed_ = true;
      auto self = shared_from_this();
      transport_->post([self] { self->transport_->close_from_loop(self, ""); });
    }
  }

  void update_poll_from_loop() {
    std::lock_guard<std::mutex> lock(write_mu_);
    start_poll_locked();
  }

  void start_poll_locked() {
    if (!polling_ || loop_closed_) return;  // never re-arm a handle that is closing
    // With a ring, the socket brings the peer's wake-ups (ring.h, 3.), which
    // are read also while the ring itself is not; it is wanted writable only
    // for descriptors it would not take.
    const bool readable = !reading_stopped_ || peer_mode_ == PeerMode::kRing;
    const bool writable = want_writable_ && (!ring_out_ || wait_socket_);
    int events = (readable ? UV_READABLE : 0) | (writable ? UV_WRITABLE : 0);
    uv_poll_start(&poll_, events, &UvConnection::on_poll);
  }

  static void on_poll(uv_poll_t* handle, int status, int events) {
    auto* raw = static_cast<UvConnection*>(handle->data);
    auto self = raw->shared_from_this();
    if (status < 0) {
      // libuv reports a socket error (POLLERR) as UV_EBADF; the socket
      // itself knows what happened (a reset, a timeout, a refused dial).
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(raw->fd_, SOL_SOCKET, SO_ERROR, &err, &len);
      std::string what = err == ECONNRESET  ? "connection reset by " + raw->peer_
                         : err == EPIPE     ? "connection closed by " + raw->peer_
                         : err == ETIMEDOUT ? "connection to " + raw->peer_ + " timed out"
                         : err != 0 ? "connection to " + raw->peer_ + " failed: " + errno_text(err)
                                    : "connection to " + raw->peer_ + " failed: " +
                                          uv_strerror(status);
      raw->transport_->close_from_loop(self, what);
      return;
    }
    if (events & UV_WRITABLE) {
      self->flush_from_loop();
      if (self->paused_) self->transport_->resume_from_loop(self);
    }
    if ((events & UV_READABLE) && !self->loop_closed_) self->transport_->read_from_loop(self);
  }

  UvTransport* transport_;
  int fd_;
  uint64_t id_;
  std::string peer_;
  const bool accepted_;
  const bool local_;  // a same-host socket of the shm backend
  const Clock::time_point opened_at_;
  // Shared memory (local_ only): our segments, under write_mu_; the peer's,
  // on the loop thread.
  std::unique_ptr<SegmentWriter> shared_out_;
  std::unique_ptr<SegmentReader> shared_in_;
  // Rings (local_ only; rpc/transport/shm/ring.h). Ours, under write_mu_
  // (null: our frames go through the socket, and ring_unavailable_ says
  // why). The peer's, under read_mu_, once its first byte brought it;
  // ring_in_ready_ publishes it to pollers. peer_mode_: what that first
  // byte said (written by the loop thread under read_mu_).
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

  // Reading: the loop thread, or one polling thread (8.), holds read_mu_
  // while it reads, decodes and delivers; the decoder, the peer's segments
  // and deferred_ are under it. inline_ok_: pollers may read (handshake
  // done, not paused, nothing deferred, not closed), set under read_mu_.
  std::mutex read_mu_;
  std::atomic<bool> inline_ok_{false};
  std::deque<Message> deferred_;  // a poll's messages for the loop thread, in order

  // Loop thread only.
  uv_poll_t poll_;
  bool polling_ = false;
  bool loop_closed_ = false;
  bool counted_handshaking_ = false;  // in UvTransport::handshaking_
  FrameDecoder decoder_;
  // Backpressure (uv_transport.h, 5.): while our answers to this peer pile
  // up unwritten, what it sends is held here, in order, and past
  // Limits::max_held_bytes the socket is not read at all.
  bool paused_ = false;
  bool reading_stopped_ = false;
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

namespace {
// A thread's PollingSpin (rpc/transport.h): how deep, and the connection
// whose ring it counts itself in as a poller (ring.h, 3.).
struct SpinState {
  int depth = 0;
  std::shared_ptr<UvConnection> entered;
};
SpinState& spin_state() {
  thread_local SpinState state;
  return state;
}
}  // namespace

void UvConnection::enter_polling_spin(RingReader* ring) {
  SpinState& s = spin_state();
  if (s.depth == 0 || s.entered.get() == this) return;
  if (s.entered) std::exchange(s.entered, nullptr)->leave_polling_spin();
  s.entered = shared_from_this();
  ring->enter_polling();
}

PollingSpin::PollingSpin() { ++spin_state().depth; }

PollingSpin::~PollingSpin() {
  SpinState& s = spin_state();
  if (--s.depth == 0 && s.entered) std::exchange(s.entered, nullptr)->leave_polling_spin();
}

UvTransport::UvTransport(Limits limits, Callbacks callbacks, bool shared_memory)
    : limits_(limits), callbacks_(std::move(callbacks)), shared_memory_(shared_memory),
      loop_(std::make_unique<Loop>()), staging_(kStagingBytes) {
  uv_loop_init(&loop_->loop);
  loop_->wake.data = this;
  uv_async_init(&loop_->loop, &loop_->wake, [](uv_async_t* h) {
    static_cast<UvTransport*>(h->data)->run_commands();
  });
  loop_->sweep.data = this;
  uv_timer_init(&loop_->loop, &loop_->sweep);
  const auto period = static_cast<uint64_t>(kSweepPeriod.count());
  uv_timer_start(&loop_->sweep, [](uv_timer_t* h) {
    static_cast<UvTransport*>(h->data)->sweep_handshakes_from_loop();
  }, period, period);
  loop_->accept_retry.data = this;
  uv_timer_init(&loop_->loop, &loop_->accept_retry);
  loop_->ring_retry.data = this;
  uv_timer_init(&loop_->loop, &loop_->ring_retry);
  thread_ = std::thread([this] {
    UvConnection::no_polling_here() = true;
    uv_run(&loop_->loop, UV_RUN_DEFAULT);
  });
  thread_id_ = thread_.get_id();
}

UvTransport::~UvTransport() { close(); }

bool UvTransport::post(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (loop_gone_) return false;
  commands_.push_back(std::move(fn));
  uv_async_send(&loop_->wake);
  return true;
}

void UvTransport::run_commands() {
  std::vector<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cmds.swap(commands_);
  }
  for (auto& c : cmds) c();
}

int UvTransport::listen(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port_s = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port_s.c_str(), &hints, &res);
  if (rc != 0) {
    throw std::invalid_argument("cannot resolve listen address '" + host + "': " + gai_strerror(rc));
  }
  int fd = -1;
  std::string err;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) break;
    err = errno_text(errno);
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd < 0) throw std::runtime_error("cannot listen on " + host + ":" + port_s + ": " + err);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  int bound = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (!start_listening(fd, /*local=*/false)) throw ShutdownError("transport is closed");
  if (shared_memory_) listen_local();
  return bound;
}

bool UvTransport::start_listening(int fd, bool local) {
  bool posted = post([this, fd, local] {
    if (stopped_) {
      ::close(fd);
      return;
    }
    (local ? local_fd_ : listen_fd_) = fd;
    uv_poll_t& poll = local ? loop_->local_poll : loop_->listen_poll;
    poll.data = this;
    uv_poll_init_socket(&loop_->loop, &poll, fd);
    (local ? loop_->local_listening : loop_->listening) = true;
    watch_listener_from_loop();
  });
  if (!posted) ::close(fd);
  return posted;
}

void UvTransport::listen_local() {
  // An abstract socket: no file to leave behind, and only this network
  // namespace can reach it (which is what "the same host" means here).
  const std::string& key = host_key();
  if (key.empty()) {
    std::fprintf(stderr, "tandem: no same-host endpoint (cannot read this host's boot id or "
                         "network namespace); peers on this host use TCP\n");
    return;
  }
  const std::string name = "tandem-" + random_hex(8);
  const auto [addr, len] = abstract_address(name);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0 ||
      ::listen(fd, 1024) != 0) {
    std::fprintf(stderr, "tandem: no same-host endpoint (%s); peers on this host use TCP\n",
                 errno_text(errno).c_str());
    if (fd >= 0) ::close(fd);
    return;
  }
  if (!start_listening(fd, /*local=*/true)) return;
  std::lock_guard<std::mutex> lock(mu_);
  local_endpoint_ = "shm:" + key + ":" + name;
  local_name_ = name;
}

std::string UvTransport::local_endpoint() const {
  std::lock_guard<std::mutex> lock(mu_);
  return local_endpoint_;
}

ConnectionPtr UvTransport::connect_local(const std::string& endpoint,
                                         std::chrono::milliseconds timeout) {
  const auto cut = endpoint.rfind(':');
  if (endpoint.rfind("shm:", 0) != 0 || cut == std::string::npos || cut < 4) {
    throw std::invalid_argument("not a same-host endpoint: '" + endpoint + "'");
  }
  if (!shared_memory_) return nullptr;
  if (endpoint.substr(4, cut - 4) != host_key()) return nullptr;  // another host or namespace
  const std::string name = endpoint.substr(cut + 1);
  if (name.empty() || name.size() + 1 > sizeof(sockaddr_un::sun_path)) {
    throw std::invalid_argument("bad same-host endpoint name in '" + endpoint + "'");
  }
  const auto [addr, len] = abstract_address(name);
  const auto deadline = Clock::now() + timeout;
  int fd = -1;
  for (;;) {
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw DisconnectedError("cannot make a socket: " + errno_text(errno));
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) == 0) break;
    const int err = errno;
    ::close(fd);
    fd = -1;
    // A full backlog answers EAGAIN; try again until the timeout.
    if ((err == EAGAIN || err == EINTR) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    throw DisconnectedError("cannot connect to @" + name + ": " + errno_text(err));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::shared_ptr<UvConnection> conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conn = std::make_shared<UvConnection>(this, fd, next_id_++, "shm:@" + name,
                                          /*accepted=*/false, /*local=*/true);
  }
  std::string why;
  if (!say_hello(*conn, why)) {
    ::close(fd);
    throw DisconnectedError("cannot open a same-host connection to @" + name + ": " + why);
  }
  if (!post([this, conn] { adopt_from_loop(conn); })) {
    ::close(fd);
    throw ShutdownError("transport is closed");
  }
  return conn;
}

bool UvTransport::say_hello(UvConnection& conn, std::string& why) {
  if (!conn.ring_out_ && limits_.shm_ring_bytes > 0 && !ring_unavailable_logged_.exchange(true)) {
    std::fprintf(stderr,
                 "tandem: same-host rings unavailable (%s); frames to %s and others go through "
                 "the socket (logged once)\n",
                 printable(conn.ring_unavailable_).c_str(), printable(conn.peer_).c_str());
  }
  return conn.send_hello(why);
}

void UvTransport::count_shared(const PendingWrite& w, const std::string& unavailable,
                               const std::string& peer) {
  stats_shared_tensors_ += w.table.size();
  stats_shared_bytes_ += w.shared_bytes;
  stats_shared_fallbacks_ += w.shared_fallbacks;
  if (!unavailable.empty() && !shared_unavailable_logged_.exchange(true)) {
    std::fprintf(stderr,
                 "tandem: shared memory segments unavailable (%s); large tensors to %s and "
                 "others go through the socket (logged once)\n",
                 printable(unavailable).c_str(), printable(peer).c_str());
  }
}

ConnectionPtr UvTransport::connect(const std::string& host, int port,
                                   std::chrono::milliseconds timeout) {
  const std::string where = host + ":" + std::to_string(port);
  const Dialed dialed = dial_tcp(host, port, timeout);
  if (dialed.fd < 0) throw DisconnectedError(dialed.why);
  const int fd = dialed.fd;
  set_socket_options(fd);
  std::shared_ptr<UvConnection> conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conn = std::make_shared<UvConnection>(this, fd, next_id_++, where, /*accepted=*/false,
                                          /*local=*/false);
  }
  if (!post([this, conn] { adopt_from_loop(conn); })) {
    ::close(fd);
    throw ShutdownError("transport is closed");
  }
  return conn;
}

void UvTransport::watch_listener_from_loop() {
  if (loop_->listening) {
    uv_poll_start(&loop_->listen_poll, UV_READABLE, [](uv_poll_t* h, int status, int) {
      if (status >= 0) static_cast<UvTransport*>(h->data)->accept_from_loop(false);
    });
  }
  if (loop_->local_listening) {
    uv_poll_start(&loop_->local_poll, UV_READABLE, [](uv_poll_t* h, int status, int) {
      if (status >= 0) static_cast<UvTransport*>(h->data)->accept_from_loop(true);
    });
  }
}

void UvTransport::accept_from_loop(bool local) {
  assert(on_transport_thread());
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = ::accept4(local ? local_fd_ : listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the
      // pending connection stays queued and the listener stays readable, so
      // polling it again at once would spin. Stop watching it for a moment.
      ++stats_accept_backoffs_;
      if (!accept_error_logged_) {
        accept_error_logged_ = true;
        std::fprintf(stderr,
                     "tandem: accepting a connection failed: %s; not accepting for %d ms at a "
                     "time while it lasts (logged once)\n",
                     errno_text(err).c_str(), static_cast<int>(kAcceptBackoff.count()));
      }
      if (loop_->listening) uv_poll_stop(&loop_->listen_poll);
      if (loop_->local_listening) uv_poll_stop(&loop_->local_poll);
      uv_timer_start(&loop_->accept_retry, [](uv_timer_t* h) {
        static_cast<UvTransport*>(h->data)->watch_listener_from_loop();
      }, static_cast<uint64_t>(kAcceptBackoff.count()), 0);
      return;
    }
    if (handshaking_ >= limits_.max_handshaking_connections) {
      // Connections that have not finished their handshake are capped: a
      // crowd of them (slow-loris) cannot hold the descriptors a worker needs.
      ++stats_refused_;
      ::close(fd);
      continue;
    }
    if (!local) set_socket_options(fd);
    std::shared_ptr<UvConnection> conn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint64_t id = next_id_++;
      conn = std::make_shared<UvConnection>(
          this, fd, id,
          local ? "shm:@" + local_name_ + "#" + std::to_string(id)
                : address_of(reinterpret_cast<sockaddr*>(&ss)),
          /*accepted=*/true, local);
    }
    std::string why;
    if (local && !say_hello(*conn, why)) {
      ::close(fd);
      continue;
    }
    adopt_from_loop(conn);
  }
}

void UvTransport::adopt_from_loop(const std::shared_ptr<UvConnection>& conn) {
  assert(on_transport_thread());
  if (stopped_) {  // raced with close(): nothing is registered, just drop the socket
    {
      std::lock_guard<std::mutex> lock(conn->write_mu_);
      conn->closed_ = true;
    }
    ::close(conn->fd_);
    return;
  }
  conns_[conn->id()] = conn;
  ++live_connections_;
  if (conn->accepted_) {
    conn->counted_handshaking_ = true;
    ++handshaking_;
  }
  conn->poll_.data = conn.get();
  uv_poll_init_socket(&loop_->loop, &conn->poll_, conn->fd_);
  conn->polling_ = true;
  {
    std::lock_guard<std::mutex> lock(conn->write_mu_);
    if (conn->closed_) {
      // close() or a failed write ran before the loop saw this connection;
      // its close command is queued behind us and finishes the job.
      return;
    }
    conn->start_poll_locked();
  }
}

bool UvTransport::would_pause(const UvConnection& conn) const {
  return conn.queued_reply_bytes_.load(std::memory_order_relaxed) > limits_.max_queued_reply_bytes ||
         conn.in_progress() >= limits_.max_unanswered_requests;
}

void UvTransport::update_inline_locked(const std::shared_ptr<UvConnection>& conn) {
  conn->inline_ok_.store(conn->local_ && limits_.poll_while_spinning && conn->polling_ &&
                             !conn->loop_closed_ && !conn->paused_ && !conn->reading_stopped_ &&
                             conn->deferred_.empty() && !conn->decoder_.in_handshake() &&
                             static_cast<bool>(callbacks_.inline_ok),
                         std::memory_order_release);
}

void UvTransport::deliver_deferred_locked(const std::shared_ptr<UvConnection>& conn) {
  std::deque<Message> deferred = std::move(conn->deferred_);
  conn->deferred_.clear();
  for (auto& m : deferred) {
    if (conn->loop_closed_) return;
    deliver_from_loop(conn, std::move(m));
  }
}

bool UvTransport::feed_decoder(UvConnection& conn, bool direct, const char* buf, size_t n,
                               std::string& error) {
  try {
    if (direct) {
      conn.decoder_.direct_commit(n);
    } else {
      conn.decoder_.feed(buf, n);
    }
    return true;
  } catch (const std::exception& e) {
    error = e.what();
    return false;
  }
}

Message UvTransport::take_message(UvConnection& conn) {
  Message m = conn.decoder_.take();
  stats_bytes_received_.fetch_add(m.wire_bytes, std::memory_order_relaxed);
  if (m.kind == MessageKind::kRequest && m.id != 0) {
    conn.requests_in_.fetch_add(1, std::memory_order_release);  // an answer is owed
  }
  return m;
}

bool UvTransport::read_inline(const std::shared_ptr<UvConnection>& conn) {
  // As read_from_loop, on a spinning thread: what it cannot finish (the
  // peer closed, a protocol error, a message the agent wants on its loop
  // thread, backpressure) it leaves to the loop thread.
  if (conn->peer_mode_ == UvConnection::PeerMode::kRing) {
    return read_ring_locked(conn, /*poller=*/true, /*drain=*/false);
  }
  thread_local std::vector<char> staging(kStagingBytes);
  bool delivered = false;
  auto give_up = [&](const std::string& close_reason) { hand_to_loop(conn, close_reason); };
  for (int round = 0; round < kReadRoundsPerPoll; ++round) {
    auto [direct, want] = conn->decoder_.direct_target(kDirectReadMin);
    char* buf = direct ? direct : staging.data();
    size_t len = direct ? want : staging.size();
    LocalRead read;
    const ssize_t n = read.recv(conn->fd_, buf, len);
    if (n < 0 && errno == EINTR) continue;
    // Nothing there (or the end, or an error: the loop thread reads that
    // itself and closes).
    if (n <= 0) return delivered;
    std::string error;
    if (!adopt_descriptors(conn, read.msg, error) ||
        !feed_decoder(*conn, direct != nullptr, buf, static_cast<size_t>(n), error)) {
      give_up("protocol error from " + conn->peer_ + ": " + error);
      return delivered;
    }
    while (conn->decoder_.has_message()) {
      delivered |= deliver_inline_locked(conn, take_message(*conn));
    }
    if (!conn->deferred_.empty()) {
      give_up("");
      return delivered;
    }
    if (static_cast<size_t>(n) < len) return delivered;  // drained
  }
  return delivered;
}

void UvTransport::hand_to_loop(const std::shared_ptr<UvConnection>& conn,
                               const std::string& close_reason) {
  conn->inline_ok_.store(false, std::memory_order_release);
  post([this, conn, close_reason] {
    if (!close_reason.empty()) {
      close_from_loop(conn, close_reason);
    } else if (conn->peer_mode_ == UvConnection::PeerMode::kRing) {
      read_from_loop(conn);  // the deferred first, then what the ring still holds
    } else {
      std::lock_guard<std::mutex> lock(conn->read_mu_);
      deliver_deferred_locked(conn);
      update_inline_locked(conn);
    }
  });
}

bool UvTransport::deliver_inline_locked(const std::shared_ptr<UvConnection>& conn, Message&& m) {
  const bool request = m.kind == MessageKind::kRequest && m.id != 0;
  if (!conn->deferred_.empty() || would_pause(*conn) || !callbacks_.inline_ok(m)) {
    conn->deferred_.push_back(std::move(m));
    return false;
  }
  if (request) conn->requests_delivered_.fetch_add(1, std::memory_order_release);
  {
    struct Inside {  // a callback that polls again reads nothing
      bool& flag = UvConnection::no_polling_here();
      Inside() { flag = true; }
      ~Inside() { flag = false; }
    } inside;
    callbacks_.on_message(conn, std::move(m));
  }
  stats_polled_messages_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void UvTransport::read_from_loop(const std::shared_ptr<UvConnection>& conn) {
  assert(on_transport_thread());
  if (conn->loop_closed_) return;  // a late post
  {
    std::lock_guard<std::mutex> read_lock(conn->read_mu_);
    deliver_deferred_locked(conn);  // what a poll left comes first
    if (conn->local_ && !conn->loop_closed_) {
      std::string error;
      if (!read_codes_locked(conn, /*poller=*/false, error)) return;
    }
    if (conn->loop_closed_) return;
    if (conn->peer_mode_ == UvConnection::PeerMode::kRing) {
      read_ring_locked(conn, /*poller=*/false, /*drain=*/false);
    } else if (!conn->local_ || conn->peer_mode_ == UvConnection::PeerMode::kStream) {
      read_some_from_loop(conn);
    }
    update_inline_locked(conn);
  }
  // Our ring's writes that waited for space go on: the peer's 'W' came.
  if (conn->ring_out_ && !conn->loop_closed_) conn->flush_if_queued_from_loop();
}

namespace {
// The descriptors a recvmsg() brought, in order; false when some were cut
// off (more than a frame may announce).
bool collect_descriptors(msghdr& msg, std::vector<int>& fds) {
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.push_back(fd);
    }
  }
  return (msg.msg_flags & MSG_CTRUNC) == 0;
}
}  // namespace

bool UvTransport::read_codes_locked(const std::shared_ptr<UvConnection>& conn, bool poller,
                                    std::string& error) {
  using PeerMode = UvConnection::PeerMode;
  std::vector<int> fds;
  auto fail = [&](const std::string& why) {
    for (int fd : fds) ::close(fd);
    error = "protocol error from " + conn->peer_ + ": " + why;
    if (!poller) close_from_loop(conn, error);
    return false;
  };
  char buf[256];
  bool woke = false;
  struct PassOn {
    UvTransport* t;
    const std::shared_ptr<UvConnection>& conn;
    bool& woke;
    ~PassOn() {
      if (woke) t->post([t = t, conn = conn] { t->read_from_loop(conn); });
    }
  } pass_on{this, conn, woke};
  while (conn->peer_mode_ != PeerMode::kStream) {
    const bool hello = conn->peer_mode_ == PeerMode::kUnknown;
    LocalRead read;
    const ssize_t n = read.recv(conn->fd_, buf, hello ? 1 : sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) {
      if (poller) return false;  // the loop thread sees the end too, and closes
      const int err = n < 0 ? errno : 0;
      if (conn->peer_mode_ == PeerMode::kRing) {
        // What the peer wrote before it went is delivered first, as TCP does.
        read_ring_locked(conn, /*poller=*/false, /*drain=*/true);
        if (conn->loop_closed_) return false;
      }
      close_from_loop(conn, end_of_reading(*conn, err));
      return false;
    }
    fds.clear();
    if (!collect_descriptors(read.msg, fds)) return fail("more descriptors than a frame may announce");
    if (hello) {
      if (buf[0] == kRingHello && fds.size() == 1) {
        const int fd = fds[0];
        fds.clear();
        try {
          conn->ring_in_ = std::make_unique<RingReader>(fd, limits_.max_ring_bytes);
        } catch (const std::exception& e) {
          return fail(e.what());
        }
        conn->peer_mode_ = PeerMode::kRing;
        conn->ring_in_ready_.store(conn->ring_in_.get(), std::memory_order_release);
        continue;
      }
      if (buf[0] == kNoRingHello && fds.empty()) {
        conn->peer_mode_ = PeerMode::kStream;
        if (conn->ring_out_) {
          // Writes that found our ring full before this byte came wait for
          // a 'W' that this peer cannot send (its socket carries frames).
          std::lock_guard<std::mutex> write_lock(conn->write_mu_);
          conn->peer_streams_.store(true, std::memory_order_release);
          if (!conn->queue_.empty()) conn->retry_ring_later();
        }
        return true;
      }
      return fail("a same-host connection must open with its ring or 'N', not byte " +
                  std::to_string(static_cast<unsigned char>(buf[0])) + " with " +
                  std::to_string(fds.size()) + " descriptor(s)");
    }
    size_t carriers = 0;
    for (ssize_t i = 0; i < n; ++i) {
      if (buf[i] == kRingFds) {
        ++carriers;
      } else if (buf[i] == kRingWake) {
        // A poller that takes a wake-up meant for the loop thread (ours to
        // read the ring, or our writes' to go on) passes it on.
        if (poller) woke = true;
      } else {
        return fail("byte " + std::to_string(static_cast<unsigned char>(buf[i])) +
                    " on a ring's socket");
      }
    }
    if ((carriers == 0) != fds.empty()) return fail("descriptors without their 'F' byte");
    std::string why;
    if (!adopt_fds(conn, std::exchange(fds, {}), why)) return fail(why);
  }
  return true;
}

bool UvTransport::read_ring_locked(const std::shared_ptr<UvConnection>& conn, bool poller,
                                   bool drain) {
  thread_local std::vector<char> staging(kStagingBytes);
  RingReader& ring = *conn->ring_in_;
  bool delivered = false;
  std::string error;
  auto fail = [&] {
    const std::string reason = "protocol error from " + conn->peer_ + ": " + error;
    if (poller) {
      hand_to_loop(conn, reason);
    } else {
      close_from_loop(conn, reason);
    }
    return delivered;
  };
  const int rounds = poller ? kReadRoundsPerPoll : kReadRoundsPerWakeup;
  // A drain (the socket ended) takes what the ring held then, no more: a
  // peer that goes on writing into it cannot keep this thread.
  uint64_t drain_left = 0;
  if (drain) {
    try {
      drain_left = ring.readable();
    } catch (const std::exception& e) {
      error = e.what();
      return fail();
    }
  }
  for (int round = 0; drain || round < rounds; ++round) {
    if (conn->loop_closed_ || (!drain && conn->reading_stopped_)) return delivered;
    uint64_t avail = 0;
    try {
      avail = ring.readable();
    } catch (const std::exception& e) {
      error = e.what();
      return fail();
    }
    if (drain) avail = std::min(avail, drain_left);
    if (avail == 0) {
      // Asleep from here on, woken by the writer's 'W' (ring.h, 3.); a
      // poller or a drain just stops.
      if (poller || drain || !ring.arm()) return delivered;
      continue;
    }
    if (ring.announced() > conn->fds_adopted_) {
      // The descriptors first (ring.h, 4.); once the socket has ended
      // (drain), none will come.
      if (!drain && !read_codes_locked(conn, poller, error)) {
        if (!poller || error.empty()) return delivered;  // closed, or the end left to the loop
        hand_to_loop(conn, error);
        return delivered;
      }
      if (ring.announced() > conn->fds_adopted_) {
        error = "ring announced " + std::to_string(ring.announced()) +
                " segment descriptor(s); " + std::to_string(conn->fds_adopted_) + " came";
        return fail();
      }
    }
    auto [direct, want] = conn->decoder_.direct_target(kDirectReadMin);
    char* buf = direct ? direct : staging.data();
    const size_t len =
        static_cast<size_t>(std::min<uint64_t>(avail, direct ? want : staging.size()));
    ring.read(buf, len);
    if (drain) drain_left -= len;
    // Without a ring of our own our socket carries frames, not codes: the
    // writer then looks for space on its own.
    if (conn->ring_out_ && ring.writer_needs_wake()) {
      stats_ring_wakes_.fetch_add(1, std::memory_order_relaxed);
      (void)conn->send_code(kRingWake, {});
    }
    if (!feed_decoder(*conn, direct != nullptr, buf, len, error)) return fail();
    if (!poller) {
      deliver_decoded_from_loop(conn);
    } else {
      while (conn->decoder_.has_message() && !conn->loop_closed_) {
        delivered |= deliver_inline_locked(conn, take_message(*conn));
      }
    }
    if (poller && !conn->deferred_.empty()) {
      hand_to_loop(conn, "");
      return delivered;
    }
  }
  // Out of rounds with bytes left: on, after the loop's other work.
  if (!poller && !conn->loop_closed_) {
    post([this, conn] { read_from_loop(conn); });
  }
  return delivered;
}

void UvTransport::retry_ring_from_loop(const std::shared_ptr<UvConnection>& conn) {
  assert(on_transport_thread());
  if (stopped_ || conn->loop_closed_) return;
  ring_retry_.push_back(conn);
  if (loop_->ring_retry_active) return;
  loop_->ring_retry_active = true;
  uv_timer_start(&loop_->ring_retry, [](uv_timer_t* h) {
    auto* t = static_cast<UvTransport*>(h->data);
    t->loop_->ring_retry_active = false;
    // A write that finds the ring still full asks again (write_ring).
    std::vector<std::weak_ptr<UvConnection>> due = std::move(t->ring_retry_);
    t->ring_retry_.clear();
    for (auto& weak : due) {
      if (auto c = weak.lock(); c && !c->loop_closed_) c->flush_if_queued_from_loop();
    }
  }, kRingRetry.count(), 0);
}

void UvTransport::read_some_from_loop(const std::shared_ptr<UvConnection>& conn) {
  for (int round = 0; round < kReadRoundsPerWakeup && !conn->loop_closed_ && !conn->reading_stopped_;
       ++round) {
    auto [direct, want] = conn->decoder_.direct_target(kDirectReadMin);
    char* buf = direct ? direct : staging_.data();
    size_t len = direct ? want : staging_.size();
    ssize_t n;
    if (conn->local_) {
      LocalRead read;
      n = read.recv(conn->fd_, buf, len);
      if (n >= 0 && !take_descriptors(conn, read.msg)) return;
    } else {
      n = ::recv(conn->fd_, buf, len, MSG_DONTWAIT);
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      close_from_loop(conn, end_of_reading(*conn, n < 0 ? errno : 0));
      return;
    }
    std::string error;
    if (!feed_decoder(*conn, direct != nullptr, buf, static_cast<size_t>(n), error)) {
      close_from_loop(conn, "protocol error from " + conn->peer_ + ": " + error);
      return;
    }
    deliver_decoded_from_loop(conn);
    if (static_cast<size_t>(n) < len) return;  // the socket is drained
  }
}

void UvTransport::deliver_decoded_from_loop(const std::shared_ptr<UvConnection>& conn) {
  if (conn->counted_handshaking_ && !conn->decoder_.in_handshake()) {
    conn->counted_handshaking_ = false;
    --handshaking_;
  }
  while (conn->decoder_.has_message() && !conn->loop_closed_) {
    deliver_from_loop(conn, take_message(*conn));
  }
}

std::string UvTransport::end_of_reading(const UvConnection& conn, int err) {
  if (err == 0) {
    return "peer " + conn.peer_ +
           (conn.decoder_.idle() ? " closed the connection" : " closed the connection mid-frame");
  }
  return err == ECONNRESET ? "connection reset by " + conn.peer_
                           : "read from " + conn.peer_ + " failed: " + errno_text(err);
}

bool UvTransport::adopt_descriptors(const std::shared_ptr<UvConnection>& conn, msghdr& msg,
                                    std::string& error) {
  std::vector<int> fds;
  if (!collect_descriptors(msg, fds)) error = "more descriptors than a frame may announce";
  return adopt_fds(conn, std::move(fds), error);
}

bool UvTransport::adopt_fds(const std::shared_ptr<UvConnection>& conn, std::vector<int> fds,
                            std::string& error) {
  for (int fd : fds) {
    if (!error.empty()) {
      ::close(fd);
      continue;
    }
    try {
      conn->shared_in_->adopt(fd);  // owns fd from here on
      ++conn->fds_adopted_;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  return error.empty();
}

bool UvTransport::take_descriptors(const std::shared_ptr<UvConnection>& conn, msghdr& msg) {
  std::string error;
  if (adopt_descriptors(conn, msg, error)) return true;
  close_from_loop(conn, "protocol error from " + conn->peer_ + ": " + error);
  return false;
}

void UvTransport::deliver_from_loop(const std::shared_ptr<UvConnection>& conn, Message&& m) {
  if (!conn->paused_ && would_pause(*conn)) {
    conn->paused_ = true;
    conn->paused_flag_.store(true, std::memory_order_release);
    ++stats_read_pauses_;
  }
  if (!conn->paused_) {
    if (m.kind == MessageKind::kRequest && m.id != 0) {
      conn->requests_delivered_.fetch_add(1, std::memory_order_release);
    }
    callbacks_.on_message(conn, std::move(m));
    return;
  }
  conn->held_bytes_ += m.wire_bytes;
  conn->held_.push_back(std::move(m));
  if (conn->held_bytes_ > limits_.max_held_bytes && !conn->reading_stopped_) {
    conn->reading_stopped_ = true;
    std::lock_guard<std::mutex> lock(conn->write_mu_);
    conn->start_poll_locked();
  }
}

void UvTransport::resume_from_loop(const std::shared_ptr<UvConnection>& conn) {
  assert(on_transport_thread());
  std::lock_guard<std::mutex> read_lock(conn->read_mu_);
  resume_locked(conn);
  update_inline_locked(conn);
}

void UvTransport::resume_locked(const std::shared_ptr<UvConnection>& conn) {
  if (!conn->paused_ || conn->loop_closed_ ||
      conn->queued_reply_bytes_.load(std::memory_order_relaxed) >
          limits_.max_queued_reply_bytes / 2 ||
      conn->in_progress() > limits_.max_unanswered_requests / 2) {
    return;
  }
  std::deque<Message> held = std::move(conn->held_);
  conn->held_.clear();
  conn->held_bytes_ = 0;
  conn->paused_ = false;
  conn->paused_flag_.store(false, std::memory_order_release);
  const bool was_stopped = conn->reading_stopped_;
  conn->reading_stopped_ = false;
  // In order; a delivery that pauses again holds the rest again, in order.
  for (auto& m : held) {
    if (conn->loop_closed_) return;
    deliver_from_loop(conn, std::move(m));
  }
  if (was_stopped && !conn->reading_stopped_ && !conn->loop_closed_) {
    std::lock_guard<std::mutex> lock(conn->write_mu_);
    conn->start_poll_locked();
  }
  // A ring left unread while stopped wakes nobody: read it again now.
  if (was_stopped && conn->peer_mode_ == UvConnection::PeerMode::kRing && !conn->loop_closed_) {
    post([this, conn] { read_from_loop(conn); });
  }
}

void UvTransport::sweep_handshakes_from_loop() {
  assert(on_transport_thread());
  const auto now = Clock::now();
  std::vector<std::shared_ptr<UvConnection>> late;
  for (auto& [id, conn] : conns_) {
    if (conn->decoder_.in_handshake() && now - conn->opened_at_ > limits_.handshake_timeout) {
      late.push_back(conn);
    }
  }
  for (auto& conn : late) {
    ++stats_handshake_timeouts_;
    close_from_loop(conn, "protocol error from " + conn->peer_ + ": no handshake within " +
                              std::to_string(limits_.handshake_timeout.count()) + " ms");
  }
}

TransportStats UvTransport::stats() const {
  TransportStats s;
  s.read_pauses = stats_read_pauses_.load();
  s.handshake_timeouts = stats_handshake_timeouts_.load();
  s.refused_connections = stats_refused_.load();
  s.accept_backoffs = stats_accept_backoffs_.load();
  s.shared_tensors = stats_shared_tensors_.load();
  s.shared_bytes = stats_shared_bytes_.load();
  s.shared_fallbacks = stats_shared_fallbacks_.load();
  s.bytes_sent = stats_bytes_sent_.load();
  s.bytes_received = stats_bytes_received_.load();
  s.polled_messages = stats_polled_messages_.load();
  s.ring_wakes = stats_ring_wakes_.load();
  return s;
}

void UvTransport::close_from_loop(const std::shared_ptr<UvConnection>& conn,
                                  const std::string& reason) {
  assert(on_transport_thread());
  if (conn->loop_closed_) return;
  conn->loop_closed_ = true;
  conn->inline_ok_.store(false, std::memory_order_release);
  if (conn->counted_handshaking_) {
    conn->counted_handshaking_ = false;
    --handshaking_;
  }
  conn->held_.clear();
  {
    std::lock_guard<std::mutex> lock(conn->write_mu_);
    conn->closed_ = true;
    conn->clear_queue_locked();
  }
  if (!conn->polling_) return;  // never adopted; nothing registered
  struct Closing {
    std::shared_ptr<UvConnection> conn;
    std::string reason;
  };
  conn->poll_.data = new Closing{conn, reason};  // owned by the close callback below
  uv_poll_stop(&conn->poll_);
  uv_close(reinterpret_cast<uv_handle_t*>(&conn->poll_), [](uv_handle_t* h) {
    std::unique_ptr<Closing> c(static_cast<Closing*>(h->data));
    auto* t = c->conn->transport_;
    {
      std::lock_guard<std::mutex> lock(c->conn->read_mu_);  // no poller is in a read
      ::close(c->conn->fd_);
    }
    t->conns_.erase(c->conn->id());
    --t->live_connections_;
    if (t->callbacks_.on_closed) t->callbacks_.on_closed(c->conn, c->reason);
  });
}

void UvTransport::stop_from_loop() {
  assert(on_transport_thread());
  stopped_ = true;
  uv_close(reinterpret_cast<uv_handle_t*>(&loop_->sweep), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&loop_->accept_retry), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&loop_->ring_retry), nullptr);
  ring_retry_.clear();
  if (loop_->listening) {
    loop_->listening = false;
    uv_close(reinterpret_cast<uv_handle_t*>(&loop_->listen_poll), [](uv_handle_t* h) {
      auto* t = static_cast<UvTransport*>(h->data);
      ::close(t->listen_fd_);
      t->listen_fd_ = -1;
    });
  }
  if (loop_->local_listening) {
    loop_->local_listening = false;
    uv_close(reinterpret_cast<uv_handle_t*>(&loop_->local_poll), [](uv_handle_t* h) {
      auto* t = static_cast<UvTransport*>(h->data);
      ::close(t->local_fd_);
      t->local_fd_ = -1;
    });
  }
  auto conns = conns_;
  for (auto& [id, conn] : conns) close_from_loop(conn, "transport closed");
  {
    std::lock_guard<std::mutex> lock(mu_);
    loop_gone_ = true;
  }
  // Commands that raced in before loop_gone_ was set still run.
  run_commands();
  uv_close(reinterpret_cast<uv_handle_t*>(&loop_->wake), nullptr);
}

bool UvTransport::on_transport_thread() const {
  return thread_id_ == std::this_thread::get_id();
}

namespace {
std::weak_ptr<Connection>& polled_connection() {
  thread_local std::weak_ptr<Connection> conn;
  return conn;
}
}  // namespace

void remember_connection_for_polling(const ConnectionPtr& conn) { polled_connection() = conn; }

bool poll_this_threads_connection() {
  auto conn = polled_connection().lock();
  return conn && conn->poll_inline();
}

TransportFactory tcp_transport() {
  return [](const Limits& limits, Transport::Callbacks callbacks) -> std::unique_ptr<Transport> {
    return std::make_unique<UvTransport>(limits, std::move(callbacks), /*shared_memory=*/false);
  };
}

TransportFactory shm_transport() {
  return [](const Limits& limits, Transport::Callbacks callbacks) -> std::unique_ptr<Transport> {
    return std::make_unique<UvTransport>(limits, std::move(callbacks), /*shared_memory=*/true);
  };
}

void UvTransport::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) return;
    closing_ = true;
  }
  post([this] { stop_from_loop(); });
  if (thread_.joinable()) thread_.join();
  uv_loop_close(&loop_->loop);
}

}  // namespace tandem::rpc
