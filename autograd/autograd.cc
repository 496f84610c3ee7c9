// The public API (autograd/autograd.h) over each agent's DistAutograd.
#include "tandem/autograd/autograd.h"

#include <ATen/ops/add.h>

#include "tandem/autograd/dist_autograd.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/errors.h"

namespace tandem::autograd {
namespace {

// The context a Context object made current on this thread.
struct Current {
  std::weak_ptr<DistAutograd> owner;
  uint64_t id = 0;
};
thread_local Current tls_current;

}  // namespace

Context::Context() : Context(*rpc::current_agent()) {}

Context::Context(rpc::Agent& agent) : owner_(DistAutograd::of(agent)) {
  uint64_t outer = current_context_id();
  if (outer != 0) {
    throw std::logic_error("distributed autograd context " + std::to_string(outer) +
                           " is already current on this thread: contexts do not nest");
  }
  id_ = owner_->contexts().new_context();
  tls_current = {owner_, id_};
  rpc::CallScope scope = rpc::current_scope();
  scope.context_agent = &agent;
  scope.autograd_context = id_;
  scope_ = std::make_unique<rpc::ScopeGuard>(scope);
}

Context::~Context() {
  scope_.reset();
  if (tls_current.id == id_) tls_current = {};
  try {
    // Gone here now; the other workers' answers are not waited for (a
    // failed one there leaves nothing this worker could free). The calls
    // carrying it are the agent's, so a graceful shutdown waits for them.
    (void)owner_->contexts().release(id_);
  } catch (const std::exception&) {
    // The agent is gone: nothing is left to release.
  }
}

uint64_t current_context_id() {
  if (tls_current.id != 0) return tls_current.owner.expired() ? 0 : tls_current.id;
  return rpc::current_scope().autograd_context;  // a handler's or a callback's
}

namespace {
// The DistAutograd that owns `context_id` on this thread, else the current agent's.
std::shared_ptr<DistAutograd> dist_for(uint64_t context_id) {
  if (tls_current.id == context_id) {
    if (auto c = tls_current.owner.lock()) {
      if (c->contexts().closed()) throw rpc::ShutdownError("agent " + c->name() + " is shut down");
      return c;
    }
  }
  return DistAutograd::of(*rpc::current_agent());
}
}  // namespace

void backward(uint64_t context_id, const std::vector<at::Tensor>& roots, bool retain_graph) {
  dist_for(context_id)->engine().backward(context_id, roots, retain_graph, rpc::kDefaultTimeout);
}

void backward(rpc::Agent& agent, uint64_t context_id, const std::vector<at::Tensor>& roots,
              bool retain_graph, std::chrono::milliseconds timeout) {
  DistAutograd::of(agent)->engine().backward(context_id, roots, retain_graph, timeout);
}

Gradients get_gradients(uint64_t context_id) {
  auto c = dist_for(context_id);
  return Gradients(c->contexts().gradients(context_id), context_id, c->name());
}

Gradients get_gradients(rpc::Agent& agent, uint64_t context_id) {
  auto c = DistAutograd::of(agent);
  return Gradients(c->contexts().gradients(context_id), context_id, c->name());
}

at::Tensor Gradients::at(const at::Tensor& t) const {
  auto it = find(t);
  if (it == end()) {
    throw std::out_of_range(
        "get_gradients(" + std::to_string(context_id_) + ") on " + worker_ +
        ": this tensor got no gradient in that context (it was not used by the roots "
        "backward() ran from, does not require grad, or lives on another worker)");
  }
  return it->value();
}

void accumulate_gradient(rpc::Agent& agent, uint64_t context_id, const at::Tensor& leaf,
                         const at::Tensor& grad) {
  auto c = DistAutograd::of(agent);
  auto ctx = c->contexts().get_or_create(context_id);
  if (!ctx) {
    throw std::invalid_argument("accumulate_gradient: context " + std::to_string(context_id) +
                                " was released on " + c->name() + " (or the agent is closing)");
  }
  if (!leaf.defined() || !grad.defined() || !leaf.sizes().equals(grad.sizes())) {
    throw std::invalid_argument("accumulate_gradient in context " + std::to_string(context_id) +
                                " on " + c->name() +
                                ": the leaf and its gradient must be defined and of one shape");
  }
  std::lock_guard<std::mutex> lock(ctx->mu);
  if (ctx->released) {
    throw std::invalid_argument("accumulate_gradient: context " + std::to_string(context_id) +
                                " was released on " + c->name());
  }
  auto it = ctx->grads.find(leaf);
  if (it == ctx->grads.end()) {
    ctx->grads.insert(leaf, grad.detach());
  } else {
    ctx->grads.insert_or_assign(leaf, at::add(it->value(), grad.detach()));
  }
}

size_t live_contexts(rpc::Agent& agent) { return DistAutograd::of(agent)->contexts().live(); }

}  // namespace tandem::autograd
