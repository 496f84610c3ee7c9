#include "tandem/rpc/agent.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rref_context.h"
#include "tandem/rpc/spin.h"
#include "tandem/rpc/transport/uv/uv_transport.h"

namespace tandem::rpc {
namespace {

using Clock = std::chrono::steady_clock;
// Longer timeouts are treated as this (and cannot overflow the clock).
constexpr std::chrono::milliseconds kMaxTimeout{365ll * 24 * 3600 * 1000};
// The timer thread wakes at least this often (so far-off deadlines need not
// wake it when they are set).
constexpr std::chrono::milliseconds kTimerTick{20};
// The call id of a request sent by notify(): no reply goes back.
constexpr uint64_t kNoReply = 0;

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

Agent* handler_agent() { return current_scope().agent; }

void register_agent_extension(ExtensionFactory factory) {
  std::lock_guard<std::mutex> lock(g_extensions_mu);
  extension_factories().push_back(std::move(factory));
}

uint64_t handler_autograd_context(const Agent& agent) { return autograd_context_for(agent); }

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
  rank_ = options_.rank >= 0 ? options_.rank : env.rank;
  int world = options_.world_size >= 0 ? options_.world_size : env.world_size;
  if (world <= 0) {
    throw std::invalid_argument(
        "world size unknown: set AgentOptions::world_size or WORLD_SIZE (or SLURM_NTASKS, "
        "OMPI_COMM_WORLD_SIZE)");
  }
  if (rank_ < 0 || rank_ >= world) {
    throw std::invalid_argument("rank " + std::to_string(rank_) +
                                " is not in [0, world size " + std::to_string(world) +
                                "): set AgentOptions::rank or RANK");
  }
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
  Transport::Callbacks cb;
  cb.on_message = [this](const ConnectionPtr& c, Message&& m) { on_message(c, std::move(m)); };
  cb.on_closed = [this](const ConnectionPtr& c, const std::string& r) { on_closed(c, r); };
  transport_ = std::make_unique<UvTransport>(options_.limits, std::move(cb));
  timer_ = std::thread([this] { timer_loop(); });

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
    peers_.resize(world);
    for (int r = 0; r < world; ++r) connect_mu_.push_back(std::make_unique<std::mutex>());
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

void Agent::spin_until_done(const RawFuture& f) const {
  // A blocked caller is woken by the loop thread when its reply lands. On an
  // idle core that wake-up costs more than a whole loopback round trip, so
  // keep the core busy for a short while first (see AgentOptions::sync_spin).
  spin_until(options_.sync_spin, [&] { return f->completed(); });
}

Future<c10::IValue> Agent::call(const std::string& to, const std::string& fn,
                                std::vector<c10::IValue> args, std::chrono::milliseconds timeout) {
  return Future<c10::IValue>(start_call(to, fn, std::move(args), timeout), pool_);
}

RawFuture Agent::start_call(const std::string& to, const std::string& fn,
                            std::vector<c10::IValue> args, std::chrono::milliseconds timeout) {
  RawFuture fut = make_raw_future();
  const WorkerInfo& dest = get_worker_info(to);
  if (timeout.count() < 0) timeout = options_.rpc_timeout;
  timeout = std::min(timeout, kMaxTimeout);
  Pending p;
  p.future = fut;
  p.peer = dest.rank;
  p.callee = fn;
  auto now = Clock::now();
  if (timeout.count() > 0) {
    p.has_deadline = true;
    p.deadline = now + timeout;
  }
  const CallScope& scope = current_scope();
  if (scope.agent == this && scope.has_deadline &&
      (!p.has_deadline || scope.deadline < p.deadline)) {
    p.has_deadline = true;  // a call made by a handler inherits what its caller has left
    p.deadline = scope.deadline;
  }

  Message req;
  req.kind = MessageKind::kRequest;
  req.id = next_id_.fetch_add(1);
  req.callee = fn;
  req.values = std::move(args);
  if (p.has_deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(p.deadline - now).count();
    req.timeout_ms = static_cast<uint64_t>(std::max<int64_t>(left, 1));
  }
  req.autograd_context = autograd_context_for(*this);
  // Bad arguments (and a failed RRef passed on) throw here, in the caller.
  OutFrame frame = encode_with_extensions(req, dest.rank);

  auto shut_down = [&] {
    return std::make_exception_ptr(
        ShutdownError("agent " + name() + " is shut down; cannot call '" + fn + "' on " + to));
  };
  auto fail_now = [&](std::exception_ptr e) {
    rrefs_->abort_forks(frame.forks);  // the request never left
    fut->setError(e);
    return fut;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) {
      return fail_now(shut_down());
    }
  }
  std::shared_ptr<Connection> conn;
  try {
    auto connect_timeout = p.has_deadline ? std::chrono::duration_cast<std::chrono::milliseconds>(
                                                p.deadline - Clock::now())
                                          : std::chrono::milliseconds(30000);
    conn = connection_to(dest.rank, std::max(connect_timeout, std::chrono::milliseconds(1)));
  } catch (...) {
    return fail_now(std::current_exception());
  }
  p.conn_id = conn->id();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) {
      return fail_now(shut_down());
    }
    if (p.has_deadline) {
      deadlines_.emplace(p.deadline, req.id);
      // The timer thread wakes by timer_wake_ anyway; waking it for a later
      // deadline would cost a context switch per call.
      if (p.deadline < timer_wake_) timer_cv_.notify_one();
    }
    pending_.emplace(req.id, std::move(p));
  }
  const std::vector<RRefDesc> forks = frame.forks;
  try {
    conn->send(std::move(frame));
  } catch (const Error& e) {
    // The connection broke under us (a frame cut short is dropped by the
    // peer); on_closed may already have failed the call, in which case this
    // finds nothing to complete.
    rrefs_->abort_forks(forks);
    {
      std::lock_guard<std::mutex> lock(conn_mu_);
      if (peers_[dest.rank] == conn) peers_[dest.rank] = nullptr;
    }
    auto eptr = std::make_exception_ptr(
        DisconnectedError("cannot send '" + fn + "' to " + to + ": " + e.what()));
    complete(req.id, [&](Pending& q) { finish(std::move(q), {}, eptr); }, 0);
  }
  return fut;
}

