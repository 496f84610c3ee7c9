// The agent's start-up (rendezvous), the handshake on every connection, and
// shutdown. The outgoing side is in calls.cc, the incoming side in
// dispatch.cc, the connection table in connections.cc.
#include "tandem/rpc/agent/agent_impl.h"

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <sstream>
#include <tuple>

#include <unistd.h>

#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/agent/call_table.h"
#include "tandem/rpc/agent/connection_table.h"
#include "tandem/rpc/wire/device.h"
#include "tandem/rpc/agent/handshake.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/common/host.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rref_context.h"

namespace tandem::rpc {
namespace {

// A rendezvous entry: name, host, port and same-host endpoint on the first
// line, the number of CUDA devices on the second, then a line per device
// map (the worker it leads to, then pairs of device indices), tab-separated
// (names hold no tab or newline).
std::string join_worker(const WorkerInfo& w) {
  std::string s = w.name + "\t" + w.host + "\t" + std::to_string(w.port) + "\t" + w.local +
                  "\n" + std::to_string(w.cuda_devices) + "\t" + w.process;
  for (const auto& [to, map] : w.device_maps) {
    s += "\n" + to;
    for (auto [from, dst] : map) s += "\t" + std::to_string(from) + "\t" + std::to_string(dst);
  }
  return s;
}

WorkerInfo split_worker(const std::string& s, int rank) {
  std::istringstream in(s);
  WorkerInfo w;
  std::string port;
  if (!std::getline(in, w.name, '\t') || !std::getline(in, w.host, '\t') ||
      !std::getline(in, port, '\t')) {
    throw std::runtime_error("malformed rendezvous entry for rank " + std::to_string(rank));
  }
  std::getline(in, w.local);  // absent or empty: no same-host path
  w.rank = rank;
  try {
    w.port = std::stoi(port);
  } catch (const std::exception&) {
    throw std::runtime_error("malformed rendezvous entry for rank " + std::to_string(rank) +
                             ": port '" + printable(port) + "'");
  }
  std::string line;
  try {
    if (std::getline(in, line)) {
      const auto tab = line.find('\t');
      w.cuda_devices = std::stoi(line.substr(0, tab));
      if (tab != std::string::npos) w.process = line.substr(tab + 1);
    }
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string to, from, dst;
      std::getline(fields, to, '\t');
      auto& map = w.device_maps[to];
      while (std::getline(fields, from, '\t') && std::getline(fields, dst, '\t')) {
        map[std::stoi(from)] = std::stoi(dst);
      }
    }
  } catch (const std::exception&) {
    throw std::runtime_error("malformed rendezvous entry for rank " + std::to_string(rank) +
                             ": devices '" + printable(line) + "'");
  }
  return w;
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string cuda(int i) { return "cuda:" + std::to_string(i); }

const std::map<int, int>* find_map(const std::map<std::string, std::map<int, int>>& maps,
                                   const std::string& to) {
  auto it = maps.find(to);
  return it == maps.end() ? nullptr : &it->second;
}

// Every worker's device maps, checked against both ends' devices
// (AgentOptions::device_maps). The same on every worker, so all refuse a
// bad map alike, naming whose it is.
void check_device_maps(const std::vector<WorkerInfo>& workers,
                       const std::unordered_map<std::string, int>& rank_of) {
  for (const WorkerInfo& w : workers) {
    for (const auto& [to, map] : w.device_maps) {
      const std::string whose = w.name + "'s device map to '" + printable(to) + "'";
      auto r = rank_of.find(to);
      if (r == rank_of.end()) throw std::invalid_argument(whose + ": there is no such worker");
      if (r->second == w.rank) throw std::invalid_argument(whose + ": a map to itself");
      const WorkerInfo& peer = workers[r->second];
      std::map<int, int> back;
      for (auto [from, dst] : map) {
        if (from >= w.cuda_devices) {
          throw std::invalid_argument(whose + " names " + cuda(from) + ", but " + w.name +
                                      " has " + std::to_string(w.cuda_devices) +
                                      " CUDA device(s)");
        }
        if (dst >= peer.cuda_devices) {
          throw std::invalid_argument(whose + " maps " + cuda(from) + " to " + cuda(dst) +
                                      ", but " + peer.name + " has " +
                                      std::to_string(peer.cuda_devices) + " CUDA device(s)");
        }
        auto [it, fresh] = back.emplace(dst, from);
        if (!fresh) {
          throw std::invalid_argument(whose + " maps both " + cuda(it->second) + " and " +
                                      cuda(from) + " to " + cuda(dst) +
                                      ": answers could not find their way back");
        }
      }
    }
  }
}

std::map<int, int> inverse(const std::map<int, int>& map) {
  std::map<int, int> out;
  for (auto [from, dst] : map) out[dst] = from;
  return out;
}

// The first line of a (c10) error message, which goes on with a C++ trace.
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

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
      throw std::invalid_argument("set_device_map(\"" + printable(worker) + "\"): cuda:" +
                                  std::to_string(from) + " is already mapped to cuda:" +
                                  std::to_string(it->second));
    }
  }
  return *this;
}

