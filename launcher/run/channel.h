// The launchers' own connection (launcher/run/nodes.cc): node 0's launcher
// and each other node's talk in short text lines over TCP, every line one
// message ("round 1 1 2 1 41234", "failed 0 137 worker 3 killed by signal 9",
// "ping"). A Channel is one end: non-blocking reads gathered into lines,
// whole-line writes, and when it last heard from and wrote to its peer (the
// heartbeat, and the silence that means the peer is gone).
//
// What it promises against a peer that does not follow the protocol:
//  1. Reading is linear and bounded: one read_some() takes at most
//     kReadBudget bytes (the rest waits for the next wake-up), lines are
//     found by scanning each byte once, and a line longer than kMaxLine
//     closes the channel.
//  2. limit_total(n): past n bytes received in all, the channel closes (a
//     connection that has not proven the cluster token may send only a
//     join's worth).
//  3. secure(key, ...): once both ends proved the token (nodes.cc), every
//     line carries a MAC under a key of that session, over its direction,
//     its sequence number and its text. A line that does not verify (a
//     relay's injection, a replay, a line of another session) is never
//     returned: it is counted and kept for the log (refused()), and the
//     next line is expected under the same number, and only lines that
//     verify count as hearing from the peer (heard()). So whoever sits
//     between two launchers can stop them talking (a line dropped or
//     altered leaves every later one unverified), which silence detects,
//     but cannot make either do anything.
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

  // Reads what has arrived, up to kReadBudget bytes (1.). False when the
  // peer closed the connection, it failed, a line grew past kMaxLine or the
  // total passed limit_total() (the channel is closed then; why() says which).
  bool read_some();
  // The next whole line received, without its newline (and, on a secured
  // channel, without its MAC: only lines that verify, 3.).
  std::optional<std::string> next_line();
  // Writes `line` and a newline whole (with its MAC on a secured channel).
  // False (and closed) when it cannot: the peer is gone or has not read for
  // so long that its buffer is full.
  bool send(const std::string& line);
  const std::string& why() const { return why_; }

  // 2.: 0 lifts the limit.
  void limit_total(size_t bytes) { limit_ = bytes; }
  size_t received() const { return received_; }
  // 3.: `key` is the session's; the labels tell the two directions apart
  // (this end sends under `send_label`, its peer under `receive_label`).
  void secure(std::string key, std::string send_label, std::string receive_label);
  bool secured() const { return !key_.empty(); }
  // Lines refused by 3. since the last call, and the last of them (raw:
  // quote it before it is logged). Resets the count.
  size_t take_refused(std::string& last);

  // When the peer was last heard from: the last bytes read, or on a
  // secured channel the last line that verified (3.).
  Clock::time_point heard() const { return heard_; }
  Clock::time_point sent() const { return sent_; }

  static constexpr size_t kMaxLine = 4096;
  static constexpr size_t kReadBudget = 64 << 10;

 private:
  std::string mac(const std::string& label, uint64_t sequence, const std::string& text) const;

  int fd_ = -1;
  std::string peer_;
  std::string in_;     // bytes received and not yet taken as lines, from start_
  size_t start_ = 0;   // where the next line begins in in_
  size_t received_ = 0;
  size_t limit_ = 0;
  std::string why_;
  std::string key_, send_label_, receive_label_;
  uint64_t sent_lines_ = 0, received_lines_ = 0;
  size_t refused_ = 0;
  std::string last_refused_;
  Clock::time_point heard_ = Clock::now();
  Clock::time_point sent_ = Clock::now();
};

// A socket listening on host:port (port 0: a free one); throws naming the
// address. With `bind_errno`, an address in use or not this host's
// (EADDRINUSE, EADDRNOTAVAIL) returns -1 with the errno there instead.
int listen_on(const std::string& host, int port, int* bind_errno = nullptr);
// The port a listening socket is bound to.
int bound_port(int fd);
// Accepts one connection as a Channel; nullopt when none is waiting or
// accept() failed (`error`: its errno, 0 when none was waiting).
std::optional<Channel> accept_channel(int listen_fd, int& error);
// Connects to host:port within `timeout`; nullopt (with `error` set) when it cannot.
std::optional<Channel> connect_channel(const std::string& host, int port,
                                       std::chrono::milliseconds timeout, std::string& error);

}  // namespace tandem::launcher
