#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/common/dial.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/rendezvous/store_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <torch/version.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace tandem::rpc {
namespace {

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > (1 << 24)) {
    throw std::invalid_argument(std::string("environment variable ") + name + "='" + v +
                                "' is not a valid non-negative integer");
  }
  return static_cast<int>(x);
}

int first_of(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    int v = env_int(n);
    if (v >= 0) return v;
  }
  return -1;
}

}  // namespace

WorldEnv world_from_env() {
  WorldEnv w;
  w.rank = first_of({"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"});
  w.world_size = first_of({"WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"});
  w.local_rank = first_of({"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"});
  w.local_world_size =
      first_of({"LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"});
  if (const char* a = std::getenv("MASTER_ADDR")) w.master_addr = a;
  w.master_port = env_int("MASTER_PORT");
  return w;
}

std::pair<int, int> rank_and_size(int rank, int world_size, const WorldEnv& env,
                                  const std::string& options) {
  const int r = rank >= 0 ? rank : env.rank;
  const int world = world_size >= 0 ? world_size : env.world_size;
  if (world <= 0) {
    throw std::invalid_argument("world size unknown: set " + options +
                                "::world_size or WORLD_SIZE (or SLURM_NTASKS, "
                                "OMPI_COMM_WORLD_SIZE)");
  }
  if (r < 0 || r >= world) {
    throw std::invalid_argument("rank " + std::to_string(r) + " is not in [0, world size " +
                                std::to_string(world) + "): set " + options + "::rank or RANK");
  }
  return {r, world};
}

std::pair<std::string, int> master_from_init_method(const std::string& init_method) {
  if (init_method.empty() || init_method == "env://") {
    WorldEnv w = world_from_env();
    if (w.master_addr.empty()) {
      throw std::invalid_argument("init_method env:// needs MASTER_ADDR in the environment");
    }
    if (w.master_port <= 0 || w.master_port > 65535) {
      throw std::invalid_argument(
          "init_method env:// needs MASTER_PORT (1-65535) in the environment");
    }
    return {w.master_addr, w.master_port};
  }
  const std::string prefix = "tcp://";
  if (init_method.rfind(prefix, 0) != 0) {
    throw std::invalid_argument("unsupported init_method '" + init_method +
                                "' (use env:// or tcp://host:port)");
  }
  std::string rest = init_method.substr(prefix.size());
  auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == rest.size()) {
    throw std::invalid_argument("init_method '" + init_method + "' lacks host:port");
  }
  std::string host = rest.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  char* end = nullptr;
  long port = std::strtol(rest.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port < 0 || port > 65535) {
    throw std::invalid_argument("init_method '" + init_method + "' has a bad port");
  }
  return {host, static_cast<int>(port)};
}

bool store_hosted_by_launcher() {
  const char* v = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  return v && (std::string(v) == "True" || std::string(v) == "true" || std::string(v) == "1");
}