void Agent::notify(const std::string& to, const std::string& fn, std::vector<c10::IValue> args) {
  const WorkerInfo& dest = get_worker_info(to);
  Message req;
  req.kind = MessageKind::kRequest;
  req.id = kNoReply;
  req.callee = fn;
  req.values = std::move(args);
  req.autograd_context = autograd_context_for(*this);
  OutFrame frame = encode_with_extensions(req, dest.rank);
  const std::vector<RRefDesc> forks = frame.forks;
  try {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!accepting_) throw ShutdownError("agent " + name() + " is shut down; cannot notify " + to);
    }
    auto timeout = options_.rpc_timeout.count() > 0 ? options_.rpc_timeout
                                                    : std::chrono::milliseconds(30000);
    connection_to(dest.rank, timeout)->send(std::move(frame));
  } catch (const ShutdownError&) {
    rrefs_->abort_forks(forks);
    throw;
  } catch (const Error& e) {
    rrefs_->abort_forks(forks);
    throw DisconnectedError("cannot send '" + fn + "' to " + to + ": " + e.what());
  }
}

OutFrame Agent::encode_with_extensions(Message& m, int dest) {
  for (const auto& e : extensions_) e->before_send(m, dest);
  OutFrame frame = encode(m, options_.limits, rrefs_.get(), dest);
  try {
    for (const auto& e : extensions_) e->after_encode(m, frame, dest);
  } catch (...) {
    rrefs_->abort_forks(frame.forks);
    throw;
  }
  return frame;
}

std::shared_ptr<Connection> Agent::connection_to(int rank, std::chrono::milliseconds timeout) {
  auto cached = [&]() -> std::shared_ptr<Connection> {
    std::lock_guard<std::mutex> lock(conn_mu_);
    auto& c = peers_[rank];
    if (c && c->closed()) c = nullptr;  // on_closed may not have run yet
    return c;
  };
  if (auto c = cached()) return c;
  std::lock_guard<std::mutex> serial(*connect_mu_[rank]);
  if (auto c = cached()) return c;
  const WorkerInfo& w = workers_[rank];
  std::shared_ptr<Connection> conn;
  try {
    conn = transport_->connect(w.host, w.port, timeout, rank);
  } catch (const DisconnectedError& e) {
    throw DisconnectedError("worker " + w.name + " is unreachable: " + e.what());
  }
  Message hello;
  hello.kind = MessageKind::kHello;
  hello.hello_worker = name();
  hello.hello_rank = rank_;
  hello.hello_token = options_.token;
  conn->send(encode(hello, options_.limits));
  std::lock_guard<std::mutex> lock(conn_mu_);
  if (!peers_[rank] && !conn->closed()) peers_[rank] = conn;
  return conn;
}

