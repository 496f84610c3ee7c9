// The graph walks (autograd/engine/walk.h).
#include "tandem/autograd/engine/walk.h"

namespace tandem::autograd {

using torch::autograd::Edge;
using torch::autograd::Node;

void expand(GraphTask::NodeMap& nodes, const std::shared_ptr<Node>& entry,
            std::vector<RecvBackward*>* recvs) {
  auto [first, fresh] = nodes.try_emplace(entry.get());
  if (!fresh) return;
  first->second.fn = entry;
  std::vector<Node*> stack{entry.get()};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (auto* recv = dynamic_cast<RecvBackward*>(n)) {
      if (recvs) recvs->push_back(recv);
      continue;
    }
    for (const Edge& e : n->next_edges()) {
      if (!e.is_valid()) continue;
      auto [it, added] = nodes.try_emplace(e.function.get());
      ++it->second.deps;
      if (added) {
        it->second.fn = e.function;
        stack.push_back(e.function.get());
      }
    }
  }
}

void expand_sends(GraphTask::NodeMap& nodes,
                  const std::vector<std::shared_ptr<SendBackward>>& sends) {
  for (const auto& send : sends) {
    if (nodes.count(send.get())) continue;  // named twice
    expand(nodes, send, nullptr);
    ++nodes[send.get()].deps;
  }
}

}  // namespace tandem::autograd
