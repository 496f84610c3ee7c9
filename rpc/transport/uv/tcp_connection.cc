#include "tandem/rpc/transport/uv/tcp_connection.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "tandem/rpc/transport/uv/uv_transport.h"

namespace tandem::rpc {

class TcpConnection::Bell {
 public:
  Bell() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~Bell() {
    if (fd_ >= 0) ::close(fd_);
  }
  Bell(const Bell&) = delete;
  Bell& operator=(const Bell&) = delete;
  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  void ring() {
    const uint64_t one = 1;
    ssize_t n = ::write(fd_, &one, sizeof one);
    (void)n;  // a full counter rings already
  }
  void clear() {
    uint64_t got;
    ssize_t n = ::read(fd_, &got, sizeof got);
    (void)n;  // nothing rang: EAGAIN
  }

 private:
  const int fd_;
};

bool TcpConnection::poll_inline() {
  if (!inline_ok_.load(std::memory_order_acquire) || no_polling_here()) return false;
  enter_polling_here();
  return poll_if_free();
}

std::unique_ptr<ConnectionSleeper> TcpConnection::sleeper_here() {
  if (polling_state().entered.get() != this || !transport_->limits().sleep_on_connection ||
      !inline_ok_.load(std::memory_order_acquire)) {
    return nullptr;
  }
  // Each sleep rings a bell of its own (made here: a sleep comes after a
  // spin ran out, so its two system calls are not on a busy path).
  class Sleeper final : public ConnectionSleeper {
   public:
    Sleeper(std::shared_ptr<TcpConnection> conn, std::shared_ptr<Bell> bell)
        : conn_(std::move(conn)), bell_(std::move(bell)) {}
    bool wait(std::chrono::microseconds timeout, const std::function<bool()>& done) override {
      return conn_->sleep_polling(bell_, timeout, done);
    }
    std::function<void()> waker() const override {
      return [bell = bell_] { bell->ring(); };
    }

   private:
    const std::shared_ptr<TcpConnection> conn_;
    const std::shared_ptr<Bell> bell_;
  };
  auto bell = std::make_shared<Bell>();
  if (!bell->ok()) return nullptr;
  return std::make_unique<Sleeper>(std::static_pointer_cast<TcpConnection>(shared_from_this()),
                                   std::move(bell));
}

namespace {
// How long the loop leaves bytes to a sleeper woken for them before it
// reads them itself: more than a wake-up of a sleeping core takes.
constexpr std::chrono::microseconds kYieldFor{500};

// Waits in ppoll() for `fds` until `until`: false at the bound (or a signal).
bool ppoll_until(pollfd* fds, nfds_t n, std::chrono::steady_clock::time_point until) {
  const auto left = std::chrono::duration_cast<std::chrono::microseconds>(
      until - std::chrono::steady_clock::now());
  const int64_t us = std::max<int64_t>(left.count(), 0);
  timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>(us % 1000000) * 1000};
  return ::ppoll(fds, n, &ts, nullptr) > 0;
}
}  // namespace

bool TcpConnection::yield_read_from_loop() {
  {
    std::lock_guard<std::mutex> lock(sleep_mu_);
    if (readers_ == 0) return false;
    const auto now = Clock::now();
    if (yielded_since_ == Clock::time_point{}) {
      yielded_since_ = now;
    } else if (now - yielded_since_ > kYieldFor) {
      return false;  // not scheduled yet: read them here
    }
  }
  // A large frame, or one begun, is the loop's: its gulps cost one
  // wake-up for many reads (and a poller leaves them to it anyway).
  if (!inline_ok_.load(std::memory_order_acquire) || !small_frame_next()) return false;
  std::this_thread::yield();  // (the sleeper may want this core)
  return true;
}

bool TcpConnection::small_frame_next() const {
  Preamble p;
  const ssize_t n = ::recv(fd_, &p, sizeof p, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0) return false;                              // nothing yet
  if (n < static_cast<ssize_t>(sizeof p)) return true;  // (the end, or a preamble begun)
  return p.magic == kMagic &&
         sizeof p + uint64_t{p.envelope_bytes} + p.table_bytes + p.body_bytes <= kPollerGulp;
}

void TcpConnection::wake_sleepers() {
  std::lock_guard<std::mutex> lock(sleep_mu_);
  for (const auto& bell : sleepers_) bell->ring();
}

bool TcpConnection::sleep_polling(const std::shared_ptr<Bell>& bell,
                                  std::chrono::microseconds timeout,
                                  const std::function<bool()>& done) {
  // (Not inside a delivery of this thread's own poll: it holds read_mu_.)
  if (polling_state().entered.get() != this || no_polling_here()) return false;
  if (done() || poll_inline()) return true;
  const auto until = Clock::now() + timeout;
  // Counted as a sleeper first: an end that comes after this look rings us
  // (wake_sleepers), and one before it is seen here. The descriptor is
  // closed only after the end (under read_mu_), so ppoll() sees this
  // socket, or the end's ring.
  Sleeping sleeping(this, bell);
  if (!inline_ok_.load(std::memory_order_acquire)) return false;
  if (done()) return true;
  pollfd fds[2] = {{fd_, POLLIN, 0}, {bell->fd(), POLLIN, 0}};
  if (!ppoll_until(fds, 2, until)) return true;
  if (fds[1].revents & POLLIN) bell->clear();
  if (!(fds[0].revents & (POLLIN | POLLHUP | POLLERR))) return true;
  // The bytes are this sleeper's to read while it counts as a reader (the
  // loop leaves small frames to it).
  if (poll_if_free()) return true;
  // They are the loop's (a large frame, one it reads now, a message it
  // delivers, the end): this thread no longer reads, so that the loop does
  // at once, and sleeps on its bell alone, which whatever it waits for
  // rings.
  sleeping.stop_reading();
  if (done()) return true;
  pollfd bell_only[1] = {{bell->fd(), POLLIN, 0}};
  if (ppoll_until(bell_only, 1, until)) bell->clear();
  return true;
}

TcpConnection::Sleeping::Sleeping(TcpConnection* conn, const std::shared_ptr<Bell>& bell)
    : conn_(conn), bell_(bell) {
  std::lock_guard<std::mutex> lock(conn_->sleep_mu_);
  conn_->sleepers_.push_back(bell_);
  ++conn_->readers_;
}

void TcpConnection::Sleeping::stop_reading() {
  if (!reading_) return;
  reading_ = false;
  std::lock_guard<std::mutex> lock(conn_->sleep_mu_);
  if (--conn_->readers_ == 0) conn_->yielded_since_ = Clock::time_point{};
}

TcpConnection::Sleeping::~Sleeping() {
  stop_reading();
  std::lock_guard<std::mutex> lock(conn_->sleep_mu_);
  auto& s = conn_->sleepers_;
  s.erase(std::find(s.begin(), s.end(), bell_));
}

void set_tcp_options(int fd) {
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

std::string tcp_address(const sockaddr* sa) {
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

int open_tcp_listener(const std::string& host, int port, int& bound) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port_s = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port_s.c_str(), &hints, &res);
  if (rc != 0) {
    throw std::invalid_argument("cannot resolve listen address '" + host +
                                "': " + gai_strerror(rc));
  }
  int fd = -1;
  std::string err;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) break;
    err = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd < 0) throw std::runtime_error("cannot listen on " + host + ":" + port_s + ": " + err);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  bound = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return fd;
}

}  // namespace tandem::rpc