AgentImpl::AgentImpl(Agent& self, AgentOptions options, std::shared_ptr<Registry> registry)
    : self_(self),
      options_(std::move(options)),
      registry_(registry ? std::move(registry) : std::make_shared<Registry>()) {}

void AgentImpl::start(c10::intrusive_ptr<c10d::Store> store) {
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
      if (advertise.empty()) throw std::runtime_error("cannot tell this host's address; set advertise_host");
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
  TransportFactory make = options_.transport            ? options_.transport
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
      throw std::runtime_error("transport 'shm' was asked for, but this worker has no "
                               "shared-memory endpoint (see the message above)");
    }

    // An entry for this rank already there was not written by this worker:
    // another job on the same store, a second worker given this rank, or
    // someone planting an address. Refuse to start rather than overwrite it
    // (peers may have read it already; the handshake keeps them safe).
    const std::string key = "tandem/worker/" + std::to_string(rank_);
    if (store_->check({key})) {
      auto v = store_->get(key);
      throw std::runtime_error(
          "rendezvous: the entry for rank " + std::to_string(rank_) + " was written by someone "
          "else before this worker ('" + printable(std::string(v.begin(), v.end())) +
          "'): another job on the same MASTER_PORT, two workers with one RANK, or a planted "
          "entry; refusing to start");
    }
    store_->set(key, bytes(join_worker(self)));
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
        throw TimeoutError("rendezvous" +
                           (store_address_.empty() ? std::string() : " at " + store_address_) +
                           ": rank(s) " + ranks + " of " + std::to_string(world) +
                           " did not arrive within " +
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
    send_maps_.resize(world);
    answer_maps_.resize(world);
    for (int r = 0; r < world; ++r) {
      const auto* mine = find_map(workers_[rank_].device_maps, workers_[r].name);
      const auto* theirs = find_map(workers_[r].device_maps, self_name_);
      send_maps_[r].peer = answer_maps_[r].peer = workers_[r].name;
      // Calls go by our map, else back along theirs; answers go back along
      // the caller's map, else by ours.
      send_maps_[r].cuda = mine ? *mine : theirs ? inverse(*theirs) : std::map<int, int>();
      answer_maps_[r].cuda = theirs ? inverse(*theirs) : mine ? *mine : std::map<int, int>();
    }
    conns_ = std::make_unique<ConnectionTable>(world);
  } catch (...) {
    set_ready();
    shutdown(false);
    throw;
  }
  set_ready();
  if (trace_ && rank_ != 0) measure_clock_offset();
}

