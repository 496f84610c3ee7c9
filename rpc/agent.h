// rpc::Agent: one worker's end of the RPC layer.
//
// An agent owns its transport (one libuv loop thread), the connection table
// (one lazily opened connection per peer), the table of calls in flight
// (id -> future + deadline), a timer thread that expires deadlines, the
// function registry, and the thread pool that runs handlers and callbacks.
// There is no other global state: several agents can live in one process.
//
// Life of a call (rpc_async("worker1", "add", x, 2)):
//  1. The caller encodes the request and writes it on the connection to
//     worker1 (opened and greeted with a Hello on first use).
//  2. worker1's loop thread decodes it and posts it to worker1's pool, which
//     looks the name up in the registry and runs the function. The function's
//     deadline (what was left of the caller's) is inherited by any RPC it makes.
//  3. The reply (or a typed error) goes back on the same connection; the
//     caller's loop thread completes the future, through the pool when user
//     callbacks may be attached.
//  4. A call fails with TimeoutError at its deadline, with DisconnectedError as
//     soon as its connection closes, and with ShutdownError on shutdown(false).
//
// Layers above (distributed autograd) hook into every request and response
// through rpc/extension.h; their bounded internal functions may run on the
// loop thread, and notify() sends a request that wants no reply.
//
// Start-up: the agent listens, publishes "name host port" under its rank in
// the c10d store, and reads every other worker's entry. Graceful shutdown:
// wait for this worker's calls to finish, meet every worker at a store
// barrier (so nobody closes while someone still calls it), then close.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tandem/rpc/convert.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/future.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/thread_pool.h"
#include "tandem/rpc/wire.h"

namespace tandem::rpc {

class UvTransport;
class Connection;
class RRefContext;

constexpr std::chrono::milliseconds kDefaultTimeout{-1};  // "use the agent's default"
constexpr std::chrono::milliseconds kNoTimeout{0};

struct WorkerInfo {
  std::string name;
  int rank = -1;
  std::string host;
  int port = 0;
};

struct AgentOptions {
  std::string name;          // empty: "worker<rank>"
  int rank = -1;             // -1: from the environment (RANK, SLURM_PROCID, ...)
  int world_size = -1;       // -1: from the environment
  std::string init_method = "env://";  // or "tcp://host:port"
  std::chrono::milliseconds rpc_timeout{60000};   // per-call default; 0 = none
  std::chrono::milliseconds init_timeout{120000};  // rendezvous and shutdown barrier
  int num_worker_threads = 4;
  // rpc_sync spins this long for its reply before it sleeps: waking a thread
  // on an idle core costs more than a loopback round trip (bench/rpc_bench:
  // 0-1 KiB p50 about 40 us with it, 75 us without, on a 2-core VM). The
  // price is up to this much CPU per synchronous call. 0 turns it off.
  std::chrono::microseconds sync_spin{50};
  // A pool thread that finished a handler or callback spins this long for
  // the next one before it sleeps (the next message of a conversation, such
  // as a chain of gradients, then starts without a wake-up). 0 turns it off.
  std::chrono::microseconds pool_spin{50};
  // Where to listen. Empty: loopback when the master is on this host, else
  // every interface. advertise_host is what peers dial; empty: derived.
  std::string listen_host;
  std::string advertise_host;
  std::string token;  // cluster token checked in the handshake; empty: $TANDEM_TOKEN
  Limits limits;
};

struct CallOptions {
  std::chrono::milliseconds timeout = kDefaultTimeout;
};

class Agent : public std::enable_shared_from_this<Agent> {
 public:
  // Starts an agent and meets the other workers. With `store` null, the store
  // comes from options.init_method (rank 0 hosts it).
  static std::shared_ptr<Agent> create(AgentOptions options, std::shared_ptr<Registry> registry,
                                       c10::intrusive_ptr<c10d::Store> store = {});
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  const WorkerInfo& info() const { return workers_[rank_]; }
  const std::string& name() const { return self_name_; }
  int rank() const { return rank_; }
  int world_size() const { return static_cast<int>(workers_.size()); }
  const WorkerInfo& get_worker_info(const std::string& name) const;
  const WorkerInfo& get_worker_info(int rank) const;
  std::vector<WorkerInfo> get_worker_infos() const { return workers_; }
  Registry& registry() { return *registry_; }
  const AgentOptions& options() const { return options_; }
  // This agent's remote references (rpc/rref.h is the typed front).
  RRefContext& rrefs() { return *rrefs_; }
  // The extension of type T this agent made (rpc/extension.h), or null.
  template <class T>
  std::shared_ptr<T> extension() const {
    for (const auto& e : extensions_) {
      if (auto t = std::dynamic_pointer_cast<T>(e)) return t;
    }
    return nullptr;
  }
  // Runs `fn` as if inside a handler of this agent: current_agent() and the
  // convenience API then act on this agent.
  void run_as_handler(const std::function<void()>& fn);
  const std::shared_ptr<ThreadPool>& pool() const { return pool_; }

  // The untyped call every other form goes through.
  Future<c10::IValue> call(const std::string& to, const std::string& fn,
                           std::vector<c10::IValue> args,
                           std::chrono::milliseconds timeout = kDefaultTimeout);

  // A request that wants no reply: `fn` runs on `to` and whatever it returns
  // or throws is dropped there. Throws here only what encoding, connecting or
  // writing throws (a peer that is gone: DisconnectedError).
  void notify(const std::string& to, const std::string& fn, std::vector<c10::IValue> args);

