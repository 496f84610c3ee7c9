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
// Layers above (RRefs, distributed autograd) hook into every request and
// response through rpc/extension.h, and reach the agent's pool, timers and
// one-way messages through rpc/layer.h; tests reach its tables through
// rpc/testing.h. Neither is part of this user-facing header.
//
// The implementation is one file per idea: start-up, handshake and shutdown
// (agent.cc); the calls in flight, their deadlines and the timer
// (call_table.h, calls.cc); dispatch of what arrives and the handler scope
// (dispatch.cc); the connection table (connection_table.h, connections.cc).
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
#include <optional>
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
#include "tandem/rpc/metrics.h"
#include "tandem/rpc/trace.h"
#include "tandem/rpc/transport.h"
#include "tandem/rpc/wire.h"

namespace tandem::rpc {

class CallTable;
class ConnectionTable;
struct HandshakeTable;
class ProtocolLog;
class RRefContext;
struct LayerAccess;

constexpr std::chrono::milliseconds kDefaultTimeout{-1};  // "use the agent's default"
constexpr std::chrono::milliseconds kNoTimeout{0};
// The one-way notice that retires a connection (connection_table.h, 4.).
constexpr const char* kRetireCallee = "tandem.conn.retire";
// One way, to the sender of tensors that came by CUDA IPC: the receiver's
// copies are done, the buffers of the frame with this token may go.
constexpr const char* kIpcReleaseCallee = "tandem.cuda_ipc.release";

struct WorkerInfo {
  std::string name;
  int rank = -1;
  std::string host;
  int port = 0;
  // Where workers on the same host reach it over shared memory
  // (Transport::local_endpoint); empty when it offers no such path.
  std::string local;
  int cuda_devices = 0;
  // Which process it is (this boot's id and its pid): CUDA IPC goes only
  // to another one.
  std::string process;
  // Its AgentOptions::device_maps, by the worker they lead to.
  std::map<std::string, std::map<int, int>> device_maps;
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
  // Which transport carries calls to a peer: "auto" (shared memory to a
  // worker on the same host, TCP to the others; a failed shared-memory
  // set-up falls back to TCP with a logged reason), "shm" (shared memory
  // only: a peer it cannot reach that way fails the call, naming why) or
  // "tcp". Empty: $TANDEM_TRANSPORT, else "auto".
  std::string transport_mode;
  // Makes the transport (rpc/transport.h); empty: shm_transport(), or
  // tcp_transport() with transport_mode "tcp". Tests wrap it in the
  // fault-injecting decorator (rpc/transport/faulty/).
  TransportFactory transport;
  // Keep freed host memory mapped for the next step instead of giving it back
  // to the kernel (rpc/host.h); skipped where the user tuned malloc.
  bool retain_freed_memory = true;
  // Where to write this worker's trace (rpc/trace.h); empty: $TANDEM_TRACE,
  // and no trace when that is unset.
  std::string trace_dir;
  // Device maps, as PyTorch's TensorPipeRpcBackendOptions.set_device_map:
  // a CUDA tensor this worker sends to `worker` from its cuda:i arrives on
  // that worker's cuda:map[i]; answers and other messages coming back take
  // the inverse unless that worker has a map of its own. A CUDA tensor with
  // no map for its device is refused with an error naming the map to set,
  // never moved to the CPU unasked. Every worker checks every map at
  // start-up against both ends' devices (and that no two devices map onto
  // one, so answers can find their way back).
  std::map<std::string, std::map<int, int>> device_maps;
  // Adds `map` (device index here -> device index on `worker`) to
  // device_maps; throws std::invalid_argument for a negative index or a
  // device already mapped elsewhere.
  AgentOptions& set_device_map(const std::string& worker, const std::map<int, int>& map);
  // CUDA tensors to a worker in another process on this host (over shared
  // memory) travel as CUDA IPC handles, copied device to device, rather
  // than through host memory (rpc/device.h). False: always through host
  // memory.
  bool cuda_ipc = true;
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
  // What the transport refused or held back (rpc/transport.h).
  TransportStats transport_stats() const;
  // What this agent did, and holds now (rpc/metrics.h).
  Metrics metrics() const;
  // A readable snapshot for a stuck job: connections, calls in flight with
  // their callee, age and deadline, what the layers hold, the metrics.
  // Under tandem-run, SIGUSR1 to a worker prints it to stderr (rpc/api.h).
  std::string debug_info() const;
  // "shm" or "tcp": what carries this agent's calls to worker `to` now;
  // empty while no connection to it is open.
  std::string transport_to(const std::string& to) const;
  // Where a tensor on this worker's CUDA device `device` lands when this
  // agent answers worker `caller` (AgentOptions::device_maps: the inverse
  // of the caller's map, else this worker's own); nullopt when no map covers
  // it, so such an answer would be refused. Throws std::invalid_argument for
  // an unknown worker.
  std::optional<c10::Device> answer_device_to(const std::string& caller,
                                              c10::Device device) const;
  // Frames whose CUDA IPC buffers this agent holds until their receivers
  // release them (their copies are not known to be done yet).
  size_t cuda_ipc_held() const;
  // Where the layers add their events to this worker's timeline
  // (rpc/trace.h); null unless tracing. Valid while the agent lives.
  const std::shared_ptr<Tracer>& tracer() const { return trace_; }
  // This agent's remote references (rpc/rref.h is the typed front).
  RRefContext& rrefs() { return *rrefs_; }
  // The untyped call every other form goes through.
  Future<c10::IValue> call(const std::string& to, const std::string& fn,
                           std::vector<c10::IValue> args,
                           std::chrono::milliseconds timeout = kDefaultTimeout);

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