void AgentImpl::measure_clock_offset() {
  // rpc/trace.h, 3.: one boot of one host has one steady clock; elsewhere
  // the ping with the shortest round trip says most.
  int64_t best_rtt = -1, offset = 0;
  for (int i = 0; i < 8; ++i) {
    try {
      const int64_t t0 = Tracer::micros(std::chrono::steady_clock::now());
      auto answer = self_.rpc_sync<std::tuple<int64_t, std::string>>(workers_[0].name,
                                                              "tandem.trace.clock");
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
    std::lock_guard<std::mutex> lock(retire_mu_);
    for (const auto& [id, r] : retiring_) {
      out += "  connection " + std::to_string(id) + " retiring (notice " +
             (r.sent ? "sent" : "not sent") + ", peer's " + (r.received ? "received" : "not received") +
             ")\n";
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

size_t AgentImpl::cuda_ipc_held() const {
  std::lock_guard<std::mutex> lock(ipc_mu_);
  return ipc_held_.size();
}

bool AgentImpl::ipc_to(int dest, const Connection* via) const {
  if (!options_.cuda_ipc || dest < 0 || dest == rank_ ||
      static_cast<size_t>(dest) >= workers_.size()) {
    return false;
  }
  const WorkerInfo& self = workers_[rank_];
  const WorkerInfo& peer = workers_[dest];
  if (self.cuda_devices == 0 || peer.cuda_devices == 0 || peer.process.empty() ||
      peer.process == self.process) {
    return false;  // (a handle cannot be opened in the process that made it)
  }
  {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    const auto& refused = ipc_refused_by_;
    if (std::find(refused.begin(), refused.end(), dest) != refused.end()) return false;
  }
  if (via) return std::string(via->kind()) == "shm";
  auto c = conns_ ? conns_->to(dest) : nullptr;
  return c && std::string(c->kind()) == "shm";  // on this host
}

void AgentImpl::send_ipc_release(const ConnectionPtr& conn, int to, uint64_t token, bool failed) {
  Message m;
  m.kind = MessageKind::kRequest;
  m.id = 0;  // one way
  m.callee = kIpcReleaseCallee;
  m.values.emplace_back(static_cast<int64_t>(token));
  m.values.emplace_back(failed);
  // On the connection the frame came by; if that one is retiring or gone,
  // on the one that replaced it (else the sender holds its memory until
  // every connection to us has closed).
  for (const ConnectionPtr& c : {conn, conns_->to(to)}) {
    if (!c) continue;
    try {
      c->send(encode(m, options_.limits));
      return;
    } catch (const Error&) {
    }
  }
}

void AgentImpl::release_ipc(int from, uint64_t token, bool failed) {
  std::shared_ptr<device::IpcExport> buffers;  // freed outside the lock
  std::lock_guard<std::mutex> lock(ipc_mu_);
  if (failed && std::find(ipc_refused_by_.begin(), ipc_refused_by_.end(), from) ==
                    ipc_refused_by_.end()) {
    ipc_refused_by_.push_back(from);
    protocol_log_->write("tandem[" + printable(name()) + "]: " + printable(workers_[from].name) +
                         " could not use this worker's CUDA IPC handles; CUDA tensors to it "
                         "go through host memory from now on");
  }
  auto it = ipc_held_.find(token);
  if (it == ipc_held_.end() || it->second.rank != from) return;  // (not this peer's to release)
  buffers = std::move(it->second.buffers);
  ipc_held_.erase(it);
}

void AgentImpl::drop_ipc_held(int rank) {
  std::vector<std::shared_ptr<device::IpcExport>> dropped;
  std::lock_guard<std::mutex> lock(ipc_mu_);
  for (auto it = ipc_held_.begin(); it != ipc_held_.end();) {
    if (rank < 0 || it->second.rank == rank) {
      dropped.push_back(std::move(it->second.buffers));
      it = ipc_held_.erase(it);
    } else {
      ++it;
    }
  }
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

void AgentImpl::on_hello_from_loop(const ConnectionPtr& conn, const Message& msg) {
  assert(transport_->on_transport_thread());
  const uint64_t id = conn->id();
  const std::string& token = options_.token;
  std::unique_lock<std::mutex> lock(handshakes_->mu);
  // Refuses the handshake: the connection closes with `why`, and a dialed
  // one's gate gives `why` to any call still trying to send on it.
  std::shared_ptr<GatedConnection> gate;
  auto reject = [&](const std::string& why) {
    lock.unlock();
    const std::string reason =
        "protocol error from " + conn->peer_address() + ": handshake rejected: " + why;
    if (gate) gate->refuse(reason);
    conn->close(reason);
  };
  if (msg.hello_nonce.size() != (msg.hello_step == 3 ? 0 : kNonceBytes) ||
      msg.hello_proof.size() != (msg.hello_step == 1 ? 0 : kProofBytes)) {
    return reject("step " + std::to_string(msg.hello_step) + " with a nonce of " +
                  std::to_string(msg.hello_nonce.size()) + " and a proof of " +
                  std::to_string(msg.hello_proof.size()) + " bytes");
  }
  const bool dialed = handshakes_->dialed.count(id) > 0;
  const bool accepted = handshakes_->accepted.count(id) > 0;
  switch (msg.hello_step) {
    case 1: {  // a dialer introduces itself on a connection we accepted
      const int r = msg.hello_rank;
      if (dialed || accepted || conns_->rank_of(*conn) >= 0) return reject("a second step 1");
      if (r < 0 || r >= world_size() || workers_[r].name != msg.hello_worker) {
        return reject("unknown worker '" + printable(msg.hello_worker, 64) + "' (rank " +
                      std::to_string(r) + ")");
      }
      HandshakeTable::Accepted a{r, msg.hello_nonce, random_bytes(kNonceBytes)};
      Message answer;
      answer.kind = MessageKind::kHello;
      answer.hello_step = 2;
      answer.hello_worker = name();
      answer.hello_rank = rank_;
      answer.hello_nonce = a.nonce;
      answer.hello_proof = acceptor_proof(token, a.dialer_nonce, a.nonce, r, rank_);
      handshakes_->accepted[id] = std::move(a);
      lock.unlock();
      try {
        conn->send(encode(answer, options_.limits));
      } catch (const DisconnectedError&) {
        // closed meanwhile: on_closed forgets it
      }
      return;
    }
    case 2: {  // the worker we dialed answers, with its proof
      if (!dialed) return reject("a step 2 nobody asked for");
      HandshakeTable::Dialed d = std::move(handshakes_->dialed[id]);
      handshakes_->dialed.erase(id);
      gate = d.gate;
      const std::string& expected = workers_[d.rank].name;
      if (msg.hello_rank != d.rank || msg.hello_worker != expected) {
        return reject("dialed " + expected + " (rank " + std::to_string(d.rank) +
                      ") but '" + printable(msg.hello_worker, 64) + "' (rank " +
                      std::to_string(msg.hello_rank) +
                      ") answered");
      }
      if (!constant_time_equal(msg.hello_proof, acceptor_proof(token, d.nonce, msg.hello_nonce,
                                                               rank_, d.rank))) {
        return reject(expected + " did not prove the cluster token (is TANDEM_TOKEN the same "
                      "on every worker?)");
      }
      lock.unlock();
      Message proof;
      proof.kind = MessageKind::kHello;
      proof.hello_step = 3;
      proof.hello_worker = name();
      proof.hello_rank = rank_;
      proof.hello_proof = dialer_proof(token, d.nonce, msg.hello_nonce, rank_, d.rank);
      d.gate->open(encode(proof, options_.limits));
      return;
    }
    case 3: {  // the dialer's proof, on a connection we accepted
      if (!accepted) return reject("a step 3 before step 1");
      HandshakeTable::Accepted a = std::move(handshakes_->accepted[id]);
      handshakes_->accepted.erase(id);
      if (!constant_time_equal(msg.hello_proof,
                               dialer_proof(token, a.dialer_nonce, a.nonce, a.rank, rank_))) {
        return reject(workers_[a.rank].name + " (as it claimed) did not prove the cluster token");
      }
      lock.unlock();
      // One connection per pair (connection_table.h, 4.): when both dialed,
      // the lower rank keeps the one it dialed.
      if (auto lost = conns_->add_accepted(conn, a.rank, /*take_over=*/a.rank < rank_)) {
        retire(lost);
      }
      return;
    }
    default:
      return reject("unknown step " + std::to_string(msg.hello_step));
  }
}

void AgentImpl::barrier(const std::string& key, bool wait) {
  const std::string k = "tandem/barrier/" + key;
  const std::string done = k + "/done";
  const std::string where =
      (store_address_.empty() ? "the rendezvous store" : "the rendezvous store at " + store_address_) +
      (store_hosted_by_launcher() ? " (hosted by the launcher)"
                                  : " (hosted by " + workers_[0].name + ", rank 0)");
  auto store_lost = [&](const std::exception& e) {
    return DisconnectedError("graceful shutdown of " + name() + " lost " + where + ": " +
                             printable(first_line(e.what())));
  };
  try {
    store_->set(k + "/" + std::to_string(rank_), bytes("1"));  // who arrived
    if (store_->add(k, 1) == world_size()) store_->set(done, bytes("1"));
  } catch (const std::exception& e) {
    throw store_lost(e);
  }
  if (!wait) return;
  // Poll rather than wait: a c10d wait that times out cannot be taken back
  // (its late answer would be read as the next command's), and between
  // polls the workers that have not arrived are checked. One that no longer
  // accepts connections has died, and will never arrive: say so at once
  // instead of waiting out init_timeout. A worker may sit here for a whole
  // training run (a parameter server, a bench's peer), so the polls thin
  // out to ten a second, each one small request to the store, and the
  // check of who is missing runs once a second.
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + options_.init_timeout;
  auto pause = std::chrono::milliseconds(1);
  auto next_probe = start + std::chrono::milliseconds(200);
  auto missing = [&] {
    std::vector<int> out;
    for (int r = 0; r < world_size(); ++r) {
      if (r != rank_ && !store_->check({k + "/" + std::to_string(r)})) out.push_back(r);
    }
    return out;
  };
  for (;;) {
    try {
      if (store_->check({done})) return;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        std::string names;
        for (int r : missing()) names += (names.empty() ? "" : ", ") + workers_[r].name;
        throw TimeoutError("graceful shutdown of " + name() +
                           " did not meet the other workers within " +
                           std::to_string(options_.init_timeout.count()) + " ms" +
                           (names.empty() ? "" : ": not arrived: " + names));
      }
      if (now >= next_probe) {
        next_probe = now + std::chrono::seconds(1);
        std::string gone;
        for (int r : missing()) {
          const std::string why = unreachable_reason(r);
          if (why.empty()) continue;
          // It may have arrived, and closed, since the check above.
          if (store_->check({done})) return;
          if (store_->check({k + "/" + std::to_string(r)})) continue;
          gone += (gone.empty() ? "" : "; ") + workers_[r].name + " (" + why + ")";
        }
        if (!gone.empty()) {
          throw DisconnectedError("graceful shutdown of " + name() +
                                  ": worker(s) gone before reaching shutdown: " + gone);
        }
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw store_lost(e);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
}

std::string AgentImpl::unreachable_reason(int rank) {
  // An open connection to it is answer enough (keepalive would have closed
  // it); only a worker this one holds no connection to is dialed.
  if (auto c = conns_->to(rank); c && !c->closed()) return "";
  const WorkerInfo& w = workers_[rank];
  try {
    // A bare TCP connection, closed again at once: the peer sees it end
    // before its handshake, which is no error.
    transport_->connect(w.host, w.port, std::chrono::milliseconds(500))->close("");
    return "";
  } catch (const std::exception& e) {
    return printable(e.what());
  }
}

void AgentImpl::shutdown(bool graceful) {
  if (pool_ && pool_->in_pool()) {
    throw std::logic_error("shutdown() cannot run on the agent's own pool (inside a handler or callback)");
  }
  std::lock_guard<std::mutex> serial(shutdown_mu_);
  if (shut_down_) return;
  std::exception_ptr barrier_error;
  if (graceful && transport_ && calls_) {
    calls_->wait_idle();
    // RRef deletes, confirmations and hand-overs still in flight.
    rrefs_->wait_idle(options_.init_timeout);
    calls_->wait_idle();
    try {
      barrier("shutdown");
    } catch (const std::exception&) {
      barrier_error = std::current_exception();
    }
  }
  std::vector<std::string> leaked;
  if (graceful && !barrier_error) {
    if (rrefs_) leaked = rrefs_->live_user_refs();
    for (const auto& e : extensions_) {
      for (auto& l : e->live_objects()) leaked.push_back(std::move(l));
    }
  }
  if (rrefs_) rrefs_->close();
  for (const auto& e : extensions_) e->close();
  if (calls_) {
    calls_->close_new();
    calls_->fail_where([](const CallTable::Call&) { return true; },
                       [this](const CallTable::Call& c) {
                         return std::make_exception_ptr(ShutdownError(
                             "agent " + name() + " shut down during '" + c.callee + "'"));
                       });
  }
  if (transport_) transport_->close();
  drop_ipc_held(-1);  // nobody is left to copy from them
  if (calls_) calls_->stop();
  if (pool_) pool_->stop();
  if (conns_) conns_->clear();
  if (graceful && store_ && !barrier_error) {
    // Rank 0 hosts the store when it made it: it stays up until everyone has
    // left the barrier above.
    try {
      barrier("left", /*wait=*/owns_store_ && rank_ == 0);
    } catch (const std::exception&) {
      barrier_error = std::current_exception();
    }
  }
  store_.reset();
  shut_down_ = true;
  if (trace_) {
    try {
      trace_->write();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tandem[%s]: %s\n", printable(name()).c_str(), e.what());
    }
  }
  if (!leaked.empty()) {
    std::string list;
    for (const auto& l : leaked) list += (list.empty() ? "" : ", ") + l;
    throw ShutdownError("graceful shutdown of " + name() + " found " +
                        std::to_string(leaked.size()) + " object(s) still alive (leaks): " + list);
  }
  if (barrier_error) std::rethrow_exception(barrier_error);
}

}  // namespace tandem::rpc
