// Distributed autograd: backward through a model whose pieces ran on other
// workers, as torch.distributed.autograd does for Python.
//
//   #include <tandem/autograd/autograd.h>
//   namespace dist_autograd = tandem::autograd;
//
//   {
//     dist_autograd::Context ctx;                       // RAII; ctx.id()
//     at::Tensor h = rpc::rpc_sync<at::Tensor>("worker1", "layer1", x);
//     at::Tensor loss = rpc::rpc_sync<at::Tensor>("worker2", "layer2", h).sum();
//     dist_autograd::backward(ctx.id(), {loss});        // runs on worker0, 1 and 2
//     auto grads = dist_autograd::get_gradients(ctx.id());  // this worker's leaves
//     at::Tensor gx = grads.at(x);                    // out_of_range if x got none
//   }                                                   // released on every worker
//
// Inside a context, every tensor that requires grad and crosses a worker
// (arguments, results, to_here(), RRef proxies) is recorded; the context is
// current in the handlers it reaches and in the calls they make. backward()
// differentiates the roots through every worker that took part, running each
// local subgraph once, after all the gradients that will reach it; tensors
// sent but never used by the loss are skipped (autograd/engine.h). Gradients
// accumulate per context and never touch .grad, so contexts can run side by
// side on the same parameters. Errors: a failure on any worker raises
// rpc::RemoteError naming it; a worker that dies raises DisconnectedError.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/rpc/agent.h"

namespace tandem::autograd {

class DistAutograd;

// A worker's leaf gradients in one context: leaf tensor -> gradient, looked
// up by identity (grads.at(weight)). at(t) of a tensor that got no gradient
// in this context throws std::out_of_range naming the context and the
// worker, where a bare c10::Dict would say only "not in the map".
class Gradients {
 public:
  using Dict = c10::Dict<at::Tensor, at::Tensor>;
  Gradients(Dict grads, uint64_t context_id, std::string worker)
      : grads_(std::move(grads)), context_id_(context_id), worker_(std::move(worker)) {}

  at::Tensor at(const at::Tensor& t) const;
  bool contains(const at::Tensor& t) const { return grads_.contains(t); }
  size_t size() const { return grads_.size(); }
  bool empty() const { return grads_.empty(); }
  Dict::iterator find(const at::Tensor& t) const { return grads_.find(t); }
  Dict::iterator begin() const { return grads_.begin(); }
  Dict::iterator end() const { return grads_.end(); }
  const Dict& dict() const { return grads_; }
  operator const Dict&() const { return grads_; }
  uint64_t context_id() const { return context_id_; }

 private:
  Dict grads_;
  uint64_t context_id_;
  std::string worker_;
};

// A distributed autograd context, current on this thread while it lives.
// Contexts do not nest (a second one on the same thread, or one inside a
// handler already running in a context, throws std::logic_error). The
// destructor releases the context here at once and sends the release on to
// every other worker that took part without waiting for their answers (as
// PyTorch does): the next step's calls do not queue behind it. A graceful
// shutdown still waits for those releases, so a peer never reports the
// context as leaked.
class Context {
 public:
  Context();                            // on the current agent (rpc::current_agent())
  explicit Context(rpc::Agent& agent);  // on this agent
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  uint64_t id() const { return id_; }

 private:
  std::shared_ptr<DistAutograd> owner_;
  uint64_t id_ = 0;
  std::unique_ptr<rpc::ScopeGuard> scope_;  // makes id_ current on this thread
};

// The context current on this thread (inside a Context, in a handler
// serving a request made inside one, or in a Future::then callback attached
// inside either); 0 when none.
uint64_t current_context_id();

// Runs backward from `roots` (scalars that require grad) through every
// worker that took part in context `context_id`; returns when all of it is
// done, or throws the first error. With retain_graph the graph can be run
// again. The agent is the one that owns the context on this thread, else
// the current agent; timeout defaults to its rpc_timeout.
void backward(uint64_t context_id, const std::vector<at::Tensor>& roots, bool retain_graph = false);
void backward(rpc::Agent& agent, uint64_t context_id, const std::vector<at::Tensor>& roots,
              bool retain_graph = false, std::chrono::milliseconds timeout = rpc::kDefaultTimeout);

// This worker's leaf gradients in the context: leaf tensor -> gradient
// (looked up by identity: grads.at(weight)). The map is a copy, the
// gradients are not: they are the context's own tensors, so changing one in
// place (DistributedOptimizer::clip_grad_norm scales them) is what the next
// get_gradients and step see. Not while a backward() in the same context
// runs: accumulating replaces the context's tensor with a new sum.
Gradients get_gradients(uint64_t context_id);
Gradients get_gradients(rpc::Agent& agent, uint64_t context_id);

// Adds `grad` to this worker's gradient of `leaf` in context `context_id`,
// as a backward() reaching the leaf would (the pipeline's stages compute
// their gradients themselves, micro-batch by micro-batch, and put them here
// for DistributedOptimizer::step). Call it where a message inside the
// context arrived (a handler serving a call made inside it): the context
// joins this worker as that message would have made it, and goes with the
// context's release. One released here is std::invalid_argument naming
// it. Not while a backward() in the same context runs here. The first
// gradient of a leaf is kept as given, without a copy (as backward keeps
// the ones it computes): do not change it afterwards.
void accumulate_gradient(rpc::Agent& agent, uint64_t context_id, const at::Tensor& leaf,
                         const at::Tensor& grad);

// Contexts alive on `agent` (tests and leak checks).
size_t live_contexts(rpc::Agent& agent);

}  // namespace tandem::autograd