 private:
  friend struct LayerAccess;  // rpc/layer.h, rpc/testing.h

  Agent(AgentOptions options, std::shared_ptr<Registry> registry);
  void start(c10::intrusive_ptr<c10d::Store> store);

  // Spins up to AgentOptions::sync_spin for `f` to complete (the blocking
  // calls use it before they sleep).
  void spin_until_done(const RawFuture& f) const;

  // calls.cc: the outgoing side.
  RawFuture start_call(const std::string& to, const std::string& fn,
                       std::vector<c10::IValue> args, std::chrono::milliseconds timeout);
  void notify(const std::string& to, const std::string& fn, std::vector<c10::IValue> args);
  // Runs the extensions' before_send, encodes, runs their after_encode.
  // `via`: the connection the frame will go on, where the caller knows it
  // (an answer goes back on its request's); else the one to `dest`.
  OutFrame encode_with_extensions(Message& m, int dest, const Connection* via = nullptr);

  // connections.cc: the connection to `rank`, opened and greeted on first use.
  ConnectionPtr connection_to(int rank, std::chrono::milliseconds timeout);
  void on_closed_from_loop(const ConnectionPtr& conn, const std::string& reason);
  // The second connection of a pair that dialed each other at once
  // (connection_table.h, 4.): each side tells the other it sends no more
  // requests on it (retire), and once both have, and neither owes the other
  // an answer on it, it is closed (maybe_close_retired).
  void retire(const ConnectionPtr& conn);
  void on_retire_from_loop(const ConnectionPtr& conn);
  // Cheap while nothing is retiring: it is called after every answer.
  void maybe_close_retired(uint64_t conn_id) {
    if (retiring_count_.load(std::memory_order_acquire) > 0) close_retired_if_done(conn_id);
  }
  void close_retired_if_done(uint64_t conn_id);

  // dispatch.cc: the incoming side.
  void on_message_from_loop(const ConnectionPtr& conn, Message&& msg);
  // Whether `m` may be delivered on a thread polling its connection
  // (rpc/transport.h, 8.).
  bool inline_ok(const Message& m) const;
  // True on a thread inside on_message_from_loop (the loop thread, or one
  // polling its connection).
  static bool& delivering_here();
  // One step of a peer's handshake (agent.cc, rpc/handshake.h); a step
  // that fails closes the connection.
  void on_hello_from_loop(const ConnectionPtr& conn, const Message& msg);
  // With `handler` null, the function is looked up by the request's callee.
  void handle_request(const ConnectionPtr& conn, int from, Message msg,
                      std::shared_ptr<const Handler> handler = nullptr);
  void reply(const ConnectionPtr& conn, int to, uint64_t id, const RawFuture& result,
             uint64_t autograd_context, const std::string& callee = {},
             std::chrono::steady_clock::time_point started = {});
  void send_error(const ConnectionPtr& conn, uint64_t id, ErrorCode code,
                  const std::string& message);
  // The function registered as `fn`: "tandem.*" names are the layers' own
  // (internal_), every other name the user's registry.
  std::shared_ptr<const Handler> find_handler(const std::string& fn) const;

