// The autograd nodes that distributed autograd adds to LibTorch's graph.
//
// Recording (autograd/recording.h) pairs them across workers by an autograd
// message id, (sender rank << 48) | counter:
//  - SendBackward, on the sender of a message whose tensors require grad.
//    Its next edges are those tensors' gradient edges; its inputs are the
//    gradients that come back for them from the receiver.
//  - RecvBackward, on the receiver: the grad_fn of every received tensor that
//    required grad. When it runs, the engine sends its input gradients to the
//    paired SendBackward. It also holds the message's reach: every send that
//    a gradient through it would reach, transitively (autograd/engine.h).
// Only Tandem's engine runs them: LibTorch's own backward() through a
// received tensor fails with a message saying so.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace tandem::autograd {

using torch::autograd::variable_list;

class SendBackward final : public torch::autograd::Node {
 public:
  // `dest`: the worker the message went to (its RecvBackward sends the gradient back).
  SendBackward(uint64_t context, uint64_t message, int dest, torch::autograd::edge_list next)
      : Node(std::move(next)), context_(context), message_(message), dest_(dest) {}
  variable_list apply(variable_list&& grads) override { return std::move(grads); }
  std::string name() const override { return "tandem::autograd::SendBackward"; }
  uint64_t context() const { return context_; }
  uint64_t message() const { return message_; }
  int dest() const { return dest_; }

 private:
  uint64_t context_;
  uint64_t message_;
  int dest_;
};

class RecvBackward final : public torch::autograd::Node {
 public:
  RecvBackward(uint64_t context, uint64_t message, int sender, std::vector<uint64_t> reach)
      : context_(context), message_(message), sender_(sender), reach_(std::move(reach)) {}
  variable_list apply(variable_list&& grads) override;
  std::string name() const override { return "tandem::autograd::RecvBackward"; }
  uint64_t context() const { return context_; }
  uint64_t message() const { return message_; }
  int sender() const { return sender_; }
  const std::vector<uint64_t>& reach() const { return reach_; }

 private:
  uint64_t context_;
  uint64_t message_;
  int sender_;
  std::vector<uint64_t> reach_;
};

// A graph root: hands the initial gradients (ones) to the roots' edges.
class RootBackward final : public torch::autograd::Node {
 public:
  RootBackward(torch::autograd::edge_list next, variable_list grads)
      : Node(std::move(next)), grads_(std::move(grads)) {}
  variable_list apply(variable_list&&) override { return grads_; }
  std::string name() const override { return "tandem::autograd::RootBackward"; }

 private:
  variable_list grads_;
};

// The worker rank that made an autograd message or context id.
inline int id_worker(uint64_t id) { return static_cast<int>(id >> 48); }

// A new id made by worker `rank` (contexts, autograd messages, graph tasks).
inline uint64_t make_id(int rank, std::atomic<uint64_t>& counter) {
  return (static_cast<uint64_t>(rank) << 48) | counter.fetch_add(1);
}

}  // namespace tandem::autograd
