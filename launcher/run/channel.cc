// The launchers' connection (launcher/run/channel.h).
#include "launcher/run/channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "launcher/run/io.h"
#include "tandem/rpc/common/auth.h"

namespace tandem::launcher {

namespace {

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  const int fd_flags = ::fcntl(fd, F_GETFD);
  if (fd_flags >= 0) ::fcntl(fd, F_SETFD, fd_flags | FD_CLOEXEC);  // never a worker's
}

std::string address_text(const sockaddr* address) {
  char host[NI_MAXHOST] = "?";
  char port[NI_MAXSERV] = "?";
  const socklen_t length =
      address->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  ::getnameinfo(address, length, host, sizeof host, port, sizeof port,
                NI_NUMERICHOST | NI_NUMERICSERV);
  return std::string(host) + ":" + port;
}

struct Resolved {
  addrinfo* list = nullptr;
  ~Resolved() {
    if (list) ::freeaddrinfo(list);
  }
};

// host:port's addresses; throws naming them when they do not resolve.
void resolve(const std::string& host, int port, bool passive, Resolved& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &out.list); rc != 0) {
    throw std::runtime_error("cannot resolve " + host + ": " + ::gai_strerror(rc));
  }
}

}  // namespace

Channel::Channel(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {
  set_nonblocking(fd_);
  const int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

Channel::~Channel() { close(); }

Channel::Channel(Channel&& other) noexcept { *this = std::move(other); }

Channel& Channel::operator=(Channel&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    peer_ = std::move(other.peer_);
    in_ = std::move(other.in_);
    start_ = other.start_;
    received_ = other.received_;
    limit_ = other.limit_;
    why_ = std::move(other.why_);
    key_ = std::move(other.key_);
    send_label_ = std::move(other.send_label_);
    receive_label_ = std::move(other.receive_label_);
    sent_lines_ = other.sent_lines_;
    received_lines_ = other.received_lines_;
    refused_ = other.refused_;
    last_refused_ = std::move(other.last_refused_);
    heard_ = other.heard_;
    sent_ = other.sent_;
  }
  return *this;
}

void Channel::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

bool Channel::read_some() {
  if (fd_ < 0) return false;
  char buffer[4096];
  size_t budget = kReadBudget;
  while (budget > 0) {
    const ssize_t n = ::read(fd_, buffer, std::min(sizeof buffer, budget));
    if (n > 0) {
      // What was taken as lines goes once it is half the buffer: each byte
      // is moved at most once more (1.).
      if (start_ > 0 && start_ >= in_.size() / 2) {
        in_.erase(0, start_);
        start_ = 0;
      }
      in_.append(buffer, static_cast<size_t>(n));
      received_ += static_cast<size_t>(n);
      budget -= static_cast<size_t>(n);
      // (a secured channel hears its peer only in lines that verify)
      if (key_.empty()) heard_ = Clock::now();
      if (limit_ != 0 && received_ > limit_) {
        why_ = "sent more than " + std::to_string(limit_) + " bytes before proving the token";
        close();
        return false;
      }
      // The line not yet ended: found from the end, so only the new bytes
      // and that line (at most kMaxLine) are looked at.
      const size_t newline = in_.rfind('\n');
      const size_t open = newline == std::string::npos || newline < start_ ? start_ : newline + 1;
      if (in_.size() - open > kMaxLine) {
        why_ = "a line longer than " + std::to_string(kMaxLine) + " bytes";
        close();
        return false;
      }
      continue;
    }
    if (n == 0) {
      why_ = "connection closed";
      close();
      return false;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    // (reset: the peer closed with our bytes unread, as a killed process does)
    why_ = errno == ECONNRESET ? "connection closed" : errno_text(errno);
    close();
    return false;
  }
  return true;  // more may be waiting: the next wake-up reads it
}

std::optional<std::string> Channel::next_line() {
  for (;;) {
    const size_t newline = in_.find('\n', start_);
    if (newline == std::string::npos) return std::nullopt;
    std::string line = in_.substr(start_, newline - start_);
    start_ = newline + 1;
    if (key_.empty()) return line;
    // "<text> ~<mac>": the MAC over this direction, the line's number and its text (3.).
    const size_t at = line.rfind(" ~");
    if (at != std::string::npos &&
        rpc::constant_time_equal(line.substr(at + 2),
                                 mac(receive_label_, received_lines_, line.substr(0, at)))) {
      ++received_lines_;
      heard_ = Clock::now();
      line.resize(at);
      return line;
    }
    ++refused_;
    last_refused_ = std::move(line);
  }
}

size_t Channel::take_refused(std::string& last) {
  last = last_refused_;
  return std::exchange(refused_, 0);
}

void Channel::secure(std::string key, std::string send_label, std::string receive_label) {
  key_ = std::move(key);
  send_label_ = std::move(send_label);
  receive_label_ = std::move(receive_label);
  sent_lines_ = received_lines_ = 0;
}

std::string Channel::mac(const std::string& label, uint64_t sequence,
                         const std::string& text) const {
  const rpc::Sha256Digest digest =
      rpc::hmac_sha256(key_, label + " " + std::to_string(sequence) + " " + text);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (size_t i = 0; i < 16; ++i) {  // 128 bits
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 15];
  }
  return hex;
}

bool Channel::send(const std::string& line) {
  if (fd_ < 0) return false;
  std::string data = line;
  if (!key_.empty()) data += " ~" + mac(send_label_, sent_lines_++, line);
  data += "\n";
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(fd_, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      // A few bytes a second never fill a socket's buffer unless the peer
      // stopped reading long ago.
      why_ = "it stopped reading";
    } else {
      why_ = n < 0 ? errno_text(errno) : "cannot write";
    }
    close();
    return false;
  }
  sent_ = Clock::now();
  return true;
}

