#include "tandem/rpc/transport/uv/uv_transport.h"

#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/common/dial.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/transport/shm/local_connection.h"
#include "tandem/rpc/transport/uv/stream_connection.h"
#include "tandem/rpc/transport/uv/tcp_connection.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include <cassert>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace tandem::rpc {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

using Clock = std::chrono::steady_clock;
constexpr auto kSweepPeriod = std::chrono::milliseconds(250);
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);
constexpr auto kRingRetry = std::chrono::milliseconds(1);

}  // namespace

struct UvTransport::Loop {
  uv_loop_t loop;
  uv_async_t wake;
  uv_poll_t listen_poll;
  bool listening = false;
  uv_poll_t local_poll;  // the shm backend's same-host listener
  bool local_listening = false;
  uv_timer_t sweep;         // closes handshakes that took too long
  uv_timer_t accept_retry;  // restarts accepting after a back-off (EMFILE)
  uv_timer_t ring_retry;    // full rings whose reader sends no wake-ups (ring.h, 3.)
  bool ring_retry_active = false;
};

UvTransport::UvTransport(Limits limits, Callbacks callbacks, bool shared_memory)
    : limits_(limits),
      callbacks_(std::move(callbacks)),
      shared_memory_(shared_memory),
      loop_(std::make_unique<Loop>()),
      staging_(kStagingBytes) {
  uv_loop_init(&loop_->loop);
  loop_->wake.data = this;
  uv_async_init(&loop_->loop, &loop_->wake,
                [](uv_async_t* h) { static_cast<UvTransport*>(h->data)->run_commands(); });
  loop_->sweep.data = this;
  uv_timer_init(&loop_->loop, &loop_->sweep);
  const auto period = static_cast<uint64_t>(kSweepPeriod.count());
  uv_timer_start(
      &loop_->sweep,
      [](uv_timer_t* h) { static_cast<UvTransport*>(h->data)->sweep_from_loop(); },
      period, period);
  loop_->accept_retry.data = this;
  uv_timer_init(&loop_->loop, &loop_->accept_retry);
  loop_->ring_retry.data = this;
  uv_timer_init(&loop_->loop, &loop_->ring_retry);
  thread_ = std::thread([this] {
    StreamConnection::no_polling_here() = true;
    uv_run(&loop_->loop, UV_RUN_DEFAULT);
  });
  thread_id_ = thread_.get_id();
}

UvTransport::~UvTransport() { close(); }

bool UvTransport::post(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (loop_gone_) return false;
  commands_.push_back(std::move(fn));
  uv_async_send(&loop_->wake);
  return true;
}

void UvTransport::run_commands() {
  std::vector<std::function<void()>> cmds;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cmds.swap(commands_);
  }
  for (auto& c : cmds) c();
}

int UvTransport::listen(const std::string& host, int port) {
  int bound = 0;
  const int fd = open_tcp_listener(host, port, bound);
  if (!start_listening(fd, /*local=*/false)) throw ShutdownError("transport is closed");
  if (shared_memory_) listen_local();
  return bound;
}

bool UvTransport::start_listening(int fd, bool local) {
  bool posted = post([this, fd, local] {
    if (stopped_) {
      ::close(fd);
      return;
    }
    (local ? local_fd_ : listen_fd_) = fd;
    uv_poll_t& poll = local ? loop_->local_poll : loop_->listen_poll;
    poll.data = this;
    uv_poll_init_socket(&loop_->loop, &poll, fd);
    (local ? loop_->local_listening : loop_->listening) = true;
    watch_listener_from_loop();
  });
  if (!posted) ::close(fd);
  return posted;
}

void UvTransport::listen_local() {
  // An abstract socket: no file to leave behind, and only this network
  // namespace can reach it (which is what "the same host" means here).
  const std::string& key = local_host_key();
  if (key.empty()) {
    std::fprintf(stderr,
                 "tandem: no same-host endpoint (cannot read this host's boot id or "
                 "network namespace); peers on this host use TCP\n");
    return;
  }
  const std::string name = "tandem-" + random_hex(8);
  const auto [addr, len] = abstract_address(name);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0 ||
      ::listen(fd, 1024) != 0) {
    std::fprintf(stderr, "tandem: no same-host endpoint (%s); peers on this host use TCP\n",
                 errno_text(errno).c_str());
    if (fd >= 0) ::close(fd);
    return;
  }
  if (!start_listening(fd, /*local=*/true)) return;
  std::lock_guard<std::mutex> lock(mu_);
  local_endpoint_ = "shm:" + key + ":" + name;
  local_name_ = name;
}