void wait_for_listener(const std::string& host, int port, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    // Refused at once while nobody listens yet; a host that does not answer
    // within a second, or a name that does not resolve, is left to c10d.
    const Dialed d = dial_tcp(host, port, std::chrono::milliseconds(1000));
    if (d.fd >= 0) ::close(d.fd);
    if (d.fd >= 0 || d.error != ECONNREFUSED) return;
    if (std::chrono::steady_clock::now() + pause >= deadline) {
      throw TimeoutError("rendezvous: nothing listens at " + host + ":" + std::to_string(port) +
                         " after " + std::to_string(timeout.count()) +
                         " ms (is rank 0, or the launcher that hosts the store, running there?)");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

#if TORCH_VERSION_MAJOR < 2
namespace {

// Rank 0's store: our own server (rpc/rendezvous/store_server.h), bound to one address,
// and a c10d client of it. One server per port in a process, shared by
// every store made on it (an agent and a process group of the same job meet
// at the same MASTER_PORT), as c10d's multiTenant servers are.
std::shared_ptr<StoreServer> shared_server(const std::string& host, int port) {
  static std::mutex mu;
  static std::map<int, std::weak_ptr<StoreServer>> servers;
  std::lock_guard<std::mutex> lock(mu);
  if (port != 0) {
    if (auto s = servers[port].lock()) return s;
  }
  auto s = std::make_shared<StoreServer>(host, port);
  servers[s->port()] = s;
  return s;
}

class HostedStore final : public c10d::Store {
 public:
  HostedStore(std::shared_ptr<StoreServer> server, c10::intrusive_ptr<c10d::TCPStore> client)
      : server_(std::move(server)), client_(std::move(client)) {
    Store::setTimeout(client_->getTimeout());
  }
  void set(const std::string& k, const std::vector<uint8_t>& v) override { client_->set(k, v); }
  std::vector<uint8_t> compareSet(const std::string& k, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return client_->compareSet(k, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& k) override { return client_->get(k); }
  int64_t add(const std::string& k, int64_t v) override { return client_->add(k, v); }
  bool deleteKey(const std::string& k) override { return client_->deleteKey(k); }
  bool check(const std::vector<std::string>& keys) override { return client_->check(keys); }
  int64_t getNumKeys() override { return client_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { client_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    client_->wait(keys, t);
  }
  const std::chrono::milliseconds& getTimeout() const noexcept override {
    return client_->getTimeout();
  }
  void setTimeout(const std::chrono::milliseconds& t) override {
    Store::setTimeout(t);
    client_->setTimeout(t);
  }
  void watchKey(const std::string& k, c10d::WatchKeyCallback cb) override {
    client_->watchKey(k, std::move(cb));
  }
  int port() const { return server_->port(); }

 private:
  std::shared_ptr<StoreServer> server_;
  c10::intrusive_ptr<c10d::TCPStore> client_;
};

}  // namespace
#endif

std::string store_bind_host(const std::string& master_host) {
  if (const char* v = std::getenv("TANDEM_STORE_BIND")) return v;
  if (master_host.empty() || is_loopback_host(master_host)) return "127.0.0.1";
  return master_host;
}

c10::intrusive_ptr<c10d::Store> make_store(const std::string& host, int port, int rank,
                                           int world_size, std::chrono::milliseconds timeout) {
  const bool server = rank == 0 && !store_hosted_by_launcher();
#if TORCH_VERSION_MAJOR < 2
  const char* choice = std::getenv("TANDEM_STORE");
  if (server && !(choice && std::string(choice) == "c10d")) {
    // Listen where the workers listen: loopback for a job on one host, the
    // master's address otherwise (TANDEM_STORE_BIND chooses; TANDEM_STORE=c10d
    // falls back to LibTorch's own server, which listens everywhere).
    std::shared_ptr<StoreServer> srv;
    try {
      srv = shared_server(store_bind_host(host), port);
    } catch (const std::runtime_error& e) {
      if (std::getenv("TANDEM_STORE_BIND")) throw;
      // The master's address is not one of this host's (a name behind NAT,
      // say): listen everywhere rather than not at all, and say so.
      std::fprintf(stderr, "tandem: %s; the store listens on every interface instead\n", e.what());
      srv = shared_server("0.0.0.0", port);
    }
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(srv->port());
    opts.isServer = false;
    opts.waitWorkers = false;
    opts.timeout = timeout;
    const std::string dial = is_loopback_host(srv->host()) ? "127.0.0.1" : host;
    auto client = c10::make_intrusive<c10d::TCPStore>(dial, opts);
    return c10::make_intrusive<HostedStore>(std::move(srv), std::move(client));
  }
#endif
  // LibTorch's client sleeps a whole second after a refused connection
  // before it tries again: a worker that comes up before rank 0's store
  // listens (most of them, at start) would lose that second. Knock until
  // the store listens, quickly, and only then let the client connect.
  if (!server) wait_for_listener(host, port, timeout);
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = server;
  opts.numWorkers = world_size;
  opts.waitWorkers = false;
  opts.timeout = timeout;
  // One server per port in a process: an RPC agent and a process group of
  // the same job meet at the same MASTER_PORT (each under its own keys).
  opts.multiTenant = true;
  auto store = c10::make_intrusive<c10d::TCPStore>(host, opts);
  // A launcher's store can outlive a round of workers (torchrun keeps its
  // own for the whole job, through every restart): each round meets under
  // keys of its own, as PyTorch's workers do, so nothing of an earlier
  // round is read again. (Round 0 keeps the bare keys: the workers of a
  // node whose launcher does not host the store do not know it is hosted.)
  // tandem-run opens a fresh store for every round, so its workers keep the
  // bare keys on every node.
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const char* launcher = std::getenv("TANDEM_LAUNCHER");
  const bool fresh_each_round = launcher && std::string(launcher) == "tandem-run";
  if (!server && !fresh_each_round && store_hosted_by_launcher() && attempt && *attempt &&
      std::string(attempt) != "0") {
    return c10::make_intrusive<c10d::PrefixStore>(std::string("/worker/attempt_") + attempt,
                                                  std::move(store));
  }
  return store;
}

bool is_loopback_host(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  if (::inet_pton(AF_INET, host.c_str(), &a) == 1) return (ntohl(a.s_addr) >> 24) == 127;
  return false;
}

std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res) return "";
  std::string out;
  int fd = ::socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    if (::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      char buf[INET6_ADDRSTRLEN] = {};
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
        const void* addr =
            ss.ss_family == AF_INET6
                ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr)
                : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&ss)->sin_addr);
        if (::inet_ntop(ss.ss_family, addr, buf, sizeof(buf))) out = buf;
      }
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return out;
}

}  // namespace tandem::rpc
