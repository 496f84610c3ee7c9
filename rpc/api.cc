#include "tandem/rpc/api.h"

#include "tandem/rpc/layer.h"

#include <mutex>

namespace tandem::rpc {
namespace {
std::mutex g_mu;
std::shared_ptr<Agent> g_agent;
}  // namespace

std::shared_ptr<Agent> init(std::shared_ptr<Registry> registry, AgentOptions options) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_agent) throw std::logic_error("tandem::rpc::init: an agent is already running");
  g_agent = Agent::create(std::move(options), std::move(registry));
  return g_agent;
}

std::shared_ptr<Agent> current_agent() {
  if (Agent* a = handler_agent()) return a->shared_from_this();
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_agent) throw std::logic_error("tandem::rpc: no agent; call tandem::rpc::init() first");
  return g_agent;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_agent != nullptr;
}

void shutdown(bool graceful) {
  std::shared_ptr<Agent> agent;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (handler_agent() || (g_agent && layer::pool(*g_agent)->in_pool())) {
      throw std::logic_error("tandem::rpc::shutdown() cannot run inside a handler or callback");
    }
    agent = std::move(g_agent);
  }
  if (agent) agent->shutdown(graceful);
}

}  // namespace tandem::rpc
