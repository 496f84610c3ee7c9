#include "tandem/rpc/rendezvous/store_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace tandem::rpc {
namespace {

enum Query : uint8_t {
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kGetNumKeys,
  kWatchKey,
  kDeleteKey
};
constexpr uint8_t kReady = 0, kNotReady = 1, kStopWaiting = 0;

// A query cut short: wait for more bytes.
struct Incomplete {};
// A query no client of the protocol sends: close that client.
struct Malformed {};

// Reads one query's fields from a client's buffered bytes.
class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  template <class T>
  T value() {
    if (in_.size() - pos_ < sizeof(T)) throw Incomplete{};
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string bytes(uint64_t max) {
    const auto n = value<uint64_t>();
    if (n > max) throw Malformed{};
    if (in_.size() - pos_ < n) throw Incomplete{};
    std::string out = in_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  size_t consumed() const { return pos_; }

 private:
  const std::string& in_;
  size_t pos_ = 0;
};

template <class T>
void append(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void append_bytes(std::string& out, const std::string& b) {
  append<uint64_t>(out, b.size());
  out += b;
}

}  // namespace

struct StoreServer::State {
  struct Client {
    int fd = -1;
    std::string in, out;
    size_t waiting_for = 0;  // keys of its WAIT still missing
  };
  std::map<uint64_t, Client> clients;  // by id (fds are reused, ids are not)
  uint64_t next_id = 1;
  std::unordered_map<std::string, std::string> data;
  std::unordered_map<std::string, std::vector<uint64_t>> waiting;  // key -> client ids

  void changed(const std::string& key) {
    auto it = waiting.find(key);
    if (it == waiting.end()) return;
    for (uint64_t id : it->second) {
      auto c = clients.find(id);
      if (c != clients.end() && c->second.waiting_for > 0 && --c->second.waiting_for == 0) {
        append<uint8_t>(c->second.out, kStopWaiting);
      }
    }
    waiting.erase(it);
  }

  // Serves every whole query in `c.in`; throws Malformed.
  void serve(uint64_t id, Client& c) {
    for (;;) {
      if (c.in.empty() || c.waiting_for > 0) return;  // a waiting client sends nothing else
      Reader r(c.in);
      try {
        const auto type = r.value<uint8_t>();
        switch (type) {
          case kSet: {
            std::string key = r.bytes(kMaxKeyBytes);
            data[key] = r.bytes(kMaxValueBytes);
            changed(key);
            break;
          }
          case kCompareSet: {
            std::string key = r.bytes(kMaxKeyBytes);
            std::string expected = r.bytes(kMaxValueBytes);
            std::string desired = r.bytes(kMaxValueBytes);
            auto it = data.find(key);
            if (it == data.end()) {
              if (expected.empty()) {
                data[key] = desired;
                changed(key);
                append_bytes(c.out, desired);
              } else {
                append_bytes(c.out, expected);
              }
            } else {
              if (it->second == expected) {
                it->second = desired;
                changed(key);
              }
              append_bytes(c.out, it->second);
            }
            break;
          }
          case kGet: {
            std::string key = r.bytes(kMaxKeyBytes);
            auto it = data.find(key);
            if (it == data.end()) throw Malformed{};  // clients wait for a key before they get it
            append_bytes(c.out, it->second);
            break;
          }
          case kAdd: {
            std::string key = r.bytes(kMaxKeyBytes);
            const auto delta = r.value<int64_t>();
            int64_t sum = delta;
            auto it = data.find(key);
            if (it != data.end()) {
              char* end = nullptr;
              errno = 0;
              const long long old = std::strtoll(it->second.c_str(), &end, 10);
              if (errno != 0 || end == it->second.c_str()) throw Malformed{};
              sum = static_cast<int64_t>(static_cast<uint64_t>(old) + static_cast<uint64_t>(delta));
            }
            data[key] = std::to_string(sum);
            changed(key);
            append<int64_t>(c.out, sum);
            break;
          }
          case kCheck:
          case kWait: {
            const auto n = r.value<uint64_t>();
            if (n > 1 << 20) throw Malformed{};
            std::vector<std::string> keys;
            for (uint64_t i = 0; i < n; ++i) keys.push_back(r.bytes(kMaxKeyBytes));
            size_t missing = 0;
            for (const auto& k : keys) missing += data.count(k) == 0;
            if (type == kCheck) {
              append<uint8_t>(c.out, missing == 0 ? kReady : kNotReady);
            } else if (missing == 0) {
              append<uint8_t>(c.out, kStopWaiting);
            } else {
              c.waiting_for = missing;
              for (const auto& k : keys) {
                if (!data.count(k)) waiting[k].push_back(id);
              }
            }
            break;
          }
          case kGetNumKeys:
            append<int64_t>(c.out, static_cast<int64_t>(data.size()));
            break;
          case kDeleteKey: {
            std::string key = r.bytes(kMaxKeyBytes);
            append<int64_t>(c.out, static_cast<int64_t>(data.erase(key)));
            break;
          }
          default:  // kWatchKey, and anything else
            throw Malformed{};
        }
      } catch (const Incomplete&) {
        return;
      }
      c.in.erase(0, r.consumed());
    }
  }
};

StoreServer::StoreServer(const std::string& host, int port, bool hosted_by_launcher)
    : host_(host), state_(std::make_unique<State>()) {
  // (as a client's key reaches the server: 1.13's TCPStore puts "/" before each)
  if (hosted_by_launcher) state_->data[std::string("/") + kLauncherKey] = "tandem-run";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string where = host + ":" + std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    throw std::runtime_error("rendezvous store: cannot resolve " + where + ": " + gai_strerror(rc));
  }
  std::string err = "no address";
  for (addrinfo* ai = res; ai && listen_fd_ < 0; ai = ai->ai_next) {
    int fd =
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      listen_fd_ = fd;
    } else {
      err = std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (listen_fd_ < 0)
    throw std::runtime_error("rendezvous store: cannot listen on " + where + ": " + err);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(listen_fd_);
    throw std::runtime_error(std::string("rendezvous store: pipe: ") + std::strerror(errno));
  }
  thread_ = std::thread([this] { run(); });
}

StoreServer::~StoreServer() {
  const char stop = 1;
  (void)!::write(wake_[1], &stop, 1);
  if (thread_.joinable()) thread_.join();
  for (auto& [id, c] : state_->clients) ::close(c.fd);
  ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
}

void StoreServer::run() {
  State& s = *state_;
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  char buf[64 << 10];
  for (;;) {
    fds.clear();
    ids.clear();
    fds.push_back({wake_[0], POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (auto& [id, c] : s.clients) {
      fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
      ids.push_back(id);
    }
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents) return;
    if (fds[1].revents & POLLIN) {
      for (;;) {
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;  // EAGAIN, or out of descriptors: the next poll tries again
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        s.clients[s.next_id++].fd = fd;
      }
    }
    std::vector<uint64_t> gone;
    for (size_t i = 2; i < fds.size(); ++i) {
      const uint64_t id = ids[i - 2];
      auto& c = s.clients[id];
      bool drop = (fds[i].revents & (POLLERR | POLLNVAL)) != 0;
      if (!drop && (fds[i].revents & (POLLIN | POLLHUP))) {
        const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
        if (n > 0) {
          c.in.append(buf, static_cast<size_t>(n));
          try {
            s.serve(id, c);
          } catch (const Malformed&) {
            drop = true;
          }
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
          drop = true;
        }
      }
      if (drop) gone.push_back(id);
    }
    // Answers (also those that a SET above owed another client's WAIT).
    for (auto& [id, c] : s.clients) {
      while (!c.out.empty()) {
        const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
          c.out.erase(0, static_cast<size_t>(n));
        } else {
          if (n < 0 && errno != EAGAIN && errno != EINTR) gone.push_back(id);
          break;
        }
      }
    }
    for (uint64_t id : gone) {
      auto it = s.clients.find(id);
      if (it == s.clients.end()) continue;
      ::close(it->second.fd);
      s.clients.erase(it);
    }
  }
}

}  // namespace tandem::rpc
