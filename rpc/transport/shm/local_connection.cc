#include "tandem/rpc/transport/shm/local_connection.h"

#include "tandem/rpc/common/host.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/stages.h"
#include "tandem/rpc/transport/shm/ring.h"
#include "tandem/rpc/transport/shm/segments.h"
#include "tandem/rpc/transport/uv/uv_transport.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>

namespace tandem::rpc {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

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

// How soon a sleeper looks again at a ring the loop thread was reading.
constexpr std::chrono::microseconds kBusyRingLook{50};

}  // namespace

const std::string& local_host_key() {
  static const std::string key = [] {
    const std::string& boot = boot_id();
    char ns[128] = {};
    ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
    if (boot.empty() || n <= 0) return std::string();
    return boot + ":" + std::string(ns, static_cast<size_t>(n));
  }();
  return key;
}

std::pair<sockaddr_un, socklen_t> abstract_address(const std::string& name) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  return {addr, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())};
}

LocalConnection::LocalConnection(UvTransport* transport, int fd, uint64_t id, std::string peer,
                                 bool accepted)
    : StreamConnection(transport, Kind::kLocal, fd, id, std::move(peer), accepted) {
  const Limits& limits = transport->limits();
  if (limits.max_shared_bytes > 0 && limits.max_shared_segments > 0) {
    shared_out_ = std::make_unique<SegmentWriter>(limits);
  }
  shared_in_ = std::make_unique<SegmentReader>(limits);
  decoder_.set_shared_resolver(
      [in = shared_in_.get()](const SharedRef& ref, c10::ScalarType dtype,
                              const std::vector<int64_t>& shape,
                              uint64_t nbytes) { return in->tensor(ref, dtype, shape, nbytes); });
  decoder_.set_cuda_ipc(true);  // the peer is on this host (rpc/wire/device.h)
  const uint64_t ring = limits.shm_ring_bytes;
  ring_unavailable_ = testing::shared_segments_failure();
  if (ring == 0) {
    ring_unavailable_ = "Limits::shm_ring_bytes is 0";
  } else if (ring_unavailable_.empty()) {
    ring_out_ = RingWriter::create(ring, ring_unavailable_);
  }
}

LocalConnection::~LocalConnection() = default;

bool LocalConnection::say_hello(std::string& why) {
  if (!ring_out_ && transport_->limits().shm_ring_bytes > 0 &&
      !transport_->counters().ring_unavailable_logged.exchange(true)) {
    std::fprintf(stderr,
                 "tandem: same-host rings unavailable (%s); frames to %s and others go through "
                 "the socket (logged once)\n",
                 printable(ring_unavailable_).c_str(), printable(peer_).c_str());
  }
  const char code = ring_out_ ? kRingHello : kNoRingHello;
  std::vector<int> fds;
  if (ring_out_) fds.push_back(ring_out_->fd());
  const int rc = send_code(code, fds);
  if (rc == 1) return true;
  why = rc == 0 ? "the socket would not take its first byte" : errno_text(errno);
  return false;
}

int LocalConnection::send_code(char code, const std::vector<int>& fds) {
  iovec iov{&code, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRead)];
  if (!fds.empty()) attach_fds(msg, control, fds.data(), fds.size());
  for (;;) {
    const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n == 1) return 1;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    return -1;
  }
}

void LocalConnection::count_shared(const PendingWrite& w) {
  TransportCounters& counters = transport_->counters();
  counters.shared_tensors += w.table.size();
  counters.shared_bytes += w.shared_bytes;
  counters.shared_fallbacks += w.shared_fallbacks;
  const std::string& unavailable = shared_out_->unavailable();
  if (!unavailable.empty() && !counters.shared_unavailable_logged.exchange(true)) {
    std::fprintf(stderr,
                 "tandem: shared memory segments unavailable (%s); large tensors to %s and "
                 "others go through the socket (logged once)\n",
                 printable(unavailable).c_str(), printable(peer_).c_str());
  }
}

void LocalConnection::adjust_events(bool& readable, bool& writable) const {
  readable = readable || peer_mode_ == PeerMode::kRing;
  writable = writable && (!ring_out_ || wait_socket_);
}

bool LocalConnection::write_local_locked(PendingWrite& w) {
  if (ring_out_) return write_ring(w);
  return write_socket_locked(w);
}

