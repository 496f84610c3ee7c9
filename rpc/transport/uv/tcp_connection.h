// A TCP connection of the uv (and shm) backends: the stream part
// (stream_connection.h) over a TCP socket, and the socket work that is
// TCP's own (options, addresses, the listener). Everything a TCP connection
// does per frame is the stream part's; the transport (uv_transport.h)
// listens, accepts and dials with the functions below and makes one
// connection per socket. Nothing here runs on a thread of its own.
//
// Polling and sleeping (rpc/transport.h, 8. and 10.; Limits::poll_while_spinning
// and sleep_on_connection):
//  1. A thread that spins anyway reads the socket itself (poll_inline(): a
//     recv() that finds nothing costs a system call, where a ring's look
//     costs two loads), as the stream part's poller (stream_connection.h,
//     3.), a gulp of kPollerGulp bytes at a time: what it begins and cannot
//     end there (a larger frame, one not all here) is the loop thread's to
//     end, and pollers keep off until it has (inline_ok_).
//  2. One whose spin ran out sleeps in ppoll() on the socket and an eventfd
//     of its own (its Bell): the peer's bytes wake it, and it reads them as
//     in 1. while it counts as a reader. The kernel wakes the loop thread's
//     epoll too, in parallel: finding a reader and a small frame next, the
//     loop leaves the bytes to it (yield_read_from_loop), giving up its
//     core, and its level-triggered watch brings it back while they wait;
//     past kYieldFor it reads them itself (a sleeper that was not
//     scheduled). Bytes a sleeper woke for but could not deliver (a large
//     frame, a message for the loop thread, the end) make it stop reading,
//     so that the loop does at once, and sleep on its bell alone, which
//     whatever it waits for rings.
//     A sleep's waker rings its bell; the connection's end rings every
//     sleeper's (wake_sleepers()), and a sleep that finds the connection no
//     longer readable here says so.
#pragma once

#include <sys/socket.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/rpc/transport/uv/stream_connection.h"

namespace tandem::rpc {

class TcpConnection final : public StreamConnection {
 public:
  TcpConnection(UvTransport* transport, int fd, uint64_t id, std::string peer, bool accepted)
      : StreamConnection(transport, Kind::kTcp, fd, id, std::move(peer), accepted) {}

  bool poll_inline() override;
  std::unique_ptr<ConnectionSleeper> sleeper_here() override;
  void wake_sleepers() override;
  bool yield_read_from_loop() override;

  // A sleep's own wake-up: an eventfd, kept as long as a waker may write it.
  class Bell;

 private:
  // Whether the socket's next bytes start a frame a poller reads in one
  // gulp (kPollerGulp), as far as a look shows that takes nothing and no
  // lock: it only chooses who reads, and the loop reading is always right
  // (a preamble not all here yet, and the end, count as small).
  bool small_frame_next() const;
  // One ConnectionSleep::wait with `bell` (2. above).
  bool sleep_polling(const std::shared_ptr<Bell>& bell, std::chrono::microseconds timeout,
                     const std::function<bool()>& done);

  // A sleep on this socket, counted while it lasts (in sleepers_, rung by
  // the end) and while it may read (in readers_, for the loop to yield to).
  class Sleeping {
   public:
    Sleeping(TcpConnection* conn, const std::shared_ptr<Bell>& bell);
    ~Sleeping();
    Sleeping(const Sleeping&) = delete;
    Sleeping& operator=(const Sleeping&) = delete;
    void stop_reading();

   private:
    TcpConnection* const conn_;
    const std::shared_ptr<Bell>& bell_;
    bool reading_ = true;
  };

  std::mutex sleep_mu_;
  std::vector<std::shared_ptr<Bell>> sleepers_;  // asleep on this socket (under sleep_mu_)
  int readers_ = 0;  // of them, those that may read it (under sleep_mu_)
  // When the loop first left bytes to the readers (under sleep_mu_; reset
  // as the last one stops): how long it has waited for them.
  Clock::time_point yielded_since_{};
};

// No Nagle delay, and a peer host that vanishes is noticed within ~16 s.
void set_tcp_options(int fd);
// "host:port" of an IPv4 or IPv6 address.
std::string tcp_address(const sockaddr* sa);
// A non-blocking socket bound to `host`:`port` and listening; `bound` is
// the port it got (useful with port 0). Throws when it cannot.
int open_tcp_listener(const std::string& host, int port, int& bound);

}  // namespace tandem::rpc
