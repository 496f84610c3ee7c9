// The agent's start-up (rendezvous) and what it tells about itself. The
// handshake on every connection is in handshake.cc, shutdown in
// shutdown.cc, CUDA IPC's held buffers in cuda_ipc.cc, the outgoing side in
// calls.cc, the incoming side in dispatch.cc, the connection table in
// connections.cc.
#include "tandem/rpc/agent/agent_impl.h"

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <tuple>

#include <unistd.h>

#include "tandem/rpc/agent/call_table.h"
#include "tandem/rpc/agent/connection_table.h"
#include "tandem/rpc/agent/handshake.h"
#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/common/host.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rendezvous/worker_entry.h"
#include "tandem/rpc/rref_context.h"
#include "tandem/rpc/wire/device.h"

namespace tandem::rpc {
namespace {

std::mutex g_extensions_mu;
std::vector<ExtensionFactory>& extension_factories() {
  static std::vector<ExtensionFactory> factories;
  return factories;
}

}  // namespace

void register_agent_extension(ExtensionFactory factory) {
  std::lock_guard<std::mutex> lock(g_extensions_mu);
  extension_factories().push_back(std::move(factory));
}

AgentOptions& AgentOptions::set_device_map(const std::string& worker,
                                           const std::map<int, int>& map) {
  auto& mine = device_maps[worker];
  for (auto [from, dst] : map) {
    if (from < 0 || dst < 0 || from > 127 || dst > 127) {
      throw std::invalid_argument("set_device_map(\"" + printable(worker) + "\"): device " +
                                  std::to_string(from < 0 || from > 127 ? from : dst) +
                                  " is not a CUDA device index");
    }
    auto [it, fresh] = mine.emplace(from, dst);
    if (!fresh && it->second != dst) {
      throw std::invalid_argument("set_device_map(\"" + printable(worker) +
                                  "\"): cuda:" + std::to_string(from) +
                                  " is already mapped to cuda:" + std::to_string(it->second));
    }
  }
  return *this;
}

AgentImpl::AgentImpl(Agent& self, AgentOptions options, std::shared_ptr<Registry> registry)
    : self_(self),
      options_(std::move(options)),
      registry_(registry ? std::move(registry) : std::make_shared<Registry>()) {}

void AgentImpl::start(c10::intrusive_ptr<c10d::Store> store) {
  // Where init's time goes, for the trace (written once the tracer exists).
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t_start = Clock::now();
  Clock::time_point t_store, t_listen, t_met;
  WorldEnv env = world_from_env();
  int world = 0;
  std::tie(rank_, world) = rank_and_size(options_.rank, options_.world_size, env, "AgentOptions");
  if (options_.num_worker_threads < 1) {
    throw std::invalid_argument("num_worker_threads must be at least 1");
  }
  if (options_.rpc_timeout.count() < 0) throw std::invalid_argument("rpc_timeout must be >= 0");
  if (options_.sync_spin.count() < 0) throw std::invalid_argument("sync_spin must be >= 0");
  if (options_.pool_spin.count() < 0) throw std::invalid_argument("pool_spin must be >= 0");
  if (options_.token.empty()) {
    if (const char* t = std::getenv("TANDEM_TOKEN")) options_.token = t;
  }
  if (const char* s = std::getenv("TANDEM_SLEEP_ON_CONNECTION"); s && std::strcmp(s, "0") == 0) {
    options_.limits.sleep_on_connection = false;  // (an A/B of rpc/transport.h, 10.)
  }
  if (const char* s = std::getenv("TANDEM_POLL_WHILE_SPINNING"); s && std::strcmp(s, "0") == 0) {
    options_.limits.poll_while_spinning = false;  // (an A/B of rpc/transport.h, 8.)
  }
  if (options_.transport_mode.empty()) {
    const char* m = std::getenv("TANDEM_TRANSPORT");
    options_.transport_mode = m && *m ? m : "auto";
  }
  if (options_.transport_mode != "auto" && options_.transport_mode != "shm" &&
      options_.transport_mode != "tcp") {
    throw std::invalid_argument("transport '" + printable(options_.transport_mode) +
                                "' is none of auto, shm, tcp (AgentOptions::transport_mode or "
                                "TANDEM_TRANSPORT)");
  }
  if (options_.peer_timeout == kDefaultTimeout) {
    if (const char* t = std::getenv("TANDEM_PEER_TIMEOUT"); t && *t) {
      char* end = nullptr;
      const double seconds = std::strtod(t, &end);
      if (end == t || *end != '\0' || !(seconds >= 0) || seconds > 86400) {
        throw std::invalid_argument("TANDEM_PEER_TIMEOUT '" + printable(t) +
                                    "' is not a number of seconds from 0 (never) to 86400");
      }
      options_.peer_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    } else {
      options_.peer_timeout = options_.limits.peer_timeout;
    }
  }
  options_.limits.peer_timeout = options_.peer_timeout;
  if (options_.peer_timeout.count() < 0) {
    throw std::invalid_argument("peer_timeout must be >= 0 (0: never)");
  }
  // Peers write a heartbeat at least every second (rpc/transport.h, 9.).
  if (options_.peer_timeout.count() > 0 && options_.peer_timeout < std::chrono::seconds(2)) {
    throw std::invalid_argument("peer_timeout " + std::to_string(options_.peer_timeout.count()) +
                                " ms is too short: 0 (never) or at least 2000 ms (peers write "
                                "a heartbeat a second)");
  }
  self_name_ = options_.name.empty() ? "worker" + std::to_string(rank_) : options_.name;
  std::string master_host;
  if (!store) {
    auto [host, port] = master_from_init_method(options_.init_method);
    if (port == 0 && world > 1) {
      throw std::invalid_argument("init_method '" + options_.init_method +
                                  "': port 0 only works for a world of one worker");
    }
    master_host = host;
    store_address_ = host + ":" + std::to_string(port);
    store = make_store(host, port, rank_, world, options_.init_timeout);
    owns_store_ = true;
  }
  store_ = std::move(store);
  t_store = Clock::now();

  std::string listen_host = options_.listen_host;
  if (listen_host.empty()) {
    listen_host = master_host.empty() || is_loopback_host(master_host) ? "127.0.0.1" : "0.0.0.0";
  }
  std::string advertise = options_.advertise_host;
  if (advertise.empty()) {
    if (listen_host != "0.0.0.0" && listen_host != "::") {
      advertise = listen_host;
    } else {
      advertise = local_address_towards(master_host);
      if (advertise.empty())
        throw std::runtime_error("cannot tell this host's address; set advertise_host");
    }
  }

  if (options_.retain_freed_memory) retain_freed_memory();
  pool_ = std::make_shared<ThreadPool>(options_.num_worker_threads, options_.pool_spin,
                                       self_.weak_from_this());
  internal_ = std::make_shared<Registry>();
  loop_internal_ = std::make_shared<Registry>();
  rrefs_ = std::make_shared<RRefContext>(self_);
  rrefs_->register_handlers(*internal_);
  {
    std::lock_guard<std::mutex> lock(g_extensions_mu);
    for (const auto& make : extension_factories()) {
      auto ext = make(self_);
      ext->register_handlers(*internal_);
      ext->register_loop_handlers(*loop_internal_);
      extensions_.push_back(std::move(ext));
    }
  }
  if (options_.trace_dir.empty()) {
    if (const char* t = std::getenv("TANDEM_TRACE")) options_.trace_dir = t;
  }
  if (!options_.trace_dir.empty()) trace_ = Tracer::open(options_.trace_dir, rank_, self_name_);
  internal_->def("tandem.trace.clock", []() {
    return std::make_tuple(Tracer::micros(std::chrono::steady_clock::now()), boot_id());
  });
  calls_ = std::make_unique<CallTable>(
      [pool = pool_](std::function<void()> fn) { pool->post(std::move(fn)); },
      [this](int rank) { return workers_.at(rank).name; }, metrics_.get());
  calls_->set_tracer(trace_.get(), rank_);
  Transport::Callbacks cb;
  cb.on_message = [this](const ConnectionPtr& c, Message&& m) {
    on_message_from_loop(c, std::move(m));
  };
  cb.on_closed = [this](const ConnectionPtr& c, const std::string& r) {
    on_closed_from_loop(c, r);
  };
  cb.inline_ok = [this](const Message& m) { return inline_ok(m); };
  handshakes_ = std::make_unique<HandshakeTable>();
  protocol_log_ = std::make_unique<ProtocolLog>();
  TransportFactory make = options_.transport                 ? options_.transport
                          : options_.transport_mode == "tcp" ? tcp_transport()
                                                             : shm_transport();
  transport_ = make(options_.limits, std::move(cb));

  try {
    WorkerInfo self;
    self.rank = rank_;
    self.name = self_name_;
    if (self.name.find_first_of("\t\n") != std::string::npos) {
      throw std::invalid_argument("worker name '" + self.name + "' contains a tab or newline");
    }
    self.host = advertise;
    self.cuda_devices = device::cuda_device_count();
    self.process = boot_id() + ":" + std::to_string(::getpid());
    self.device_maps = options_.device_maps;
    self.port = transport_->listen(listen_host, 0);
    if (options_.transport_mode != "tcp") self.local = transport_->local_endpoint();
    if (options_.transport_mode == "shm" && self.local.empty()) {
      throw std::runtime_error(
          "transport 'shm' was asked for, but this worker has no "
          "shared-memory endpoint (see the message above)");
    }

    // An entry for this rank already there was not written by this worker:
    // another job on the same store, a second worker given this rank, or
    // someone planting an address. Refuse to start rather than overwrite it
    // (peers may have read it already; the handshake keeps them safe).
    t_listen = Clock::now();
    const std::string key = "tandem/worker/" + std::to_string(rank_);
    if (store_->check({key})) {
      auto v = store_->get(key);
      throw std::runtime_error(
          "rendezvous: the entry for rank " + std::to_string(rank_) +
          " was written by someone "
          "else before this worker ('" +
          printable(std::string(v.begin(), v.end())) +
          "'): another job on the same MASTER_PORT, two workers with one RANK, or a planted "
          "entry; refusing to start");
    }
    store_->set(key, store_bytes(join_worker(self)));
    // Wait for every entry by polling (a c10d get that times out says only
    // "Socket Timeout"): past init_timeout, name who never came.
    const auto deadline = std::chrono::steady_clock::now() + options_.init_timeout;
    auto pause = std::chrono::milliseconds(1);
    std::vector<int> missing(world);
    std::iota(missing.begin(), missing.end(), 0);
    for (;;) {
      // Only the entries not seen yet are asked for again.
      missing.erase(std::remove_if(missing.begin(), missing.end(),
                                   [&](int r) {
                                     return store_->check({"tandem/worker/" + std::to_string(r)});
                                   }),
                    missing.end());
      if (missing.empty()) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string ranks;
        for (int r : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
        throw TimeoutError(
            "rendezvous" + (store_address_.empty() ? std::string() : " at " + store_address_) +
            ": rank(s) " + ranks + " of " + std::to_string(world) + " did not arrive within " +
            std::to_string(options_.init_timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(20));
    }
    workers_.resize(world);
    for (int r = 0; r < world; ++r) {
      auto v = store_->get("tandem/worker/" + std::to_string(r));
      workers_[r] = split_worker(std::string(v.begin(), v.end()), r);
      auto [it, fresh] = rank_of_.emplace(workers_[r].name, r);
      if (!fresh) {
        throw std::invalid_argument("worker name '" + workers_[r].name + "' is used by ranks " +
                                    std::to_string(it->second) + " and " + std::to_string(r));
      }
    }
    check_device_maps(workers_, rank_of_);
    route_device_maps(workers_, rank_, send_maps_, answer_maps_);
    conns_ = std::make_unique<ConnectionTable>(world);
    {
      std::lock_guard<std::mutex> lock(stalled_mu_);
      stalled_.assign(static_cast<size_t>(world), std::string());
    }
    t_met = Clock::now();
  } catch (...) {
    set_ready();
    shutdown(false);
    throw;
  }
  set_ready();
  if (trace_ && rank_ != 0) measure_clock_offset();
  if (trace_) {
    const Clock::time_point end = Clock::now();
    const std::string world_args = "{\"world\":" + std::to_string(world) + "}";
    trace_->slice("init", "agent", t_start, end, {}, world_args);
    trace_->slice("init: store", "agent", t_start, t_store);
    trace_->slice("init: set up", "agent", t_store, t_listen);
    // Publishing this worker's entry and waiting for every other one: on
    // one host, mostly waiting for the last processes to start.
    trace_->slice("init: rendezvous", "agent", t_listen, t_met, {}, world_args);
    if (rank_ != 0) trace_->slice("init: clock", "agent", t_met, end);
  }
}

void AgentImpl::measure_clock_offset() {
  // rpc/trace.h, 3.: one boot of one host has one steady clock; elsewhere
  // the ping with the shortest round trip says most.
  int64_t best_rtt = -1, offset = 0;
  for (int i = 0; i < 8; ++i) {
    try {
      const int64_t t0 = Tracer::micros(std::chrono::steady_clock::now());
      auto answer =
          self_.rpc_sync<std::tuple<int64_t, std::string>>(workers_[0].name, "tandem.trace.clock");
      const int64_t t1 = Tracer::micros(std::chrono::steady_clock::now());
      if (!boot_id().empty() && std::get<1>(answer) == boot_id()) {
        trace_->set_clock(0, 0);
        return;
      }
      const int64_t there = std::get<0>(answer);
      if (best_rtt < 0 || t1 - t0 < best_rtt) {
        best_rtt = t1 - t0;
        offset = there - (t0 + t1) / 2;
      }
    } catch (const std::exception&) {
      break;  // rank 0 gone already: the trace keeps this clock
    }
  }
  if (best_rtt >= 0) trace_->set_clock(offset, (best_rtt + 1) / 2);
}

AgentImpl::~AgentImpl() {
  try {
    shutdown(false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem[%s]: shutdown in destructor failed: %s\n", self_name_.c_str(),
                 e.what());
  }
}

void AgentImpl::set_ready() {
  std::lock_guard<std::mutex> lock(ready_mu_);
  ready_.store(true, std::memory_order_release);
  ready_cv_.notify_all();
}

std::string AgentImpl::debug_info() const {
  std::string out = "tandem debug info: " + name() + " (rank " + std::to_string(rank_) + " of " +
                    std::to_string(world_size()) + "), pid " + std::to_string(::getpid()) + "\n";
  out += "connections:\n";
  for (int r = 0; r < world_size(); ++r) {
    if (r == rank_ || !conns_) continue;
    auto c = conns_->to(r);
    if (!c) continue;
    out += "  " + workers_[r].name + ": " + c->kind() + " " + printable(c->peer_address()) +
           ", answers owed " + std::to_string(c->answers_owed()) + "\n";
  }
  {
    std::lock_guard<std::mutex> lock(stalled_mu_);
    for (size_t r = 0; r < stalled_.size(); ++r) {
      if (!stalled_[r].empty()) {
        out += "  " + workers_[r].name + " counts as stalled: " + printable(stalled_[r]) + "\n";
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(retire_mu_);
    for (const auto& [id, r] : retiring_) {
      out += "  connection " + std::to_string(id) + " retiring (notice " +
             (r.sent ? "sent" : "not sent") + ", peer's " +
             (r.received ? "received" : "not received") + ")\n";
    }
  }
  if (calls_) {
    auto pending = calls_->snapshot();
    out += "calls in flight: " + std::to_string(pending.size()) + "\n";
    for (const auto& p : pending) {
      out += "  #" + std::to_string(p.id) + " '" + printable(p.callee) + "' on " +
             (p.peer >= 0 && p.peer < world_size() ? workers_[p.peer].name : "?") + ", " +
             std::to_string(p.age.count()) + " ms old, " +
             (p.left ? "deadline in " + std::to_string(p.left->count()) + " ms"
                     : std::string("no deadline")) +
             (p.sent ? "" : ", not written yet") + "\n";
    }
  }
  for (const auto& e : extensions_) out += e->debug_info();
  out += metrics().to_string();
  return out;
}

Metrics AgentImpl::metrics() const {
  Metrics m;
  metrics_->fill(m);
  if (calls_) m.calls_in_flight = calls_->size();
  if (pool_) m.pool_queue = pool_->queued();
  if (transport_) {
    m.transport = transport_->stats();
    m.bytes_sent = m.transport.bytes_sent;
    m.bytes_received = m.transport.bytes_received;
    m.connections = transport_->live_connections();
  }
  if (rrefs_) {
    m.rrefs_owned = rrefs_->owned_values();
    m.rref_users = rrefs_->live_user_refs().size();
  }
  for (const auto& e : extensions_) e->add_metrics(m.layers);
  return m;
}

std::string AgentImpl::transport_to(const std::string& to) const {
  const int r = get_worker_info(to).rank;
  auto c = conns_ ? conns_->to(r) : nullptr;
  return c ? c->kind() : "";
}

std::optional<c10::Device> AgentImpl::answer_device_to(const std::string& caller,
                                                       c10::Device device) const {
  const int r = get_worker_info(caller).rank;
  if (!device.is_cuda() || r >= static_cast<int>(answer_maps_.size())) return std::nullopt;
  const auto& map = answer_maps_[r].cuda;
  auto it = map.find(device.index());
  if (it == map.end()) return std::nullopt;
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(it->second));
}

TransportStats AgentImpl::transport_stats() const {
  return transport_ ? transport_->stats() : TransportStats{};
}

const WorkerInfo& AgentImpl::get_worker_info(const std::string& name) const {
  auto it = rank_of_.find(name);
  if (it == rank_of_.end()) throw std::invalid_argument("unknown worker '" + name + "'");
  return workers_[it->second];
}

const WorkerInfo& AgentImpl::get_worker_info(int rank) const {
  if (rank < 0 || rank >= world_size()) {
    throw std::invalid_argument("unknown worker rank " + std::to_string(rank));
  }
  return workers_[rank];
}

}  // namespace tandem::rpc
