// What the layers built on rpc/ (RRefs, distributed autograd, and the
// optimizer, module and pipeline layers to come) use of an agent beyond the
// user's API in rpc/agent.h: its extensions, its pool and timers, one-way
// messages, and running code as if in one of its handlers. Not installed.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/rpc/agent.h"

namespace tandem::rpc {

struct LayerAccess {
  static const std::vector<std::shared_ptr<AgentExtension>>& extensions(const Agent& a);
  static const std::shared_ptr<ThreadPool>& pool(const Agent& a);
  static void notify(Agent& a, const std::string& to, const std::string& fn,
                     std::vector<c10::IValue> args);
  static void schedule_after(Agent& a, std::chrono::microseconds delay, std::function<void()> fn);
  static std::shared_ptr<const Handler> find_handler(const Agent& a, const std::string& fn);
  static void spin_until_done(const Agent& a, const RawFuture& f);
  // On the thread delivering messages: the loop thread, or one polling its
  // connection (rpc/transport.h, 8.).
  static bool on_loop_thread(const Agent& a);
  // Tests (rpc/agent/testing.h).
  static size_t pending_calls(const Agent& a);
  static size_t live_connections(const Agent& a);
  static uint64_t crossed_connections(const Agent& a);
  static void drop_connection(Agent& a, int rank);
};

namespace layer {

// The extension of type T the agent made (rpc/extension.h), or null.
template <class T>
std::shared_ptr<T> extension(const Agent& agent) {
  for (const auto& e : LayerAccess::extensions(agent)) {
    if (auto t = std::dynamic_pointer_cast<T>(e)) return t;
  }
  return nullptr;
}

// The same, or std::logic_error saying the agent has no `what` because it
// was made before `library` (the layer's library) was loaded.
template <class T>
std::shared_ptr<T> require_extension(const Agent& agent, const std::string& what,
                                     const std::string& library) {
  auto t = extension<T>(agent);
  if (!t) {
    throw std::logic_error("agent " + agent.name() + " has no " + what +
                           ": it was created before Tandem's " + library + " library was loaded");
  }
  return t;
}

// The agent's thread pool (handlers and callbacks run there).
inline const std::shared_ptr<ThreadPool>& pool(const Agent& agent) {
  return LayerAccess::pool(agent);
}

// A request that wants no reply: `fn` runs on `to` and whatever it returns
// or throws is dropped there. Throws here only what encoding, connecting or
// writing throws (a peer that is gone: DisconnectedError).
inline void notify(Agent& agent, const std::string& to, const std::string& fn,
                   std::vector<c10::IValue> args) {
  LayerAccess::notify(agent, to, fn, std::move(args));
}

// Runs `fn` on the pool after `delay` (dropped once the agent shuts down).
inline void schedule_after(Agent& agent, std::chrono::microseconds delay,
                           std::function<void()> fn) {
  LayerAccess::schedule_after(agent, delay, std::move(fn));
}

// The function a request naming `fn` would run ("tandem.*": a layer's own),
// or null.
inline std::shared_ptr<const Handler> find_handler(const Agent& agent, const std::string& fn) {
  return LayerAccess::find_handler(agent, fn);
}

// Spins up to AgentOptions::sync_spin for `f` (blocking waits do, first).
inline void spin_until_done(const Agent& agent, const RawFuture& f) {
  LayerAccess::spin_until_done(agent, f);
}

// True where the agent delivers messages (its loop thread, or a thread
// polling its connection): what `..._from_loop` functions assert.
inline bool on_loop_thread(const Agent& agent) { return LayerAccess::on_loop_thread(agent); }

}  // namespace layer
}  // namespace tandem::rpc
