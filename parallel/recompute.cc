// Activation recomputation (parallel/recompute.h).
#include "tandem/parallel/recompute.h"
#include "tandem/parallel/random.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>
#include <mutex>
#include <optional>
#include <vector>
#include <utility>

namespace tandem::nn {

namespace {

using torch::autograd::variable_list;

// The generators a forward may draw from, as they were (2.).
struct RandomState {
  at::Tensor cpu;
  std::optional<std::pair<int, at::Tensor>> cuda;  // the current device's
  // The trackers' generators (parallel/random.h)
  std::vector<std::pair<parallel::RngTracker*, std::map<std::string, at::Tensor>>> tracked;

  static RandomState now(const std::vector<parallel::RngTracker*>& trackers) {
    RandomState s;
    for (parallel::RngTracker* t : trackers) s.tracked.emplace_back(t, t->states());
    {
      at::Generator g = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(g.mutex());
      s.cpu = g.get_state();
    }
    if (at::hasCUDA()) {
      const int device = static_cast<int>(at::detail::getCUDAHooks().current_device());
      if (device >= 0) {
        at::Generator g = at::detail::getCUDAHooks().getDefaultCUDAGenerator(
            static_cast<c10::DeviceIndex>(device));
        std::lock_guard<std::mutex> lock(g.mutex());
        s.cuda = std::make_pair(device, g.get_state());
      }
    }
    return s;
  }
  void restore() const {
    for (const auto& [t, states] : tracked) t->set_states(states);
    {
      at::Generator g = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(cpu);
    }
    if (cuda) {
      at::Generator g = at::detail::getCUDAHooks().getDefaultCUDAGenerator(
          static_cast<c10::DeviceIndex>(cuda->first));
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(cuda->second);
    }
  }
};

class RecomputeBackward final : public torch::autograd::Node {
 public:
  RecomputeBackward(std::function<at::Tensor(const at::Tensor&)> fn, at::Tensor input,
                    bool input_wants_grad, std::vector<at::Tensor> params, RandomState random,
                    std::vector<int64_t> out_sizes, at::TensorOptions out_options,
                    torch::autograd::edge_list&& next)
      : Node(std::move(next)),
        fn_(std::move(fn)),
        input_(std::move(input)),
        input_wants_grad_(input_wants_grad),
        params_(std::move(params)),
        random_(std::move(random)),
        out_sizes_(std::move(out_sizes)),
        out_options_(out_options) {}

  variable_list apply(variable_list&& grads) override {
    at::Tensor g = grads.empty() ? at::Tensor() : grads[0];
    if (!g.defined()) g = at::zeros(out_sizes_, out_options_);
    // The forward again, recording, with the generators as they were.
    std::vector<parallel::RngTracker*> trackers;
    for (const auto& [t, states] : random_.tracked) trackers.push_back(t);
    const RandomState before = RandomState::now(trackers);
    random_.restore();
    at::Tensor x = input_.detach().requires_grad_(input_wants_grad_);
    at::Tensor out;
    try {
      at::AutoGradMode enable(true);
      out = fn_(x);
    } catch (...) {
      before.restore();
      throw;
    }
    before.restore();
    variable_list wrt;
    if (input_wants_grad_) wrt.push_back(x);
    for (const auto& p : params_) {
      if (p.requires_grad()) wrt.push_back(p);
    }
    variable_list got;
    if (!wrt.empty() && out.requires_grad()) {
      got = torch::autograd::grad({out}, wrt, {g}, /*retain_graph=*/false,
                                  /*create_graph=*/false, /*allow_unused=*/true);
    } else {
      got.assign(wrt.size(), at::Tensor());
    }
    // In the order of the node's edges: the input's, then each parameter's.
    variable_list result;
    size_t at = 0;
    result.push_back(input_wants_grad_ ? got[at++] : at::Tensor());
    for (const auto& p : params_) result.push_back(p.requires_grad() ? got[at++] : at::Tensor());
    release_variables();
    return result;
  }
  std::string name() const override { return "tandem::nn::RecomputeBackward"; }
  void release_variables() override {
    input_ = at::Tensor();
    fn_ = nullptr;
  }

 private:
  std::function<at::Tensor(const at::Tensor&)> fn_;
  at::Tensor input_;
  bool input_wants_grad_;
  std::vector<at::Tensor> params_;
  RandomState random_;
  std::vector<int64_t> out_sizes_;
  at::TensorOptions out_options_;
};

}  // namespace

at::Tensor recompute(const std::function<at::Tensor(const at::Tensor&)>& fn,
                     const at::Tensor& input, const std::vector<at::Tensor>& params,
                     const std::vector<parallel::RngTracker*>& trackers) {
  if (!fn) throw std::invalid_argument("recompute: no function");
  if (!input.defined()) throw std::invalid_argument("recompute: the input is undefined");
  bool wants = at::GradMode::is_enabled() && input.requires_grad();
  for (const auto& p : params) wants = wants || (at::GradMode::is_enabled() && p.requires_grad());
  if (!wants) return fn(input);  // nothing to differentiate: a plain call
  RandomState random = RandomState::now(
      trackers.empty() ? std::vector<parallel::RngTracker*>{&parallel::rng_tracker()} : trackers);
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = fn(input.detach());
  }
  torch::autograd::edge_list next;
  next.push_back(input.requires_grad() ? torch::autograd::impl::gradient_edge(input)
                                       : torch::autograd::Edge());
  for (const auto& p : params) {
    next.push_back(p.requires_grad() ? torch::autograd::impl::gradient_edge(p)
                                     : torch::autograd::Edge());
  }
  auto node = std::make_shared<RecomputeBackward>(fn, input.detach(), input.requires_grad(), params,
                                                  std::move(random), out.sizes().vec(),
                                                  out.options(), std::move(next));
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace tandem::nn