  // Meets every worker at `name` through the store. Throws TimeoutError after
  // init_timeout naming who did not arrive, DisconnectedError as soon as one
  // of those is found gone (or the store is lost).
  void barrier(const std::string& name, bool wait = true);
  // Why worker `rank` cannot be reached now (a fresh TCP connection fails),
  // or "" when it can.
  std::string unreachable_reason(int rank);
  void set_ready();

  AgentOptions options_;
  std::shared_ptr<Registry> registry_;
  std::shared_ptr<Registry> internal_;  // "tandem.*": the layers' own functions
  std::shared_ptr<Registry> loop_internal_;  // "tandem.*" that run on the loop thread
  std::shared_ptr<RRefContext> rrefs_;
  std::vector<std::shared_ptr<AgentExtension>> extensions_;
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<MetricsRecorder> metrics_ = std::make_unique<MetricsRecorder>();
  std::shared_ptr<Tracer> trace_;  // null unless tracing (rpc/trace.h)
  void measure_clock_offset();
  std::unique_ptr<CallTable> calls_;
  std::unique_ptr<ConnectionTable> conns_;
  struct Retiring {
    ConnectionPtr conn;
    bool sent = false;      // we told the peer
    bool received = false;  // the peer told us
  };
  mutable std::mutex retire_mu_;
  std::unordered_map<uint64_t, Retiring> retiring_;  // by connection id
  std::atomic<size_t> retiring_count_{0};            // retiring_.size(), read without the lock
  std::unique_ptr<HandshakeTable> handshakes_;
  std::unique_ptr<ProtocolLog> protocol_log_;  // rate-limited lines about bad peers
  std::unique_ptr<Transport> transport_;
  c10::intrusive_ptr<c10d::Store> store_;
  bool owns_store_ = false;
  std::string store_address_;  // "host:port" when this agent dialed the store itself
  int rank_ = -1;
  std::string self_name_;
  std::mutex ready_mu_;
  std::condition_variable ready_cv_;
  std::atomic<bool> ready_{false};  // rendezvous finished (or failed)
  std::vector<WorkerInfo> workers_;
  std::unordered_map<std::string, int> rank_of_;
  // By rank: where CUDA tensors go in what this worker asks of that one,
  // and in its answers to it (AgentOptions::device_maps), once started.
  std::vector<DeviceMap> send_maps_, answer_maps_;
  // CUDA IPC (rpc/device.h): whether CUDA tensors to a rank may go as
  // handles, and the buffers of frames sent so, by token, until released.
  bool ipc_to(int dest, const Connection* via) const;
  // `failed`: the handles could not be used here (the frame failed); the
  // sender then sends that worker its CUDA tensors through host memory.
  void send_ipc_release(const ConnectionPtr& conn, int to, uint64_t token, bool failed);
  void release_ipc(int from, uint64_t token, bool failed);
  void drop_ipc_held(int rank);  // -1: all
  struct IpcHeld {
    int rank = -1;
    std::shared_ptr<device::IpcExport> buffers;
  };
  mutable std::mutex ipc_mu_;
  std::unordered_map<uint64_t, IpcHeld> ipc_held_;
  std::vector<int> ipc_refused_by_;  // ranks that could not open our handles
  std::atomic<uint64_t> next_id_{1};
  bool shut_down_ = false;
  std::mutex shutdown_mu_;
};

// The agent whose handler is running on this thread, if any.
Agent* handler_agent();
// The worker whose request the handler running on this thread serves (its
// name); empty outside a handler.
std::string handler_caller();

}  // namespace tandem::rpc
