// Opening a TCP connection, shared by the transport (rpc/transport/uv/) and
// the rendezvous (waiting for the store to listen).
#pragma once

#include <chrono>
#include <string>

namespace tandem::rpc {

struct Dialed {
  int fd = -1;      // a connected non-blocking socket (the caller closes it), or -1
  int error = 0;    // with fd -1: the last connect's errno (0 when the name did not resolve)
  std::string why;  // with fd -1: "cannot resolve ..." or "cannot connect to host:port: ..."
};

// Connects to host:port, trying each address it resolves to, for at most
// `timeout` in all (0: no limit of its own).
Dialed dial_tcp(const std::string& host, int port, std::chrono::milliseconds timeout);

}  // namespace tandem::rpc
