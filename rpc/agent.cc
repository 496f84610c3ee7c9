// The agent's start-up (rendezvous), the handshake on every connection, and
// shutdown. The outgoing side is in calls.cc, the incoming side in
// dispatch.cc, the connection table in connections.cc.
#include "tandem/rpc/agent.h"

#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <tuple>

#include "tandem/rpc/call_table.h"
#include "tandem/rpc/connection_table.h"
#include "tandem/rpc/host.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rref/context.h"

namespace tandem::rpc {
namespace {

std::string join_worker(const WorkerInfo& w) {
  return w.name + "\t" + w.host + "\t" + std::to_string(w.port);
}

WorkerInfo split_worker(const std::string& s, int rank) {
  std::istringstream in(s);
  WorkerInfo w;
  std::string port;
  if (!std::getline(in, w.name, '\t') || !std::getline(in, w.host, '\t') ||
      !std::getline(in, port)) {
    throw std::runtime_error("malformed rendezvous entry for rank " + std::to_string(rank));
  }
  w.rank = rank;
  w.port = std::stoi(port);
  return w;
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

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

std::shared_ptr<Agent> Agent::create(AgentOptions options, std::shared_ptr<Registry> registry,
                                     c10::intrusive_ptr<c10d::Store> store) {
  std::shared_ptr<Agent> agent(new Agent(std::move(options), std::move(registry)));
  agent->start(std::move(store));
  return agent;
}

Agent::Agent(AgentOptions options, std::shared_ptr<Registry> registry)
    : options_(std::move(options)),
      registry_(registry ? std::move(registry) : std::make_shared<Registry>()) {}

void Agent::start(c10::intrusive_ptr<c10d::Store> store) {
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
  self_name_ = options_.name.empty() ? "worker" + std::to_string(rank_) : options_.name;
  std::string master_host;
  if (!store) {
    auto [host, port] = master_from_init_method(options_.init_method);
    if (port == 0 && world > 1) {
      throw std::invalid_argument("init_method '" + options_.init_method +
                                  "': port 0 only works for a world of one worker");
    }
    master_host = host;
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
                                       weak_from_this());
  internal_ = std::make_shared<Registry>();
  loop_internal_ = std::make_shared<Registry>();
  rrefs_ = std::make_shared<RRefContext>(*this);
  rrefs_->register_handlers(*internal_);
  {
    std::lock_guard<std::mutex> lock(g_extensions_mu);
    for (const auto& make : extension_factories()) {
      auto ext = make(*this);
      ext->register_handlers(*internal_);
      ext->register_loop_handlers(*loop_internal_);
      extensions_.push_back(std::move(ext));
    }
  }
  calls_ = std::make_unique<CallTable>(
      [pool = pool_](std::function<void()> fn) { pool->post(std::move(fn)); },
      [this](int rank) { return workers_.at(rank).name; });
  Transport::Callbacks cb;
  cb.on_message = [this](const ConnectionPtr& c, Message&& m) {
    on_message_from_loop(c, std::move(m));
  };
  cb.on_closed = [this](const ConnectionPtr& c, const std::string& r) {
    on_closed_from_loop(c, r);
  };
  TransportFactory make = options_.transport ? options_.transport : tcp_transport();
  transport_ = make(options_.limits, std::move(cb));

  try {
    WorkerInfo self;
    self.rank = rank_;
    self.name = self_name_;
    if (self.name.find_first_of("\t\n") != std::string::npos) {
      throw std::invalid_argument("worker name '" + self.name + "' contains a tab or newline");
    }
    self.host = advertise;
    self.port = transport_->listen(listen_host, 0);

    store_->set("tandem/worker/" + std::to_string(rank_), bytes(join_worker(self)));
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
    conns_ = std::make_unique<ConnectionTable>(world);
  } catch (...) {
    set_ready();
    shutdown(false);
    throw;
  }
  set_ready();
}

Agent::~Agent() {
  try {
    shutdown(false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem[%s]: shutdown in destructor failed: %s\n", self_name_.c_str(),
                 e.what());
  }
}

void Agent::set_ready() {
  std::lock_guard<std::mutex> lock(ready_mu_);
  ready_.store(true, std::memory_order_release);
  ready_cv_.notify_all();
}

const WorkerInfo& Agent::get_worker_info(const std::string& name) const {
  auto it = rank_of_.find(name);
  if (it == rank_of_.end()) throw std::invalid_argument("unknown worker '" + name + "'");
  return workers_[it->second];
}

const WorkerInfo& Agent::get_worker_info(int rank) const {
  if (rank < 0 || rank >= world_size()) {
    throw std::invalid_argument("unknown worker rank " + std::to_string(rank));
  }
  return workers_[rank];
}

bool Agent::on_hello_from_loop(const ConnectionPtr& conn, const Message& msg) {
  assert(transport_->on_transport_thread());
  const int r = msg.hello_rank;
  std::string why;
  if (conns_->rank_of(*conn) >= 0) {
    why = "second handshake on one connection";
  } else if (msg.hello_token != options_.token) {
    why = "bad cluster token";
  } else if (r < 0 || r >= world_size() || workers_[r].name != msg.hello_worker) {
    why = "unknown worker '" + msg.hello_worker + "' (rank " + std::to_string(r) + ")";
  }
  if (!why.empty()) {
    conn->close("protocol error from " + conn->peer_address() + ": handshake rejected: " + why);
    return false;
  }
  conns_->add(conn, r);
  return true;
}

void Agent::barrier(const std::string& key, bool wait) {
  const std::string k = "tandem/barrier/" + key;
  if (store_->add(k, 1) == world_size()) store_->set(k + "/done", bytes("1"));
  if (wait) store_->wait({k + "/done"}, options_.init_timeout);
}

void Agent::shutdown(bool graceful) {
  if (pool_ && pool_->in_pool()) {
    throw std::logic_error("shutdown() cannot run on the agent's own pool (inside a handler or callback)");
  }
  std::lock_guard<std::mutex> serial(shutdown_mu_);
  if (shut_down_) return;
  std::string barrier_error;
  if (graceful && transport_ && calls_) {
    calls_->wait_idle();
    // RRef deletes, confirmations and hand-overs still in flight.
    rrefs_->wait_idle(options_.init_timeout);
    calls_->wait_idle();
    try {
      barrier("shutdown");
    } catch (const std::exception& e) {
      barrier_error = e.what();
    }
  }
  std::vector<std::string> leaked;
  if (graceful && barrier_error.empty()) {
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
  if (calls_) calls_->stop();
  if (pool_) pool_->stop();
  if (conns_) conns_->clear();
  if (graceful && store_ && barrier_error.empty()) {
    // Rank 0 hosts the store when it made it: it stays up until everyone has
    // left the barrier above.
    try {
      barrier("left", /*wait=*/owns_store_ && rank_ == 0);
    } catch (const std::exception& e) {
      barrier_error = e.what();
    }
  }
  store_.reset();
  shut_down_ = true;
  if (!leaked.empty()) {
    std::string list;
    for (const auto& l : leaked) list += (list.empty() ? "" : ", ") + l;
    throw ShutdownError("graceful shutdown of " + name() + " found " +
                        std::to_string(leaked.size()) + " object(s) still alive (leaks): " + list);
  }
  if (!barrier_error.empty()) {
    throw TimeoutError("graceful shutdown of " + name() +
                       " did not meet the other workers: " + barrier_error);
  }
}

}  // namespace tandem::rpc