std::string UvTransport::local_endpoint() const {
  std::lock_guard<std::mutex> lock(mu_);
  return local_endpoint_;
}

ConnectionPtr UvTransport::connect_local(const std::string& endpoint,
                                         std::chrono::milliseconds timeout) {
  const auto cut = endpoint.rfind(':');
  if (endpoint.rfind("shm:", 0) != 0 || cut == std::string::npos || cut < 4) {
    throw std::invalid_argument("not a same-host endpoint: '" + endpoint + "'");
  }
  if (!shared_memory_) return nullptr;
  if (endpoint.substr(4, cut - 4) != local_host_key()) return nullptr;  // another host or namespace
  const std::string name = endpoint.substr(cut + 1);
  if (name.empty() || name.size() + 1 > sizeof(sockaddr_un::sun_path)) {
    throw std::invalid_argument("bad same-host endpoint name in '" + endpoint + "'");
  }
  const auto [addr, len] = abstract_address(name);
  const auto deadline = Clock::now() + timeout;
  int fd = -1;
  for (;;) {
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw DisconnectedError("cannot make a socket: " + errno_text(errno));
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) == 0) break;
    const int err = errno;
    ::close(fd);
    fd = -1;
    // A full backlog answers EAGAIN; try again until the timeout.
    if ((err == EAGAIN || err == EINTR) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    throw DisconnectedError("cannot connect to @" + name + ": " + errno_text(err));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::shared_ptr<LocalConnection> conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conn = std::make_shared<LocalConnection>(this, fd, next_id_++, "shm:@" + name,
                                             /*accepted=*/false);
  }
  std::string why;
  if (!conn->say_hello(why)) {
    ::close(fd);
    throw DisconnectedError("cannot open a same-host connection to @" + name + ": " + why);
  }
  if (!post([this, conn] { adopt_from_loop(conn); })) {
    ::close(fd);
    throw ShutdownError("transport is closed");
  }
  return conn;
}

ConnectionPtr UvTransport::connect(const std::string& host, int port,
                                   std::chrono::milliseconds timeout) {
  const std::string where = host + ":" + std::to_string(port);
  const Dialed dialed = dial_tcp(host, port, timeout);
  if (dialed.fd < 0) throw DisconnectedError(dialed.why);
  const int fd = dialed.fd;
  set_tcp_options(fd);
  std::shared_ptr<TcpConnection> conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    conn = std::make_shared<TcpConnection>(this, fd, next_id_++, where, /*accepted=*/false);
  }
  if (!post([this, conn] { adopt_from_loop(conn); })) {
    ::close(fd);
    throw ShutdownError("transport is closed");
  }
  return conn;
}

void UvTransport::watch_listener_from_loop() {
  if (loop_->listening) {
    uv_poll_start(&loop_->listen_poll, UV_READABLE, [](uv_poll_t* h, int status, int) {
      if (status >= 0) static_cast<UvTransport*>(h->data)->accept_from_loop(false);
    });
  }
  if (loop_->local_listening) {
    uv_poll_start(&loop_->local_poll, UV_READABLE, [](uv_poll_t* h, int status, int) {
      if (status >= 0) static_cast<UvTransport*>(h->data)->accept_from_loop(true);
    });
  }
}