void Agent::on_message(const std::shared_ptr<Connection>& conn, Message&& msg) {
  if (!ready_.load(std::memory_order_acquire)) {
    // A peer that finished rendezvous first may greet us before we know the
    // world; hold this (loop) thread until start() is done, one way or the other.
    std::unique_lock<std::mutex> lock(ready_mu_);
    ready_cv_.wait(lock, [this] { return ready_.load(); });
    if (workers_.empty() || peers_.empty()) {
      conn->close("agent failed to start");
      return;
    }
  }
  if (msg.kind == MessageKind::kHello) {
    const int r = msg.hello_rank;
    std::string why;
    if (conn->peer_rank >= 0) {
      why = "second handshake on one connection";
    } else if (msg.hello_token != options_.token) {
      why = "bad cluster token";
    } else if (r < 0 || r >= world_size() || workers_[r].name != msg.hello_worker) {
      why = "unknown worker '" + msg.hello_worker + "' (rank " + std::to_string(r) + ")";
    }
    if (!why.empty()) {
      conn->close("protocol error from " + conn->peer_address() + ": handshake rejected: " + why);
      return;
    }
    conn->peer_rank = r;
    std::lock_guard<std::mutex> lock(conn_mu_);
    if (!peers_[r]) peers_[r] = conn;
    return;
  }
  if (conn->peer_rank < 0) {
    conn->close("protocol error from " + conn->peer_address() +
                ": the first frame must be a handshake");
    return;
  }
  if (!msg.rrefs.empty()) {
    try {
      for (auto& r : msg.rrefs) rrefs_->validate(r, conn->peer_rank);  // all, before any binds
      for (auto& r : msg.rrefs) rrefs_->bind_received(r, conn->peer_rank);
    } catch (const std::exception& e) {
      conn->close("protocol error from " + conn->peer_address() + ": " + e.what());
      return;
    }
  }
  switch (msg.kind) {
    case MessageKind::kRequest: {
      if (msg.callee.rfind("tandem.", 0) == 0) {
        if (auto on_loop = loop_internal_->find(msg.callee)) {
          handle_request(conn, std::move(msg), on_loop);  // bounded internal work: right here
          return;
        }
      }
      auto shared = std::make_shared<Message>(std::move(msg));
      pool_->post([this, conn, shared] { handle_request(conn, std::move(*shared)); });
      return;
    }
    case MessageKind::kResponse: {
      if (!extensions_.empty()) {
        try {
          for (const auto& e : extensions_) e->after_receive(msg, conn->peer_rank);
        } catch (...) {
          auto eptr = std::current_exception();
          complete(msg.id, [&](Pending& p) { finish(std::move(p), {}, eptr); }, conn->id());
          return;
        }
      }
      c10::IValue value = msg.values.empty() ? c10::IValue() : std::move(msg.values[0]);
      complete(msg.id, [&](Pending& p) { finish(std::move(p), std::move(value), nullptr); },
               conn->id());
      return;
    }
    case MessageKind::kError: {
      auto eptr = make_error(msg.error_code, msg.error_worker, msg.error_message);
      complete(msg.id, [&](Pending& p) { finish(std::move(p), {}, eptr); }, conn->id());
      return;
    }
    case MessageKind::kHello:
      return;
  }
}

void Agent::complete(uint64_t id, const std::function<void(Pending&)>& fill, uint64_t from_conn) {
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    // Unknown ids are late replies to calls that already timed out (or replies
    // from a connection the call was not sent on): dropped.
    if (it == pending_.end() || (from_conn != 0 && it->second.conn_id != from_conn)) return;
    p = std::move(it->second);
    pending_.erase(it);
    if (p.has_deadline) {
      auto range = deadlines_.equal_range(p.deadline);
      for (auto d = range.first; d != range.second; ++d) {
        if (d->second == id) {
          deadlines_.erase(d);
          break;
        }
      }
    }
    if (pending_.empty()) idle_cv_.notify_all();
  }
  fill(p);
}

