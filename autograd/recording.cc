#include "tandem/autograd/recording.h"

#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_set>

#include "tandem/rpc/errors.h"

namespace tandem::autograd {
namespace {

// Every tensor inside `v` that requires grad (in any order: only the set matters).
void collect_grad_tensors(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.requires_grad()) out.push_back(t);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) collect_grad_tensors(e, out);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) collect_grad_tensors(e, out);
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) {
      collect_grad_tensors(kv.key(), out);
      collect_grad_tensors(kv.value(), out);
    }
  }
}

}  // namespace

std::vector<uint64_t> reach_of(const std::vector<at::Tensor>& tensors) {
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const auto& t : tensors) {
    if (auto* fn = t.grad_fn().get(); fn && seen.insert(fn).second) stack.push_back(fn);
  }
  std::vector<uint64_t> out;
  while (!stack.empty()) {
    torch::autograd::Node* n = stack.back();
    stack.pop_back();
    if (auto* recv = dynamic_cast<RecvBackward*>(n)) {
      out.push_back(recv->message());
      out.insert(out.end(), recv->reach().begin(), recv->reach().end());
      continue;
    }
    for (const auto& e : n->next_edges()) {
      if (e.is_valid() && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

variable_list RecvBackward::apply(variable_list&&) {
  throw std::logic_error(
      "this tensor came over RPC inside distributed autograd context " + std::to_string(context_) +
      ": differentiate it with tandem::autograd::backward(context_id, roots), not "
      "LibTorch's own backward()");
}

void Recorder::before_send(rpc::Message& m, int dest) {
  if (m.kind == rpc::MessageKind::kRequest) {
    // The agent set the context current on the sending thread (rpc/scope.h).
    if (m.autograd_context == 0) return;               // outside any context: nothing to do
    if (m.callee.rfind("tandem.autograd.", 0) == 0) {  // the engine's own traffic
      m.autograd_context = 0;
      return;
    }
  } else if (m.kind != rpc::MessageKind::kResponse || m.autograd_context == 0) {
    return;
  }
  auto ctx = contexts_->get_or_create(m.autograd_context);
  if (!ctx) {  // released here: the message travels outside any context
    m.autograd_context = 0;
    return;
  }
  std::vector<at::Tensor> tensors;
  for (const auto& v : m.values) collect_grad_tensors(v, tensors);
  bool has_recvs;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    if (ctx->released) {  // released meanwhile: the message travels outside it
      m.autograd_context = 0;
      return;
    }
    ctx->known_workers.insert(dest);
    has_recvs = ctx->recvs > 0;
  }
  if (tensors.empty()) return;
  m.autograd_message = make_id(rank_, next_message_);
  // Nothing received here in this context: no gradient can leave this worker
  // from below these tensors, so the reach is empty without a walk.
  if (has_recvs) m.autograd_reach = reach_of(tensors);
}

void Recorder::after_encode(const rpc::Message& m, rpc::OutFrame& frame, int dest) {
  if (m.autograd_message == 0) return;
  auto ctx = contexts_->find(m.autograd_context);
  if (!ctx) return;
  torch::autograd::edge_list edges;
  edges.reserve(frame.grad_sources.size());
  for (const auto& t : frame.grad_sources) edges.push_back(torch::autograd::impl::gradient_edge(t));
  auto send = std::make_shared<SendBackward>(m.autograd_context, m.autograd_message, dest,
                                             std::move(edges));
  for (const auto& t : frame.grad_sources) send->add_input_metadata(t);
  std::lock_guard<std::mutex> lock(ctx->mu);
  if (!ctx->released) ctx->sends.emplace(m.autograd_message, std::move(send));
}

void Recorder::after_receive(rpc::Message& m, int from) {
  if (m.autograd_message == 0 || m.grad_tensors.empty()) return;
  if (id_worker(m.autograd_message) != from) {
    throw rpc::ProtocolError("autograd message " + std::to_string(m.autograd_message) +
                             " from rank " + std::to_string(from) + " names another sender");
  }
  const int world_size = m.autograd_reach.empty() ? 0 : world_size_();
  for (uint64_t r : m.autograd_reach) {
    if (id_worker(r) < 0 || id_worker(r) >= world_size) {
      throw rpc::ProtocolError("autograd reach names unknown rank " + std::to_string(id_worker(r)));
    }
  }
  // Released here: the tensors arrive without history, as new leaves.
  auto as_leaves = [&] {
    for (auto& t : m.grad_tensors) t.set_requires_grad(true);
  };
  auto ctx = contexts_->get_or_create(m.autograd_context);
  if (!ctx) return as_leaves();
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    if (ctx->released) return as_leaves();
    ++ctx->recvs;
  }
  auto recv = std::make_shared<RecvBackward>(m.autograd_context, m.autograd_message, from,
                                             std::move(m.autograd_reach));
  for (auto& t : m.grad_tensors) torch::autograd::set_history(t, recv);
}

}  // namespace tandem::autograd
