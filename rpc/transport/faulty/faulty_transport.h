// A transport that misbehaves on purpose, for tests: a decorator over any
// backend that drops, delays, duplicates, reorders or cuts chosen frames, as
// PyTorch's FaultyTensorPipeAgent does for its tests.
//
//   auto plan = std::make_shared<FaultPlan>();
//   plan->add({Fault::kDrop, MessageKind::kRequest, "tandem.rref.fork"});  // the first one
//   options.transport = faulty_transport(plan);                // over TCP by default
//
// How it works:
//  1. Faults apply to frames as they are sent, on any connection of any
//     agent whose transport shares the plan. A Fault matches frames by kind
//     and callee (empty: any); of the matching frames it lets `skip` through,
//     then hits the next `count` (-1: every one after). Handshakes are never
//     matched. The first fault that matches a frame decides its fate.
//  2. What a hit does:
//       kDrop       the frame is never written; send() returns as if it was
//       kDelay      written `delay` later; later frames on the same
//                   connection wait behind it (the order is kept)
//       kDuplicate  written twice
//       kReorder    held until the next frame on the same connection has
//                   been written (the two swap): the one reordering a
//                   connection may see, when the layer above allows it
//       kCut        the connection is closed instead (as if the network
//                   dropped it); the frame is lost
//  3. Everything else (listening, receiving, closing) is the inner
//     transport's, and the callbacks see the decorated connections, so
//     replies sent on accepted connections meet the faults too.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "tandem/rpc/transport.h"

namespace tandem::rpc {

struct Fault {
  enum Action { kDrop, kDelay, kDuplicate, kReorder, kCut };
  Fault(Action action, std::optional<MessageKind> kind = std::nullopt, std::string callee = {},
        int skip = 0, int count = 1, std::chrono::milliseconds delay = {})
      : action(action),
        kind(kind),
        callee(std::move(callee)),
        skip(skip),
        count(count),
        delay(delay) {}

  Action action;
  std::optional<MessageKind> kind;  // none: any kind but a handshake
  std::string callee;               // empty: any (requests carry one; replies none)
  int skip;                         // matching frames let through first
  int count;                        // frames hit after those; -1: all
  std::chrono::milliseconds delay;  // kDelay
};

// The faults of a test, shared by the transports that use it. Thread-safe.
class FaultPlan {
 public:
  void add(Fault fault);
  // Frames hit by fault `index` (in the order added) so far.
  int hits(size_t index) const;
  // The fault that hits a frame of this kind and callee, counting it.
  std::optional<Fault> take(MessageKind kind, const std::string& callee);

 private:
  struct Entry {
    Fault fault;
    int seen = 0;  // matching frames so far
    int hit = 0;
  };
  mutable std::mutex mu_;
  std::vector<Entry> faults_;
};

// A factory for the agent (AgentOptions::transport): `inner` wrapped in the faults of `plan`.
TransportFactory faulty_transport(std::shared_ptr<FaultPlan> plan,
                                  TransportFactory inner = tcp_transport());

}  // namespace tandem::rpc
