// The launchers' own connection (launcher/run/nodes.cc): node 0's launcher
// and each other node's talk in short text lines over TCP, every line one
// message ("round 1 1 2 1 41234", "failed 0 137 worker 3 killed by signal 9",
// "ping"). A Channel is one end: non-blocking reads gathered into lines,
// whole-line writes, and when it last heard from and wrote to its peer (the
// heartbeat, and the silence that means the peer is gone).
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace tandem::launcher {

class Channel {
 public:
  using Clock = std::chrono::steady_clock;

  Channel() = default;
  // Takes `fd` (a connected socket, made non-blocking here); `peer` names the other end.
  Channel(int fd, std::string peer);
  ~Channel();
  Channel(Channel&& other) noexcept;
  Channel& operator=(Channel&& other) noexcept;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& peer() const { return peer_; }
  void close();

  // Reads what has arrived. False when the peer closed the connection, it
  // failed, or a line grew past kMaxLine (the channel is closed then; why()
  // says which).
  bool read_some();
  // The next whole line received, without its newline.
  std::optional<std::string> next_line();
  // Writes `line` and a newline whole. False (and closed) when it cannot:
  // the peer is gone or has not read for so long that its buffer is full.
  bool send(const std::string& line);
  const std::string& why() const { return why_; }

  Clock::time_point heard() const { return heard_; }
  Clock::time_point sent() const { return sent_; }

  static constexpr size_t kMaxLine = 4096;

 private:
  int fd_ = -1;
  std::string peer_;
  std::string in_;
  std::string why_;
  Clock::time_point heard_ = Clock::now();
  Clock::time_point sent_ = Clock::now();
};

// A socket listening on host:port (port 0: a free one); throws naming the address.
int listen_on(const std::string& host, int port);
// The port a listening socket is bound to.
int bound_port(int fd);
// Accepts one connection (nullopt when none is waiting) as a Channel.
std::optional<Channel> accept_channel(int listen_fd);
// Connects to host:port within `timeout`; nullopt (with `error` set) when it cannot.
std::optional<Channel> connect_channel(const std::string& host, int port,
                                       std::chrono::milliseconds timeout, std::string& error);

}  // namespace tandem::launcher