void UvTransport::accept_from_loop(bool local) {
  assert(on_transport_thread());
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = ::accept4(local ? local_fd_ : listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      // Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the
      // pending connection stays queued and the listener stays readable, so
      // polling it again at once would spin. Stop watching it for a moment.
      ++counters_.accept_backoffs;
      if (!accept_error_logged_) {
        accept_error_logged_ = true;
        std::fprintf(stderr,
                     "tandem: accepting a connection failed: %s; not accepting for %d ms at a "
                     "time while it lasts (logged once)\n",
                     errno_text(err).c_str(), static_cast<int>(kAcceptBackoff.count()));
      }
      if (loop_->listening) uv_poll_stop(&loop_->listen_poll);
      if (loop_->local_listening) uv_poll_stop(&loop_->local_poll);
      uv_timer_start(
          &loop_->accept_retry,
          [](uv_timer_t* h) { static_cast<UvTransport*>(h->data)->watch_listener_from_loop(); },
          static_cast<uint64_t>(kAcceptBackoff.count()), 0);
      return;
    }
    if (handshaking_ >= limits_.max_handshaking_connections) {
      // Connections that have not finished their handshake are capped: a
      // crowd of them (slow-loris) cannot hold the descriptors a worker needs.
      ++counters_.refused;
      ::close(fd);
      continue;
    }
    if (!local) {
      set_tcp_options(fd);
      std::shared_ptr<TcpConnection> conn;
      {
        std::lock_guard<std::mutex> lock(mu_);
        conn = std::make_shared<TcpConnection>(this, fd, next_id_++,
                                               tcp_address(reinterpret_cast<sockaddr*>(&ss)),
                                               /*accepted=*/true);
      }
      adopt_from_loop(conn);
      continue;
    }
    std::shared_ptr<LocalConnection> conn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const uint64_t id = next_id_++;
      conn = std::make_shared<LocalConnection>(
          this, fd, id, "shm:@" + local_name_ + "#" + std::to_string(id), /*accepted=*/true);
    }
    std::string why;
    if (!conn->say_hello(why)) {
      ::close(fd);
      continue;
    }
    adopt_from_loop(conn);
  }
}

void UvTransport::adopt_from_loop(const std::shared_ptr<StreamConnection>& conn) {
  assert(on_transport_thread());
  if (stopped_) {  // raced with close(): nothing is registered, just drop the socket
    conn->drop_unadopted();
    return;
  }
  conns_[conn->id()] = conn;
  ++live_connections_;
  if (conn->accepted()) ++handshaking_;
  conn->adopt_from_loop(&loop_->loop, /*counted_handshaking=*/conn->accepted());
}

void UvTransport::forget_from_loop(const std::shared_ptr<StreamConnection>& conn,
                                   const std::string& reason) {
  conns_.erase(conn->id());
  --live_connections_;
  if (callbacks_.on_closed) callbacks_.on_closed(conn, reason);
}

void UvTransport::retry_ring_from_loop(const std::shared_ptr<StreamConnection>& conn) {
  assert(on_transport_thread());
  if (stopped_ || conn->closed_on_loop()) return;
  ring_retry_.push_back(conn);
  if (loop_->ring_retry_active) return;
  loop_->ring_retry_active = true;
  uv_timer_start(
      &loop_->ring_retry,
      [](uv_timer_t* h) {
        auto* t = static_cast<UvTransport*>(h->data);
        t->loop_->ring_retry_active = false;
        // A write that finds the ring still full asks again (local_connection.cc, write_ring).
        std::vector<std::weak_ptr<StreamConnection>> due = std::move(t->ring_retry_);
        t->ring_retry_.clear();
        for (auto& weak : due) {
          if (auto c = weak.lock(); c && !c->closed_on_loop()) c->flush_if_queued_from_loop();
        }
      },
      kRingRetry.count(), 0);
}

void UvTransport::sweep_from_loop() {
  assert(on_transport_thread());
  const auto now = Clock::now();
  // A sweep long after the last one means this process was stopped (or
  // starved): what its peers sent meanwhile is still unread, so nobody is
  // judged this time (10.).
  const bool held_up = last_sweep_ != Clock::time_point{} && now - last_sweep_ > kSweepPeriod * 8;
  last_sweep_ = now;
  std::vector<std::shared_ptr<StreamConnection>> late;
  for (auto& [id, conn] : conns_) {
    if (conn->handshake_overdue(now, limits_.handshake_timeout)) late.push_back(conn);
  }
  for (auto& conn : late) {
    if (!conn->accepted() && limits_.peer_timeout.count() > 0) {
      // We dialed a worker whose kernel took the connection but whose
      // transport never answered: stalled, as silence says (10.), unless
      // the answer waits unread because this process was held up.
      if (held_up) continue;
      conn->read_from_loop();
      if (conn->closed_on_loop() || !conn->handshake_overdue(now, limits_.handshake_timeout)) {
        continue;
      }
      conn->close_stalled_from_loop("no answer to the handshake from " + conn->peer_address() +
                                    " within " +
                                    std::to_string(limits_.handshake_timeout.count()) +
                                    " ms: its process is stopped or stalled");
      continue;
    }
    ++counters_.handshake_timeouts;
    conn->close_from_loop("protocol error from " + conn->peer_address() + ": no handshake within " +
                          std::to_string(limits_.handshake_timeout.count()) + " ms");
  }
  // Liveness (10.): heartbeats always (a peer may judge silence even where
  // this one does not), judging only with a timeout.
  std::vector<std::shared_ptr<StreamConnection>> conns;
  conns.reserve(conns_.size());
  for (auto& [id, conn] : conns_) conns.push_back(conn);  // (a close changes conns_)
  for (auto& conn : conns) conn->keep_alive_from_loop(now, limits_.peer_timeout, held_up);
}

