// AgentExtension: how a layer above the RPC layer (distributed autograd)
// hooks into an agent without the agent knowing about it.
//
// A layer registers a factory once per process (register_agent_extension,
// typically from a static initialiser in its library); every agent created
// afterwards makes one extension from each factory, lets it register its
// internal "tandem.*" functions, and calls it around every request and
// response it sends or receives:
//  1. before_send(m, dest), on the sending thread, before encoding: the
//     extension may set m.autograd_context / m.autograd_message.
//  2. after_encode(m, frame, dest): the frame is built and about to be
//     written; frame.grad_sources lists the caller's tensors that travel
//     flagged as requiring grad.
//  3. after_receive(m, from): a decoded request (on the pool thread, before
//     its handler runs) or response (on the loop thread, before the caller's
//     future completes); m.grad_tensors lists the flagged tensors.
//  4. live_objects(): at a graceful shutdown, once every worker has finished
//     its work, what the layer still holds for the user ("distributed
//     autograd context 7"); the agent reports them as leaks, like RRefs.
//  5. close(): the agent is shutting down; called once, before the pool stops.
// The hooks run on hot paths: they must return at once for messages that are
// none of their business. An exception from before_send or after_encode fails
// the call (or reply) being sent; one from after_receive fails the request
// (the caller sees a RemoteError) or the call the response answers.
//
// The agent also carries one piece of state for the layers: the context id of
// the request a handler is serving (its m.autograd_context) is inherited by
// every call that handler makes, like its deadline (handler_autograd_context()).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/rpc/message.h"

namespace tandem::rpc {

class Agent;
class Registry;

class AgentExtension {
 public:
  virtual ~AgentExtension() = default;
  virtual void register_handlers(Registry& internal) { (void)internal; }
  // Functions that run where their message is delivered (the agent's loop
  // thread, or a thread polling that connection: rpc/transport.h, 8.),
  // saving the hand-off to the pool: only for bounded work that never
  // blocks (no calls, no connecting, no user code), and that may run on two
  // threads at once for messages from two connections. Their requests
  // should come through notify().
  virtual void register_loop_handlers(Registry& on_loop) { (void)on_loop; }
  virtual void before_send(Message& m, int dest) = 0;
  virtual void after_encode(const Message& m, OutFrame& frame, int dest) = 0;
  virtual void after_receive(Message& m, int from) = 0;
  virtual std::vector<std::string> live_objects() const { return {}; }
  // Agent::metrics(): the layer's own figures, under names of its own
  // ("autograd.contexts").
  virtual void add_metrics(std::map<std::string, int64_t>& out) const { (void)out; }
  // Agent::debug_info(): lines about what the layer holds or waits for.
  virtual std::string debug_info() const { return {}; }
  virtual void close() {}
};

using ExtensionFactory = std::function<std::shared_ptr<AgentExtension>(Agent&)>;

// Every agent created after this call gets an extension from `factory`.
void register_agent_extension(ExtensionFactory factory);

// The autograd context id inherited by the handler running on this thread
// for `agent` (0 when none, or when the handler belongs to another agent).
uint64_t handler_autograd_context(const Agent& agent);

}  // namespace tandem::rpc
