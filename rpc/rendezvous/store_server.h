// StoreServer: the rendezvous store's server, bound where the workers
// listen, speaking the protocol of LibTorch 1.13's c10d::TCPStore so that
// its clients (the agents, Gloo's process groups) connect to it unchanged.
//
// Why our own: LibTorch 1.13's TCPStore server binds every interface, and
// anyone who can reach it can write to it (plant a worker's address,
// overwrite a barrier). This one binds one address: loopback for a job on
// one host, the master's address for a job on several. It is plain POSIX
// (no LibTorch), so tandem-run can host it too.
//
// The protocol (1.13; every integer in host byte order):
//   query      = type:u8, then by type
//   SET        = key, value                       -> nothing
//   COMPARE_SET= key, expected, desired           -> value (the key's value after)
//   GET        = key                              -> value
//   ADD        = key, delta:i64                   -> i64 (the sum, kept as decimal text)
//   CHECK      = n:u64, n x key                   -> u8 (0 ready, 1 not ready)
//   WAIT       = n:u64, n x key                   -> u8 0 once every key exists
//   GETNUMKEYS =                                  -> i64
//   DELETE_KEY = key                              -> i64 (keys deleted)
//   key, value = length:u64, bytes
// WATCH_KEY (1.13's callback socket) is not served: a client asking for it
// is closed (nothing in Tandem or Gloo's CPU path uses it).
//
// Lifetime: the constructor binds and starts one thread (poll() over the
// listener and every client); the destructor stops and joins it and closes
// every socket. A malformed or oversized query closes that client only.
// LibTorch 2.x speaks a newer protocol: make_store() uses this server only
// with LibTorch 1.x (TANDEM_STORE_SERVER_COMPATIBLE, set by CMake).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

namespace tandem::rpc {

class StoreServer {
 public:
  // Binds host:port (port 0: a free one) and serves. Throws
  // std::runtime_error naming the address when it cannot listen there.
  // With `hosted_by_launcher`, it holds kLauncherKey from the start: a launcher's
  // store, which a worker on any node can tell outlives rank 0.
  StoreServer(const std::string& host, int port, bool hosted_by_launcher = false);
  static constexpr const char* kLauncherKey = "tandem/store_hosted_by";
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }
  const std::string& host() const { return host_; }

  // Largest key and value a client may send (bigger: that client is closed).
  static constexpr uint64_t kMaxKeyBytes = 1 << 20;
  static constexpr uint64_t kMaxValueBytes = 256ull << 20;

 private:
  struct State;
  void run();

  std::string host_;
  int port_ = 0;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};        // a pipe: the destructor writes to stop run()
  std::unique_ptr<State> state_;  // run()'s thread only, until joined
  std::thread thread_;
};

}  // namespace tandem::rpc
