#include "tandem/rpc/common/dial.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>

namespace tandem::rpc {

Dialed dial_tcp(const std::string& host, int port, std::chrono::milliseconds timeout) {
  const std::string where = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  Dialed out;
  if (rc != 0) {
    out.why = "cannot resolve " + where + ": " + gai_strerror(rc);
    return out;
  }
  out.error = EADDRNOTAVAIL;  // no address at all
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (addrinfo* ai = res; ai && out.fd < 0; ai = ai->ai_next) {
    int fd =
        ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      out.error = errno;
      continue;
    }
    int err = ::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int pr;
      do {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        pr = ::poll(&p, 1,
                    timeout.count() > 0
                        ? static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT32_MAX))
                        : -1);
      } while (pr < 0 && errno == EINTR);
      if (pr == 0) {
        err = ETIMEDOUT;
      } else {
        socklen_t len = sizeof(err);
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      }
    }
    if (err == 0) {
      out.fd = fd;
    } else {
      out.error = err;
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (out.fd < 0) out.why = "cannot connect to " + where + ": " + std::strerror(out.error);
  return out;
}

}  // namespace tandem::rpc