void Agent::finish(Pending&& p, c10::IValue value, std::exception_ptr error) {
  // Completed right here (loop, timer or caller thread): Future::then() moves
  // user callbacks to the pool, so nothing but bounded work runs inline, and a
  // pool thread blocked in wait() is woken without needing a pool thread.
  if (error) {
    p.future->setError(error);
  } else {
    p.future->markCompleted(std::move(value));
  }
}

void Agent::fail_where(const std::function<bool(const Pending&)>& pred,
                       const std::function<std::exception_ptr(const Pending&)>& error) {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : pending_) {
      if (pred(p)) ids.push_back(id);
    }
  }
  for (uint64_t id : ids) {
    complete(id, [&](Pending& p) { finish(std::move(p), {}, error(p)); }, 0);
  }
}

void Agent::on_closed(const std::shared_ptr<Connection>& conn, const std::string& reason) {
  if (reason.rfind("protocol error", 0) == 0) {
    std::fprintf(stderr, "tandem[%s]: %s; connection closed\n", name().c_str(), reason.c_str());
  }
  const int r = conn->peer_rank;
  if (r >= 0) {
    std::lock_guard<std::mutex> lock(conn_mu_);
    if (peers_[r] == conn) peers_[r] = nullptr;
  }
  const uint64_t cid = conn->id();
  const std::string peer = r >= 0 ? workers_[r].name : conn->peer_address();
  fail_where([cid](const Pending& p) { return p.conn_id == cid; },
             [&](const Pending& p) {
               return std::make_exception_ptr(DisconnectedError(
                   "connection to " + peer + " lost during '" + p.callee + "'" +
                   (reason.empty() ? "" : ": " + reason)));
             });
}

void Agent::run_as_handler(const std::function<void()>& fn) {
  CallScope scope = current_scope();
  scope.agent = this;
  ScopeGuard guard(scope);
  fn();
}

void Agent::handle_request(const std::shared_ptr<Connection>& conn, Message msg,
                           std::shared_ptr<const Handler> handler) {
  if (!handler) {
    const bool internal = msg.callee.rfind("tandem.", 0) == 0;
    handler = (internal ? internal_ : registry_)->find(msg.callee);
  }
  if (!handler) {
    send_error(conn, msg.id, ErrorCode::kUnknownFunction,
               "no function '" + msg.callee + "' is registered");
    return;
  }
  CallScope scope;
  scope.agent = this;
  scope.context_agent = this;
  scope.autograd_context = msg.autograd_context;
  if (msg.timeout_ms > 0) {
    scope.has_deadline = true;
    scope.deadline = Clock::now() + std::min(std::chrono::milliseconds(std::min<uint64_t>(
                                                 msg.timeout_ms, kMaxTimeout.count())),
                                             kMaxTimeout);
  }
  ScopeGuard guard(scope);
  RawFuture result;
  const uint64_t autograd_context = msg.autograd_context;
  try {
    for (const auto& e : extensions_) e->after_receive(msg, conn->peer_rank);
    HandlerResult r = (*handler)(msg.values);
    if (r.future) {
      // Asynchronous: this pool thread is free now; reply when it completes.
      uint64_t id = msg.id;
      std::weak_ptr<Agent> weak = weak_from_this();
      r.future->addCallback([weak, conn, id, autograd_context](c10::ivalue::Future& f) {
        // The future may complete after this agent is gone: then nobody is
        // left to answer, and the caller has failed the call already.
        if (auto self = weak.lock()) {
          self->reply(conn, id, c10::intrusive_ptr<c10::ivalue::Future>::reclaim_copy(&f),
                      autograd_context);
        }
      });
      return;
    }
    result = make_raw_future();
    result->markCompleted(std::move(r.value));
  } catch (...) {
    result = make_raw_future();
    result->setError(std::current_exception());
  }
  reply(conn, msg.id, result, autograd_context);
}