TransportStats UvTransport::stats() const {
  const TransportCounters& c = counters_;
  TransportStats s;
  s.read_pauses = c.read_pauses.load();
  s.handshake_timeouts = c.handshake_timeouts.load();
  s.refused_connections = c.refused.load();
  s.accept_backoffs = c.accept_backoffs.load();
  s.shared_tensors = c.shared_tensors.load();
  s.shared_bytes = c.shared_bytes.load();
  s.shared_fallbacks = c.shared_fallbacks.load();
  s.bytes_sent = c.bytes_sent.load();
  s.bytes_received = c.bytes_received.load();
  s.heartbeats = c.heartbeats.load();
  s.stalled_peers = c.stalled_peers.load();
  s.polled_messages = c.polled_messages.load();
  s.ring_wakes = c.ring_wakes.load();
  s.ring_bells = c.ring_bells.load();
  return s;
}

void UvTransport::stop_from_loop() {
  assert(on_transport_thread());
  stopped_ = true;
  uv_close(reinterpret_cast<uv_handle_t*>(&loop_->sweep), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&loop_->accept_retry), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&loop_->ring_retry), nullptr);
  ring_retry_.clear();
  if (loop_->listening) {
    loop_->listening = false;
    uv_close(reinterpret_cast<uv_handle_t*>(&loop_->listen_poll), [](uv_handle_t* h) {
      auto* t = static_cast<UvTransport*>(h->data);
      ::close(t->listen_fd_);
      t->listen_fd_ = -1;
    });
  }
  if (loop_->local_listening) {
    loop_->local_listening = false;
    uv_close(reinterpret_cast<uv_handle_t*>(&loop_->local_poll), [](uv_handle_t* h) {
      auto* t = static_cast<UvTransport*>(h->data);
      ::close(t->local_fd_);
      t->local_fd_ = -1;
    });
  }
  auto conns = conns_;
  for (auto& [id, conn] : conns) conn->close_from_loop("transport closed");
  {
    std::lock_guard<std::mutex> lock(mu_);
    loop_gone_ = true;
  }
  // Commands that raced in before loop_gone_ was set still run.
  run_commands();
  uv_close(reinterpret_cast<uv_handle_t*>(&loop_->wake), nullptr);
}

bool UvTransport::on_transport_thread() const { return thread_id_ == std::this_thread::get_id(); }

void UvTransport::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) return;
    closing_ = true;
  }
  post([this] { stop_from_loop(); });
  if (thread_.joinable()) thread_.join();
  uv_loop_close(&loop_->loop);
}

namespace {
std::weak_ptr<Connection>& polled_connection() {
  thread_local std::weak_ptr<Connection> conn;
  return conn;
}
}  // namespace

void remember_connection_for_polling(const ConnectionPtr& conn) { polled_connection() = conn; }

bool poll_this_threads_connection() {
  auto conn = polled_connection().lock();
  return conn && conn->poll_inline();
}

TransportFactory tcp_transport() {
  return [](const Limits& limits, Transport::Callbacks callbacks) -> std::unique_ptr<Transport> {
    return std::make_unique<UvTransport>(limits, std::move(callbacks), /*shared_memory=*/false);
  };
}

TransportFactory shm_transport() {
  return [](const Limits& limits, Transport::Callbacks callbacks) -> std::unique_ptr<Transport> {
    return std::make_unique<UvTransport>(limits, std::move(callbacks), /*shared_memory=*/true);
  };
}

}  // namespace tandem::rpc
