// Recorder: what distributed autograd does to the messages an agent sends
// and receives (the glue, autograd/dist_autograd.h, hands it the
// rpc::AgentExtension hooks before_send / after_encode / after_receive).
//
// What it promises:
//  1. Outside a context (m.autograd_context == 0) the hooks return at once.
//     A request's context is the sender's current one (rpc/scope.h); a
//     response carries its request's. The engine's own requests
//     ("tandem.autograd.*") travel outside any context.
//  2. before_send, inside a context: the context is made here if need be and
//     the destination remembered for its release (autograd/context.h). If
//     the message carries tensors that require grad, it gets an autograd
//     message id, (rank << 48) | counter, and its reach (reach_of; empty,
//     without a walk, while nothing was received here in the context).
//  3. after_encode: a SendBackward whose next edges are the gradient edges of
//     the tensors that travel (frame.grad_sources) is kept in the context
//     under the message id.
//  4. after_receive: the metadata is checked (the message id must name its
//     sender, the reach known ranks: else rpc::ProtocolError), and one
//     RecvBackward, holding the message's reach, becomes the grad_fn of
//     every received tensor that requires grad (autograd/functions.h).
//  5. A context released here records nothing more: a message sent in it
//     travels outside any context, and tensors received in it arrive as new
//     leaves that require grad.
// The hooks run on every message's path (calling, loop and pool threads);
// they lock only the context's own mutex, and walk the graph (reach_of) only
// below sent tensors, only once something was received in the context.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "tandem/autograd/context.h"
#include "tandem/rpc/message.h"

namespace tandem::autograd {

// The reach of a message carrying `tensors` (autograd/engine.h): for every
// RecvBackward below them on this worker, its message id and its own reach;
// sorted, without duplicates.
std::vector<uint64_t> reach_of(const std::vector<at::Tensor>& tensors);

class Recorder {
 public:
  // `world_size` is asked when a message arrives (an agent knows it only
  // once it has met the others).
  Recorder(std::shared_ptr<Contexts> contexts, std::function<int()> world_size)
      : contexts_(std::move(contexts)),
        rank_(contexts_->rank()),
        world_size_(std::move(world_size)) {}

  void before_send(rpc::Message& m, int dest);
  void after_encode(const rpc::Message& m, rpc::OutFrame& frame, int dest);
  void after_receive(rpc::Message& m, int from);

 private:
  const std::shared_ptr<Contexts> contexts_;
  const int rank_;
  const std::function<int()> world_size_;
  std::atomic<uint64_t> next_message_{1};
};

}  // namespace tandem::autograd
