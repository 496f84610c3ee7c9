// CallScope: what the work running on a thread inherited from whoever
// started it, for one agent.
//
//  1. A handler runs in the scope of its request: the agent serving it, what
//     is left of the caller's deadline, and the caller's autograd context.
//     Calls it makes inherit all three.
//  2. Future::then() captures the scope current where the callback was
//     attached and runs the callback in it, with the agent set to the one
//     whose future it is: a callback chained inside a handler or an autograd
//     context makes its calls in that context, with that deadline, and the
//     convenience API (rpc::rpc_async, ...) acts on that agent even once
//     rpc::shutdown() has begun.
//  3. An autograd::Context makes its id current for its agent on the thread
//     that made it, for as long as it lives.
// Scopes are saved and restored like a stack (ScopeGuard), never shared
// between threads; each thread starts with an empty one.
#pragma once

#include <chrono>
#include <cstdint>

namespace tandem::rpc {

class Agent;

struct CallScope {
  // The agent whose handler or callback runs here (current_agent()).
  Agent* agent = nullptr;
  bool has_deadline = false;
  std::chrono::steady_clock::time_point deadline;
  // The autograd context current here, and the agent it belongs to.
  const Agent* context_agent = nullptr;
  uint64_t autograd_context = 0;
  // The rank whose request the handler running here serves (-1: none).
  int caller = -1;
};

// This thread's scope.
const CallScope& current_scope();

// Makes `scope` current until destroyed, then restores the previous one.
class ScopeGuard {
 public:
  explicit ScopeGuard(const CallScope& scope);
  ~ScopeGuard();
  ScopeGuard(const ScopeGuard&) = delete;
  ScopeGuard& operator=(const ScopeGuard&) = delete;

 private:
  CallScope saved_;
};

// The autograd context current on this thread for `agent` (0: none).
inline uint64_t autograd_context_for(const Agent& agent) {
  const CallScope& s = current_scope();
  return s.context_agent == &agent ? s.autograd_context : 0;
}

}  // namespace tandem::rpc
