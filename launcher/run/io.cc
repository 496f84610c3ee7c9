// Output and descriptors (launcher/run/io.h).
#include "launcher/run/io.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace tandem::launcher {

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        pollfd wait_fd{fd, POLLOUT, 0};
        ::poll(&wait_fd, 1, -1);
        continue;
      }
      return;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void write_all(int fd, const std::string& text) { write_all(fd, text.data(), text.size()); }

void report(const std::string& message) {
  write_all(STDERR_FILENO, "tandem-run: " + message + "\n");
}

std::string errno_text(int error) { return std::strerror(error); }

void ensure_standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0) continue;
    int null_fd = ::open("/dev/null", O_RDWR);
    if (null_fd >= 0 && null_fd != fd) {
      ::dup2(null_fd, fd);
      ::close(null_fd);
    }
  }
}

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("cannot pick a free port: " + errno_text(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = 0;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  int error = errno;
  ::close(fd);
  if (!ok) throw std::runtime_error("cannot pick a free port: " + errno_text(error));
  return ntohs(address.sin_port);
}

void set_fd_flag(int fd, int get_command, int set_command, int flag) {
  int flags = ::fcntl(fd, get_command);
  if (flags >= 0) ::fcntl(fd, set_command, flags | flag);
}

bool make_pipe(int ends[2], bool nonblocking_write) {
  if (::pipe(ends) != 0) return false;
  for (int i = 0; i < 2; ++i) set_fd_flag(ends[i], F_GETFD, F_SETFD, FD_CLOEXEC);
  set_fd_flag(ends[0], F_GETFL, F_SETFL, O_NONBLOCK);
  if (nonblocking_write) set_fd_flag(ends[1], F_GETFL, F_SETFL, O_NONBLOCK);
  return true;
}

}  // namespace tandem::launcher
