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
// rpc/agent/testing.h. Neither is part of this user-facing header.
//
// The implementation sits behind a pointer (rpc/agent/agent_impl.h, which
// says where each of its parts lives), so none of its members, threads or
// codec types reach a user's build.
//
// Start-up: the agent listens, publishes "name host port" under its rank in
// the c10d store, and reads every other worker's entry. Graceful shutdown:
// wait for this worker's calls to finish, meet every worker at a store
// barrier (so nobody closes while someone still calls it), then close.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/rpc/convert.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/future.h"
#include "tandem/rpc/limits.h"
#include "tandem/rpc/metrics.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/trace.h"
#include "tandem/rpc/transport.h"

namespace tandem::rpc {

class AgentImpl;
class RRefContext;
class ThreadPool;
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
  std::string name;                    // empty: "worker<rank>"
  int rank = -1;                       // -1: from the environment (RANK, SLURM_PROCID, ...)
  int world_size = -1;                 // -1: from the environment
  std::string init_method = "env://";  // or "tcp://host:port"
  std::chrono::milliseconds rpc_timeout{60000};    // per-call default; 0 = none
  std::chrono::milliseconds init_timeout{120000};  // rendezvous and shutdown barrier
  // How long a peer may send nothing at all before it counts as stalled
  // (stopped, frozen, swapped out; a busy one sends heartbeats) and its
  // connection is closed: calls on it fail with DisconnectedError saying
  // so, and what watches it learns why (stalled()). Sets
  // limits.peer_timeout. -1: $TANDEM_PEER_TIMEOUT in seconds (tandem-run
  // --peer-timeout sets it), else limits.peer_timeout (30 s); 0: never.
  std::chrono::milliseconds peer_timeout{-1};
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
  // to the kernel (rpc/common/host.h); skipped where the user tuned malloc.
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
  // than through host memory (rpc/wire/device.h). False: always through host
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

  const WorkerInfo& info() const;
  const std::string& name() const;
  int rank() const;
  int world_size() const;
  const WorkerInfo& get_worker_info(const std::string& name) const;
  const WorkerInfo& get_worker_info(int rank) const;
  std::vector<WorkerInfo> get_worker_infos() const;
  Registry& registry();
  const AgentOptions& options() const;
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
  // Liveness (AgentOptions::peer_timeout). watch(worker) opens a connection
  // to `worker` now if there is none (waiting for the dial, 5 s at most,
  // not for the handshake), so that its silence is noticed even when no
  // call goes there: a process group watches its members this way. A
  // connection that closes later is not dialed again.
  // stalled(worker) says why `worker` counts as stalled (a connection to it
  // was closed for its silence, and none has been made since), or "" when
  // it does not. Both throw std::invalid_argument for an unknown worker.
  void watch(const std::string& worker);
  std::string stalled(const std::string& worker) const;
  // Where a tensor on this worker's CUDA device `device` lands when this
  // agent answers worker `caller` (AgentOptions::device_maps: the inverse
  // of the caller's map, else this worker's own); nullopt when no map covers
  // it, so such an answer would be refused. Throws std::invalid_argument for
  // an unknown worker.
  std::optional<c10::Device> answer_device_to(const std::string& caller, c10::Device device) const;
  // Frames whose CUDA IPC buffers this agent holds until their receivers
  // release them (their copies are not known to be done yet).
  size_t cuda_ipc_held() const;
  // Where the layers add their events to this worker's timeline
  // (rpc/trace.h); null unless tracing. Valid while the agent lives.
  const std::shared_ptr<Tracer>& tracer() const;
  // This agent's remote references (rpc/rref.h is the typed front).
  RRefContext& rrefs();
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
  R rpc_sync(const CallOptions& opts, const std::string& to, const std::string& fn, A&&... args) {
    RawFuture raw = start_call(to, fn, to_ivalues(std::forward<A>(args)...), opts.timeout);
    spin_until_done(raw);
    return Future<R>(std::move(raw), pool()).wait();
  }

  // graceful: wait for this worker's calls and RRef messages, then for every
  // worker to arrive, then close; then throws ShutdownError naming any user
  // RRef still alive here (a leak). Otherwise: fail everything pending with
  // ShutdownError and close now. Idempotent; the destructor calls shutdown(false).
  void shutdown(bool graceful = true);

 private:
  friend struct LayerAccess;  // rpc/layer.h, rpc/agent/testing.h

  Agent(AgentOptions options, std::shared_ptr<Registry> registry);

  // What rpc_sync needs of the implementation.
  RawFuture start_call(const std::string& to, const std::string& fn, std::vector<c10::IValue> args,
                       std::chrono::milliseconds timeout);
  void spin_until_done(const RawFuture& f) const;
  const std::shared_ptr<ThreadPool>& pool() const;

  // Everything else (rpc/agent/agent_impl.h): the transport, the tables,
  // the pool, the layers' extensions.
  std::unique_ptr<AgentImpl> impl_;
};

// The agent whose handler is running on this thread, if any.
Agent* handler_agent();
// The worker whose request the handler running on this thread serves (its
// name); empty outside a handler.
std::string handler_caller();

}  // namespace tandem::rpc