int listen_on(const std::string& host, int port, int* bind_errno) {
  Resolved resolved;
  resolve(host, port, true, resolved);
  std::string error = "no address";
  int taken = 0;  // (an address in use, or not this host's)
  for (addrinfo* a = resolved.list; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) {
      set_nonblocking(fd);
      return fd;
    }
    const int failed = errno;
    error = errno_text(failed);
    ::close(fd);
    if (failed == EADDRINUSE || failed == EADDRNOTAVAIL) taken = failed;
  }
  if (bind_errno && taken) {
    *bind_errno = taken;
    return -1;
  }
  throw std::runtime_error("cannot listen on " + host + ":" + std::to_string(port) + ": " + error);
}

int bound_port(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) return 0;
  if (address.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
  }
  return ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
}

std::optional<Channel> accept_channel(int listen_fd, int& error) {
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  error = 0;
  int fd;
  do {
    fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&address), &length,
                   SOCK_CLOEXEC | SOCK_NONBLOCK);
  } while (fd < 0 && (errno == EINTR || errno == ECONNABORTED));
  if (fd < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK) error = errno;
    return std::nullopt;
  }
  return Channel(fd, address_text(reinterpret_cast<sockaddr*>(&address)));
}

std::optional<Channel> connect_channel(const std::string& host, int port,
                                       std::chrono::milliseconds timeout, std::string& error) {
  Resolved resolved;
  try {
    resolve(host, port, false, resolved);
  } catch (const std::exception& e) {
    error = e.what();
    return std::nullopt;
  }
  for (addrinfo* a = resolved.list; a; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = errno_text(errno);
      continue;
    }
    set_nonblocking(fd);
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = -1;
      errno = ETIMEDOUT;
      if (::poll(&p, 1, static_cast<int>(timeout.count())) == 1) {
        int so_error = 0;
        socklen_t len = sizeof so_error;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
        errno = so_error;
        rc = so_error == 0 ? 0 : -1;
      }
    }
    if (rc == 0) return Channel(fd, host + ":" + std::to_string(port));
    error = errno_text(errno);
    ::close(fd);
  }
  return std::nullopt;
}

}  // namespace tandem::launcher
