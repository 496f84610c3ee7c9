#include "tandem/pipeline/step/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace tandem::pipeline::step {

namespace ag = torch::autograd;

namespace {

class Capture final : public ag::FunctionPreHook {
 public:
  explicit Capture(std::shared_ptr<ag::variable_list> into) : into_(std::move(into)) {}
  ag::variable_list operator()(const ag::variable_list& grads) override {
    *into_ = grads;
    return grads;
  }

 private:
  std::shared_ptr<ag::variable_list> into_;
};

}  // namespace

struct WeightWork {
  struct Root {
    std::shared_ptr<ag::Node> node;
    std::vector<size_t> toward_input;  // its edges to cut before the W pass
    std::shared_ptr<ag::variable_list> grads = std::make_shared<ag::variable_list>();
  };
  bool reaches_input = false;  // false: the W pass is the whole parameter backward
  std::vector<Root> roots;
  // The input's path's other nodes: the W pass runs none of them, so their
  // saved tensors go once the I pass is done.
  std::vector<std::shared_ptr<ag::Node>> path_only;
};

namespace {

// The W pass's roots for `output`'s graph back to leaf `input`, with their
// capture hooks in place (run the I pass next).
std::shared_ptr<WeightWork> plan_weight_pass(const at::Tensor& output, const at::Tensor& input,
                                             const std::vector<at::Tensor>& params) {
  auto work = std::make_shared<WeightWork>();
  ag::Node* target = ag::impl::gradient_edge(input).function.get();
  std::unordered_map<ag::Node*, bool> to_input, to_params;
  std::unordered_set<ag::Node*> param_nodes;
  for (const auto& p : params) param_nodes.insert(ag::impl::gradient_edge(p).function.get());
  // Depth-first with memo, without recursion (graphs can be deep).
  auto reaches = [](ag::Node* start, std::unordered_map<ag::Node*, bool>& memo, const auto& goal) {
    std::vector<std::pair<ag::Node*, size_t>> path{{start, 0}};
    if (memo.count(start)) return memo[start];
    memo[start] = goal(start);
    while (!path.empty()) {
      auto& [n, next] = path.back();
      if (next < n->next_edges().size()) {
        ag::Node* child = n->next_edges()[next++].function.get();
        if (!child) continue;
        auto it = memo.find(child);
        if (it == memo.end()) {
          memo[child] = goal(child);
          path.emplace_back(child, 0);
        } else if (it->second) {
          memo[n] = true;
        }
      } else {
        const bool r = memo[n];
        path.pop_back();
        if (r && !path.empty()) memo[path.back().first] = true;
      }
    }
    return memo[start];
  };
  auto is_target = [&](ag::Node* n) { return n == target; };
  auto is_a_param = [&](ag::Node* n) { return param_nodes.count(n) > 0; };
  ag::Node* root = output.grad_fn().get();
  if (!root || !target || !reaches(root, to_input, is_target)) return work;
  work->reaches_input = true;
  // Every node on the input's path (to_input true, reached from root).
  std::vector<std::shared_ptr<ag::Node>> stack{output.grad_fn()};
  std::unordered_set<ag::Node*> seen{root};
  while (!stack.empty()) {
    std::shared_ptr<ag::Node> n = std::move(stack.back());
    stack.pop_back();
    WeightWork::Root r;
    bool side = false;
    const auto& edges = n->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      ag::Node* child = edges[i].function.get();
      if (!child) continue;
      if (reaches(child, to_input, is_target)) {
        r.toward_input.push_back(i);
        if (child != target && seen.insert(child).second) stack.push_back(edges[i].function);
      } else if (reaches(child, to_params, is_a_param)) {
        side = true;
      }
    }
    if (side) {
      r.node = n;
      r.node->add_pre_hook(std::make_unique<Capture>(r.grads));
      work->roots.push_back(std::move(r));
    } else {
      work->path_only.push_back(std::move(n));
    }
  }
  return work;
}

}  // namespace

at::Tensor input_pass(const at::Tensor& output, const at::Tensor& input, const at::Tensor& grad,
                      const std::vector<at::Tensor>& params, std::shared_ptr<WeightWork>& work) {
  work = plan_weight_pass(output, input, params);
  if (!work->reaches_input) {
    work = nullptr;
    return at::Tensor();
  }
  // Only the input's gradient; the graph stays for the W pass where it has one.
  const bool keep = !work->roots.empty();
  auto got = ag::Engine::get_default_engine().execute(
      {ag::impl::gradient_edge(output)}, {grad}, keep, /*create_graph=*/false,
      /*accumulate_grad=*/false, {ag::impl::gradient_edge(input)});
  for (auto& node : work->path_only) node->release_variables();
  work->path_only.clear();
  return got.at(0);
}

std::vector<at::Tensor> weight_pass(WeightWork& work, const std::vector<at::Tensor>& params) {
  ag::edge_list roots;
  ag::variable_list grads;
  for (auto& r : work.roots) {
    for (size_t e : r.toward_input) r.node->next_edges()[e] = ag::Edge();
    // What the I pass captured went through the node's hooks (a tensor
    // hook on an activation, say): they must not run twice.
    r.node->pre_hooks().clear();
#if TORCH_VERSION_MAJOR >= 2
    r.node->tensor_pre_hooks().clear();
    r.node->retains_grad_hooks().clear();
#endif
    for (size_t k = 0; k < r.grads->size(); ++k) {
      if (!(*r.grads)[k].defined()) continue;
      roots.emplace_back(r.node, static_cast<uint32_t>(k));
      grads.push_back((*r.grads)[k]);
    }
  }
  ag::edge_list outs;
  for (const auto& p : params) outs.push_back(ag::impl::gradient_edge(p));
  if (roots.empty() || outs.empty()) return {};
  return ag::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                  /*create_graph=*/false,
                                                  /*accumulate_grad=*/false, outs);
}

}  // namespace tandem::pipeline::step
