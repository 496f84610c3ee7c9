// AgentImpl: what an rpc::Agent (rpc/agent.h) is made of. The user holds
// an Agent; it owns one AgentImpl and forwards every call to it, so the
// agent's tables, threads and the codec's types stay out of the installed
// headers. Layers reach it through rpc/layer.h (LayerAccess), never here.
//
// One file per idea, all in this folder: start-up (agent.cc), the
// connection handshake (handshake.cc), shutdown (shutdown.cc), the outgoing
// calls (calls.cc) and the table of calls in flight with their deadlines
// and timer (call_table.h), dispatch of what arrives and the handler scope
// (dispatch.cc), the connection table (connection_table.h,
// connections.cc), CUDA IPC's held buffers (cuda_ipc.cc); what workers
// publish at the rendezvous is in rpc/rendezvous/worker_entry.h. Threads:
// the transport's loop thread delivers messages (`..._from_loop`), the pool
// runs handlers and callbacks, the call table's timer expires deadlines;
// any thread may call.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tandem/rpc/agent.h"
#include "tandem/rpc/thread_pool.h"
#include "tandem/rpc/wire/wire.h"

namespace tandem::rpc {

class CallTable;
class ConnectionTable;
struct HandshakeTable;
class ProtocolLog;

class AgentImpl {
 public:
  // `self`: the Agent this implements (it owns this object).
  AgentImpl(Agent& self, AgentOptions options, std::shared_ptr<Registry> registry);
  ~AgentImpl();
  AgentImpl(const AgentImpl&) = delete;
  AgentImpl& operator=(const AgentImpl&) = delete;
  // Meets the other workers (Agent::create).
  void start(c10::intrusive_ptr<c10d::Store> store);

  // What Agent (rpc/agent.h) offers, with the same contracts.
  const WorkerInfo& info() const { return workers_[rank_]; }
  const std::string& name() const { return self_name_; }
  int rank() const { return rank_; }
  int world_size() const { return static_cast<int>(workers_.size()); }
  const WorkerInfo& get_worker_info(const std::string& name) const;
  const WorkerInfo& get_worker_info(int rank) const;
  std::vector<WorkerInfo> get_worker_infos() const { return workers_; }
  Registry& registry() { return *registry_; }
  const AgentOptions& options() const { return options_; }
  TransportStats transport_stats() const;
  Metrics metrics() const;
  std::string debug_info() const;
  std::string transport_to(const std::string& to) const;
  void watch(const std::string& worker);
  std::string stalled(const std::string& worker) const;
  std::optional<c10::Device> answer_device_to(const std::string& caller, c10::Device device) const;
  size_t cuda_ipc_held() const;
  const std::shared_ptr<Tracer>& tracer() const { return trace_; }
  RRefContext& rrefs() { return *rrefs_; }
  Future<c10::IValue> call(const std::string& to, const std::string& fn,
                           std::vector<c10::IValue> args, std::chrono::milliseconds timeout);
  void shutdown(bool graceful = true);

 private:
  friend class Agent;         // rpc/agent.cc: rpc_sync's pieces
  friend struct LayerAccess;  // rpc/layer.h, rpc/agent/testing.h

  // Spins up to AgentOptions::sync_spin for `f` to complete (the blocking
  // calls use it before they sleep).
  void spin_until_done(const RawFuture& f) const;
  const std::shared_ptr<ThreadPool>& pool() const { return pool_; }

  // calls.cc: the outgoing side.
  RawFuture start_call(const std::string& to, const std::string& fn, std::vector<c10::IValue> args,
                       std::chrono::milliseconds timeout);
  void notify(const std::string& to, const std::string& fn, std::vector<c10::IValue> args);

  // True on a thread inside on_message_from_loop (the loop thread, or one
  // polling its connection).
  static bool& delivering_here();

  // Runs the extensions' before_send, encodes, runs their after_encode.
  // `via`: the connection the frame will go on, where the caller knows it
  // (an answer goes back on its request's); else the one to `dest`.
  OutFrame encode_with_extensions(Message& m, int dest, const Connection* via = nullptr);

  // connections.cc: the connection to `rank`, opened and greeted on first use.
  ConnectionPtr connection_to(int rank, std::chrono::milliseconds timeout);
  void on_closed_from_loop(const ConnectionPtr& conn, const std::string& reason);
  // Liveness (rpc/transport.h, 9.): a handshake with `rank` finished, so it
  // is not stalled (any more).
  void peer_alive(int rank);
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
  // One step of a peer's handshake (agent.cc, rpc/agent/handshake.h); a step
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

  Agent& self_;  // the user's handle, which owns this
  AgentOptions options_;
  std::shared_ptr<Registry> registry_;
  std::shared_ptr<Registry> internal_;       // "tandem.*": the layers' own functions
  std::shared_ptr<Registry> loop_internal_;  // "tandem.*" that run on the loop thread
  std::shared_ptr<RRefContext> rrefs_;
  std::vector<std::shared_ptr<AgentExtension>> extensions_;
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<MetricsRecorder> metrics_ = std::make_unique<MetricsRecorder>();
  std::shared_ptr<Tracer> trace_;  // null unless tracing (rpc/trace.h)
  void measure_clock_offset();     // rpc/trace.h, 3.
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
  // CUDA IPC (rpc/wire/device.h): whether CUDA tensors to a rank may go as
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
  // By rank: why a connection to it was closed as stalled, until a
  // handshake with it finishes again (empty: not stalled).
  mutable std::mutex stalled_mu_;
  std::vector<std::string> stalled_;
  std::atomic<uint64_t> next_id_{1};
  bool shut_down_ = false;
  std::mutex shutdown_mu_;
};

}  // namespace tandem::rpc
