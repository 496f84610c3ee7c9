// The convenience API: PyTorch-shaped free functions acting on the "current"
// agent, for programs with one agent per process.
//
//   auto reg = std::make_shared<tandem::rpc::Registry>();
//   reg->def("add", [](at::Tensor a, at::Tensor b) { return a + b; });
//   tandem::rpc::init(reg);                       // RANK, WORLD_SIZE, MASTER_ADDR, ...
//   auto y = tandem::rpc::rpc_sync<at::Tensor>("worker1", "add", x, x);
//   tandem::rpc::shutdown();                      // graceful
//
// The current agent is the one whose handler runs on this thread, else the
// one init() made. It is the only process-wide state in the RPC layer.
#pragma once

#include "tandem/rpc/agent.h"

namespace tandem::rpc {

std::shared_ptr<Agent> init(std::shared_ptr<Registry> registry, AgentOptions options = {});
// Throws std::logic_error when no agent was started. The pointer keeps the
// agent alive for as long as it is held, even across a concurrent shutdown().
std::shared_ptr<Agent> current_agent();
bool is_initialized();
void shutdown(bool graceful = true);

inline WorkerInfo get_worker_info() { return current_agent()->info(); }
inline WorkerInfo get_worker_info(const std::string& name) {
  return current_agent()->get_worker_info(name);
}
inline std::vector<WorkerInfo> get_worker_infos() { return current_agent()->get_worker_infos(); }

template <class R = c10::IValue, class... A>
R rpc_sync(const std::string& to, const std::string& fn, A&&... args) {
  return current_agent()->rpc_sync<R>(to, fn, std::forward<A>(args)...);
}
template <class R = c10::IValue, class... A>
R rpc_sync(const CallOptions& opts, const std::string& to, const std::string& fn, A&&... args) {
  return current_agent()->rpc_sync<R>(opts, to, fn, std::forward<A>(args)...);
}
template <class R = c10::IValue, class... A>
Future<R> rpc_async(const std::string& to, const std::string& fn, A&&... args) {
  return current_agent()->rpc_async<R>(to, fn, std::forward<A>(args)...);
}
template <class R = c10::IValue, class... A>
Future<R> rpc_async(const CallOptions& opts, const std::string& to, const std::string& fn,
                    A&&... args) {
  return current_agent()->rpc_async<R>(opts, to, fn, std::forward<A>(args)...);
}

}  // namespace tandem::rpc
