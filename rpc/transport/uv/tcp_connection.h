// A TCP connection of the uv (and shm) backends: the stream part
// (stream_connection.h) over a TCP socket, and the socket work that is
// TCP's own (options, addresses, the listener). Everything a TCP connection
// does per frame is the stream part's; the transport (uv_transport.h)
// listens, accepts and dials with the functions below and makes one
// connection per socket. Nothing here runs on a thread of its own.
#pragma once

#include <sys/socket.h>

#include <string>

#include "tandem/rpc/transport/uv/stream_connection.h"

namespace tandem::rpc {

class TcpConnection final : public StreamConnection {
 public:
  TcpConnection(UvTransport* transport, int fd, uint64_t id, std::string peer, bool accepted)
      : StreamConnection(transport, Kind::kTcp, fd, id, std::move(peer), accepted) {}
};

// No Nagle delay, and a peer host that vanishes is noticed within ~16 s.
void set_tcp_options(int fd);
// "host:port" of an IPv4 or IPv6 address.
std::string tcp_address(const sockaddr* sa);
// A non-blocking socket bound to `host`:`port` and listening; `bound` is
// the port it got (useful with port 0). Throws when it cannot.
int open_tcp_listener(const std::string& host, int port, int& bound);

}  // namespace tandem::rpc