  template <class R = c10::IValue, class... A>
  Future<R> rpc_async(const std::string& to, const std::string& fn, A&&... args) {
    return rpc_async<R>(CallOptions{}, to, fn, std::forward<A>(args)...);
  }
  template <class R = c10::IValue, class... A>
  Future<R> rpc_async(const CallOptions& opts, const std::string& to, const std::string& fn,
                      A&&... args) {
    auto f = call(to, fn, to_ivalues(std::forward<A>(args)...), opts.timeout);
    return Future<R>(f.raw(), f.pool());
  }

  template <class R = c10::IValue, class... A>
  R rpc_sync(const std::string& to, const std::string& fn, A&&... args) {
    return rpc_sync<R>(CallOptions{}, to, fn, std::forward<A>(args)...);
  }
  template <class R = c10::IValue, class... A>
  R rpc_sync(const CallOptions& opts, const std::string& to, const std::string& fn,
             A&&... args) {
    RawFuture raw = start_call(to, fn, to_ivalues(std::forward<A>(args)...), opts.timeout);
    spin_until_done(raw);
    return Future<R>(std::move(raw), pool_).wait();
  }

  // graceful: wait for this worker's calls and RRef messages, then for every
  // worker to arrive, then close; then throws ShutdownError naming any user
  // RRef still alive here (a leak). Otherwise: fail everything pending with
  // ShutdownError and close now. Idempotent; the destructor calls shutdown(false).
  void shutdown(bool graceful = true);

  // Runs `fn` on the pool after `delay` (dropped once the agent shuts down).
  void schedule_after(std::chrono::microseconds delay, std::function<void()> fn);

  // Spins up to AgentOptions::sync_spin for `f` to complete (the blocking
  // calls use it before they sleep).
  void spin_until_done(const RawFuture& f) const;

  // Introspection for tests and tools.
  size_t pending_calls() const;
  size_t live_connections() const;
  // Closes the connection to `rank` as if the network dropped it (tests).
  void drop_connection(int rank);

 private:
  Agent(AgentOptions options, std::shared_ptr<Registry> registry);
  void start(c10::intrusive_ptr<c10d::Store> store);

  struct Pending {
    RawFuture future;
    int peer = -1;
    uint64_t conn_id = 0;
    std::string callee;
    std::chrono::steady_clock::time_point deadline;
    bool has_deadline = false;
  };

  RawFuture start_call(const std::string& to, const std::string& fn,
                       std::vector<c10::IValue> args, std::chrono::milliseconds timeout);
  std::shared_ptr<Connection> connection_to(int rank, std::chrono::milliseconds timeout);
  void on_message(const std::shared_ptr<Connection>& conn, Message&& msg);
  void on_closed(const std::shared_ptr<Connection>& conn, const std::string& reason);
  // With `handler` null, the function is looked up by the request's callee.
  void handle_request(const std::shared_ptr<Connection>& conn, Message msg,
                      std::shared_ptr<const Handler> handler = nullptr);
  void reply(const std::shared_ptr<Connection>& conn, uint64_t id, const RawFuture& result,
             uint64_t autograd_context);
  // Runs the extensions' before_send, encodes, runs their after_encode.
  OutFrame encode_with_extensions(Message& m, int dest);
  void send_error(const std::shared_ptr<Connection>& conn, uint64_t id, ErrorCode code,
                  const std::string& message);
  // Takes the pending call out of the table and completes it.
  void complete(uint64_t id, const std::function<void(Pending&)>& fill, uint64_t from_conn);
  void finish(Pending&& p, c10::IValue value, std::exception_ptr error);
  void fail_where(const std::function<bool(const Pending&)>& pred,
                  const std::function<std::exception_ptr(const Pending&)>& error);
  void timer_loop();
  void barrier(const std::string& name, bool wait = true);
  void set_ready();

  AgentOptions options_;
  std::shared_ptr<Registry> registry_;
  std::shared_ptr<Registry> internal_;  // "tandem.*": the layers' own functions
  std::shared_ptr<Registry> loop_internal_;  // "tandem.*" that run on the loop thread
  std::shared_ptr<RRefContext> rrefs_;
  std::vector<std::shared_ptr<AgentExtension>> extensions_;
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<UvTransport> transport_;
  c10::intrusive_ptr<c10d::Store> store_;
  bool owns_store_ = false;
  int rank_ = -1;
  std::string self_name_;
  std::mutex ready_mu_;
  std::condition_variable ready_cv_;
  std::atomic<bool> ready_{false};  // rendezvous finished (or failed)
  std::vector<WorkerInfo> workers_;
  std::unordered_map<std::string, int> rank_of_;

  std::mutex conn_mu_;
  std::vector<std::shared_ptr<Connection>> peers_;  // by rank
  std::vector<std::unique_ptr<std::mutex>> connect_mu_;

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;   // pending_ became empty
  std::condition_variable timer_cv_;  // a new earliest deadline, or stopping
  std::unordered_map<uint64_t, Pending> pending_;
  std::multimap<std::chrono::steady_clock::time_point, uint64_t> deadlines_;
  std::multimap<std::chrono::steady_clock::time_point, std::function<void()>> timers_;
  std::atomic<uint64_t> next_id_{1};
  bool accepting_ = true;  // new calls allowed
  bool timer_stop_ = false;
  // When the sleeping timer thread will wake by itself (min: it is awake).
  std::chrono::steady_clock::time_point timer_wake_ = std::chrono::steady_clock::time_point::min();
  bool shut_down_ = false;
  std::thread timer_;
  std::mutex shutdown_mu_;
};

// The agent whose handler is running on this thread, if any.
Agent* handler_agent();

}  // namespace tandem::rpc