bool LocalConnection::write_ring(PendingWrite& w) {
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
      if (k > 0) note_written();
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

void LocalConnection::publish_locked() {
  ring_out_->publish();
  TANDEM_STAGE(kPublished);
  bool rang = false;
  const bool wake = ring_out_->reader_needs_wake(&rang);
  if (rang) transport_->counters().ring_bells.fetch_add(1, std::memory_order_relaxed);
  if (!wake) return;
  transport_->counters().ring_wakes.fetch_add(1, std::memory_order_relaxed);
  // A full socket already holds wake-ups; a dead peer shows on the loop.
  (void)send_code(kRingWake, {});
}

void LocalConnection::retry_ring_later() {
  auto self = shared_from_this();
  transport_->post([transport = transport_, self] { transport->retry_ring_from_loop(self); });
}

bool LocalConnection::poll_inline() {
  if (!inline_ok_.load(std::memory_order_acquire) || no_polling_here()) return false;
  if (RingReader* ring = ring_in_ready_.load(std::memory_order_acquire)) {
    enter_polling_spin(ring);
    // A look at two counters instead of a system call.
    if (!ring->maybe_readable()) return false;
  }
  return poll_if_free();
}

void LocalConnection::enter_polling_spin(RingReader* ring) {
  if (enter_polling_here()) ring->enter_polling();
}

void LocalConnection::leave_polling_spin() {
  RingReader* ring = ring_in_ready_.load(std::memory_order_acquire);
  ring->leave_polling();
  if (ring->maybe_readable()) {
    auto self = shared_from_this();
    transport_->post([self] { self->read_from_loop(); });
  }
}

bool LocalConnection::sleepable_here() const {
  return polling_state().entered.get() == this && transport_->limits().sleep_on_connection &&
         ring_in_ready_.load(std::memory_order_acquire) != nullptr;
}

bool LocalConnection::sleep_polling(std::chrono::microseconds timeout,
                                    const std::function<bool()>& done) {
  // (Not inside a delivery of this thread's own poll: it holds read_mu_.)
  if (!sleepable_here() || no_polling_here()) return false;
  RingReader* ring = ring_in_ready_.load(std::memory_order_acquire);
  // Counted as a sleeper before anything is looked at (ring.h, 3a.): what
  // comes after the looks below moves the bell, and the sleep returns.
  const uint32_t seen = ring->enter_sleep();
  struct Leave {
    RingReader* ring;
    ~Leave() { ring->leave_sleep(); }
  } leave{ring};
  if (done() || poll_inline()) return true;
  // Nothing read: it must go to the loop thread (8.'s hand-offs), or
  // nothing came, or the loop thread holds the ring. Bytes that come once
  // the loop thread has let it go would wake nobody (we are a poller, and
  // they may have come before we counted ourselves a sleeper): look again
  // shortly rather than sleep through them.
  if (!inline_ok_.load(std::memory_order_acquire)) return false;
  ring->sleep(seen, ring->maybe_readable() ? std::min(timeout, kBusyRingLook) : timeout);
  return true;
}

void LocalConnection::ring_bell() {
  if (RingReader* ring = ring_in_ready_.load(std::memory_order_acquire)) ring->ring_bell();
}

std::unique_ptr<ConnectionSleeper> LocalConnection::sleeper_here() {
  if (!sleepable_here()) return nullptr;
  // Every sleeper on the peer's ring is woken by its bell.
  class Sleeper final : public ConnectionSleeper {
   public:
    explicit Sleeper(std::shared_ptr<LocalConnection> conn) : conn_(std::move(conn)) {}
    bool wait(std::chrono::microseconds timeout, const std::function<bool()>& done) override {
      return conn_->sleep_polling(timeout, done);
    }
    std::function<void()> waker() const override {
      return [conn = conn_] { conn->ring_bell(); };
    }

   private:
    const std::shared_ptr<LocalConnection> conn_;
  };
  return std::make_unique<Sleeper>(std::static_pointer_cast<LocalConnection>(shared_from_this()));
}

bool LocalConnection::read_local_locked(Reader who) {
  if (who == Reader::kLoop) {
    if (loop_closed_) return false;
    std::string error;
    if (!read_codes_locked(who, error) || loop_closed_) return false;
  }
  if (peer_mode_ == PeerMode::kRing) return read_ring_locked(who, /*drain=*/false);
  if (peer_mode_ == PeerMode::kStream) return read_socket_locked(who);
  return false;
}

ssize_t LocalConnection::recv_socket(char* buf, size_t len, std::string& error) {
  LocalRead read;
  const ssize_t n = read.recv(fd_, buf, len);
  if (n >= 0) adopt_descriptors(read.msg, error);
  return n;
}

bool LocalConnection::adopt_descriptors(msghdr& msg, std::string& error) {
  std::vector<int> fds;
  if (!collect_descriptors(msg, fds)) error = "more descriptors than a frame may announce";
  return adopt_fds(std::move(fds), error);
}

bool LocalConnection::adopt_fds(std::vector<int> fds, std::string& error) {
  for (int fd : fds) {
    if (!error.empty()) {
      ::close(fd);
      continue;
    }
    try {
      shared_in_->adopt(fd);  // owns fd from here on
      ++fds_adopted_;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  return error.empty();
}

bool LocalConnection::read_codes_locked(Reader who, std::string& error) {
  const bool poller = who == Reader::kPoller;
  std::vector<int> fds;
  auto fail = [&](const std::string& why) {
    for (int fd : fds) ::close(fd);
    error = "protocol error from " + peer_ + ": " + why;
    if (!poller) close_from_loop(error);
    return false;
  };
  char buf[256];
  bool woke = false;
  struct PassOn {
    LocalConnection* conn;
    bool& woke;
    ~PassOn() {
      if (!woke) return;
      auto self = conn->shared_from_this();
      conn->transport_->post([self] { self->read_from_loop(); });
    }
  } pass_on{this, woke};
  while (peer_mode_ != PeerMode::kStream) {
    const bool hello = peer_mode_ == PeerMode::kUnknown;
    LocalRead read;
    const ssize_t n = read.recv(fd_, buf, hello ? 1 : sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n <= 0) {
      if (poller) return false;  // the loop thread sees the end too, and closes
      const int err = n < 0 ? errno : 0;
      if (peer_mode_ == PeerMode::kRing) {
        // What the peer wrote before it went is delivered first, as TCP does.
        read_ring_locked(who, /*drain=*/true);
        if (loop_closed_) return false;
      }
      close_from_loop(end_of_reading(err));
      return false;
    }
    fds.clear();
    if (!collect_descriptors(read.msg, fds))
      return fail("more descriptors than a frame may announce");
    if (hello) {
      if (buf[0] == kRingHello && fds.size() == 1) {
        const int fd = fds[0];
        fds.clear();
        try {
          ring_in_ = std::make_unique<RingReader>(fd, transport_->limits().max_ring_bytes);
        } catch (const std::exception& e) {
          return fail(e.what());
        }
        peer_mode_ = PeerMode::kRing;
        ring_in_ready_.store(ring_in_.get(), std::memory_order_release);
        continue;
      }
      if (buf[0] == kNoRingHello && fds.empty()) {
        peer_mode_ = PeerMode::kStream;
        if (ring_out_) {
          // Writes that found our ring full before this byte came wait for
          // a 'W' that this peer cannot send (its socket carries frames).
          std::lock_guard<std::mutex> write_lock(write_mu_);
          peer_streams_.store(true, std::memory_order_release);
          if (!queue_.empty()) retry_ring_later();
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
    if (!adopt_fds(std::exchange(fds, {}), why)) return fail(why);
  }
  return true;
}

bool LocalConnection::read_ring_locked(Reader who, bool drain) {
  const bool poller = who == Reader::kPoller;
  char* const scratch = staging(who);
  RingReader& ring = *ring_in_;
  bool delivered = false;
  std::string error;
  auto fail = [&] {
    fail_read(who, "protocol error from " + peer_ + ": " + error);
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
    if (loop_closed_ || (!drain && reading_stopped_)) return delivered;
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
    if (ring.announced() > fds_adopted_) {
      // The descriptors first (ring.h, 4.); once the socket has ended
      // (drain), none will come.
      if (!drain && !read_codes_locked(who, error)) {
        if (!poller || error.empty()) return delivered;  // closed, or the end left to the loop
        hand_to_loop(error);
        return delivered;
      }
      if (ring.announced() > fds_adopted_) {
        error = "ring announced " + std::to_string(ring.announced()) + " segment descriptor(s); " +
                std::to_string(fds_adopted_) + " came";
        return fail();
      }
    }
    auto [direct, want] = decoder_.direct_target(kDirectReadMin);
    char* buf = direct ? direct : scratch;
    const size_t len =
        static_cast<size_t>(std::min<uint64_t>(avail, direct ? want : kStagingBytes));
    ring.read(buf, len);
    TANDEM_STAGE(kRingRead);
    if (drain) drain_left -= len;
    // Without a ring of our own our socket carries frames, not codes: the
    // writer then looks for space on its own.
    if (ring_out_ && ring.writer_needs_wake()) {
      transport_->counters().ring_wakes.fetch_add(1, std::memory_order_relaxed);
      (void)send_code(kRingWake, {});
    }
    if (!feed_decoder(direct != nullptr, buf, len, error)) return fail();
    if (!poller) {
      deliver_decoded_from_loop();
    } else {
      while (decoder_.has_message() && !loop_closed_) {
        delivered |= deliver_inline_locked(take_message());
      }
    }
    if (poller && !deferred_.empty()) {
      hand_to_loop("");
      return delivered;
    }
  }
  // Out of rounds with bytes left: on, after the loop's other work.
  if (!poller && !loop_closed_) {
    auto self = shared_from_this();
    transport_->post([self] { self->read_from_loop(); });
  }
  return delivered;
}

}  // namespace tandem::rpc
