// Agent: the handle users hold. Each call goes to the AgentImpl it owns
// (rpc/agent/agent_impl.h), which does the work.
#include "tandem/rpc/agent.h"

#include "tandem/rpc/agent/agent_impl.h"

namespace tandem::rpc {

std::shared_ptr<Agent> Agent::create(AgentOptions options, std::shared_ptr<Registry> registry,
                                     c10::intrusive_ptr<c10d::Store> store) {
  std::shared_ptr<Agent> agent(new Agent(std::move(options), std::move(registry)));
  agent->impl_->start(std::move(store));
  return agent;
}

Agent::Agent(AgentOptions options, std::shared_ptr<Registry> registry)
    : impl_(std::make_unique<AgentImpl>(*this, std::move(options), std::move(registry))) {}

// ~AgentImpl shuts the agent down (shutdown(false)) before anything goes.
Agent::~Agent() = default;

const WorkerInfo& Agent::info() const { return impl_->info(); }
const std::string& Agent::name() const { return impl_->name(); }
int Agent::rank() const { return impl_->rank(); }
int Agent::world_size() const { return impl_->world_size(); }
const WorkerInfo& Agent::get_worker_info(const std::string& name) const {
  return impl_->get_worker_info(name);
}
const WorkerInfo& Agent::get_worker_info(int rank) const { return impl_->get_worker_info(rank); }
std::vector<WorkerInfo> Agent::get_worker_infos() const { return impl_->get_worker_infos(); }
Registry& Agent::registry() { return impl_->registry(); }
const AgentOptions& Agent::options() const { return impl_->options(); }
TransportStats Agent::transport_stats() const { return impl_->transport_stats(); }
Metrics Agent::metrics() const { return impl_->metrics(); }
std::string Agent::debug_info() const { return impl_->debug_info(); }
std::string Agent::transport_to(const std::string& to) const { return impl_->transport_to(to); }
void Agent::watch(const std::string& worker) { impl_->watch(worker); }
std::string Agent::stalled(const std::string& worker) const { return impl_->stalled(worker); }
std::optional<c10::Device> Agent::answer_device_to(const std::string& caller,
                                                   c10::Device device) const {
  return impl_->answer_device_to(caller, device);
}
size_t Agent::cuda_ipc_held() const { return impl_->cuda_ipc_held(); }
const std::shared_ptr<Tracer>& Agent::tracer() const { return impl_->tracer(); }
RRefContext& Agent::rrefs() { return impl_->rrefs(); }

Future<c10::IValue> Agent::call(const std::string& to, const std::string& fn,
                                std::vector<c10::IValue> args, std::chrono::milliseconds timeout) {
  return impl_->call(to, fn, std::move(args), timeout);
}

void Agent::shutdown(bool graceful) { impl_->shutdown(graceful); }

RawFuture Agent::start_call(const std::string& to, const std::string& fn,
                            std::vector<c10::IValue> args, std::chrono::milliseconds timeout) {
  return impl_->start_call(to, fn, std::move(args), timeout);
}
void Agent::spin_until_done(const RawFuture& f) const { impl_->spin_until_done(f); }
const std::shared_ptr<ThreadPool>& Agent::pool() const { return impl_->pool(); }

}  // namespace tandem::rpc