void Agent::reply(const std::shared_ptr<Connection>& conn, uint64_t id, const RawFuture& result,
                  uint64_t autograd_context) {
  if (id == kNoReply) return;  // notify(): nobody waits for it
  if (result->hasError()) {
    // The error keeps its kind: a handler whose own call timed out fails
    // its caller with TimeoutError (naming this worker), so a layer can
    // rethrow what happened. Anything but a Tandem error is a RemoteError.
    auto [code, text] = describe_error(result->exception_ptr());
    send_error(conn, id, code, text);
    return;
  }
  Message m;
  m.kind = MessageKind::kResponse;
  m.id = id;
  m.values.push_back(result->constValue());
  m.autograd_context = autograd_context;
  OutFrame frame;
  try {
    frame = encode_with_extensions(m, conn->peer_rank);
  } catch (const std::exception& e) {
    send_error(conn, id, ErrorCode::kRemote, std::string("cannot send the result: ") + e.what());
    return;
  }
  const std::vector<RRefDesc> forks = frame.forks;
  try {
    conn->send(std::move(frame));
  } catch (const Error&) {
    // The caller is gone; it has already failed the call with Disconnected.
    rrefs_->abort_forks(forks);
  }
}

void Agent::send_error(const std::shared_ptr<Connection>& conn, uint64_t id, ErrorCode code,
                       const std::string& message) {
  if (id == kNoReply) return;
  Message m;
  m.kind = MessageKind::kError;
  m.id = id;
  m.error_code = code;
  m.error_worker = name();
  m.error_message = message;
  try {
    conn->send(encode(m, options_.limits));
  } catch (const Error&) {
  }
}

void Agent::schedule_after(std::chrono::microseconds delay, std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (timer_stop_) return;
  auto at = Clock::now() + delay;
  timers_.emplace(at, std::move(fn));
  if (at < timer_wake_) timer_cv_.notify_one();
}

void Agent::timer_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!timer_stop_) {
    // Sleep until the earliest deadline or timer, but never longer than
    // kTimerTick: then a call whose deadline is further away than that need
    // not wake this thread (see start_call).
    auto now = Clock::now();
    auto first = now + kTimerTick;
    if (!deadlines_.empty()) first = std::min(first, deadlines_.begin()->first);
    if (!timers_.empty()) first = std::min(first, timers_.begin()->first);
    if (now < first) {
      timer_wake_ = first;
      timer_cv_.wait_until(lock, first);
      timer_wake_ = Clock::time_point::min();  // awake: nothing needs to wake it
      continue;
    }
    std::vector<uint64_t> expired;
    std::vector<std::function<void()>> due;
    for (auto it = deadlines_.begin(); it != deadlines_.end() && it->first <= now; ++it) {
      expired.push_back(it->second);
    }
    while (!timers_.empty() && timers_.begin()->first <= now) {
      due.push_back(std::move(timers_.begin()->second));
      timers_.erase(timers_.begin());
    }
    lock.unlock();
    for (uint64_t id : expired) {
      complete(id,
               [&](Pending& p) {
                 finish(std::move(p), {},
                        std::make_exception_ptr(TimeoutError(
                            "call to '" + p.callee + "' on " + workers_[p.peer].name +
                            " timed out")));
               },
               0);
    }
    for (auto& fn : due) pool_->post(std::move(fn));
    lock.lock();
  }
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
  if (graceful && transport_) {
    auto wait_calls = [this] {
      std::unique_lock<std::mutex> lock(mu_);
      idle_cv_.wait(lock, [this] { return pending_.empty(); });
    };
    wait_calls();
    // RRef deletes, confirmations and hand-overs still in flight.
    rrefs_->wait_idle(options_.init_timeout);
    wait_calls();
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_ = false;
  }
  fail_where([](const Pending&) { return true; },
             [this](const Pending& p) {
               return std::make_exception_ptr(
                   ShutdownError("agent " + name() + " shut down during '" + p.callee + "'"));
             });
  if (transport_) transport_->close();
  {
    std::lock_guard<std::mutex> lock(mu_);
    timer_stop_ = true;
    timer_cv_.notify_all();
  }
  if (timer_.joinable()) timer_.join();
  if (pool_) pool_->stop();
  {
    std::lock_guard<std::mutex> lock(conn_mu_);
    for (auto& p : peers_) p = nullptr;
  }
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

size_t Agent::pending_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

size_t Agent::live_connections() const { return transport_ ? transport_->live_connections() : 0; }

void Agent::drop_connection(int rank) {
  std::shared_ptr<Connection> c;
  {
    std::lock_guard<std::mutex> lock(conn_mu_);
    c = peers_.at(rank);
  }
  if (c) c->close("dropped by test");
}

}  // namespace tandem::rpc
