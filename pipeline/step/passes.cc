#include "tandem/pipeline/step/passes.h"

#include <ATen/ops/full.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "tandem/autograd/autograd.h"
#include "tandem/pipeline/step/losses.h"
#include "tandem/remote_module/served.h"

namespace tandem::pipeline::step {

namespace {

// Adds one pass's parameter gradients to the stage's sums.
void add_to_sums(StepState& st, int64_t stage, const std::vector<at::Tensor>& grads) {
  auto& sum = st.sums[stage];
  const auto& params = st.params[stage];
  sum.resize(params.size());
  for (size_t p = 0; p < params.size(); ++p) {
    if (!grads[p].defined()) continue;
    // autograd's results are fresh tensors of ours: add in place.
    if (sum[p].defined()) {
      sum[p].add_(grads[p]);
    } else {
      sum[p] = grads[p];
    }
  }
}

// The stash a backward (B or I) starts from.
std::map<std::pair<int64_t, int64_t>, Stash>::iterator stashed(StepState& st, const Action& pass) {
  auto it = st.stash.find({pass.stage, pass.chunk});
  if (it == st.stash.end()) throw std::logic_error("no forward ran before this backward");
  if (it->second.input_done) throw std::logic_error("this backward's input gradient ran already");
  return it;
}

// The gradient of the stage's output: from the next stage, or the loss's own.
at::Tensor output_gradient(const StepState& st, const Action& pass, const Stash& s, PassIo& io) {
  if (pass.stage == st.last) return at::ones_like(s.output);
  return io.take(kGradient).to(s.output.device());
}

// The previous stage waits for an answer even when its output got no
// gradient (not floating point, or not used): zeros.
void send_input_gradient(const Action& pass, const Stash& s, const at::Tensor& gradient,
                         PassIo& io) {
  if (pass.stage == 0) return;
  io.send(kGradient, pass.stage - 1, gradient.defined() ? gradient : at::zeros_like(s.input));
}

}  // namespace

StepState::StepState(const RunRequest& r, const std::string& worker)
    : request(r), last(r.header.stages - 1) {
  for (size_t i = 0; i < r.stage_ids.size(); ++i) {
    auto s = nn::served_of(r.modules[i].local_value());
    if (!s) {
      throw std::invalid_argument("pipeline stage " + std::to_string(r.stage_ids[i]) +
                                  " is not a RemoteModule's module");
    }
    served[r.stage_ids[i]] = s;
    for (auto& [_, p] : s->parameters()) {
      if (p.requires_grad()) params[r.stage_ids[i]].push_back(p);
    }
  }
  const bool has_last = served.count(last) > 0;
  if (has_last && r.header.train) loss = loss_named(r.loss, worker);
  outputs.resize(has_last && !r.header.train ? r.header.chunks : 0);
  losses = at::full({r.header.chunks}, std::numeric_limits<double>::quiet_NaN(), at::kDouble);
}

void forward_pass(StepState& st, const Action& pass, PassIo& io) {
  const RunRequest& r = st.request;
  const int64_t stage = pass.stage, chunk = pass.chunk;
  at::Tensor x = stage == 0 ? r.inputs.at(chunk) : io.take(kActivation);
  io.running();  // waiting for its input was bubble
  const nn::Served& served = *st.served.at(stage);
  x = x.detach().to(served.device);  // tensors arrive on the CPU; the stage may be on a GPU
  if (r.header.train && stage > 0 && x.is_floating_point()) x.requires_grad_(true);
  std::vector<c10::IValue> args{x};
  c10::IValue out = served.forward(args);
  if (!out.isTensor()) {
    throw std::invalid_argument("the stage's forward gave a " + out.tagKind() + ", not one tensor");
  }
  at::Tensor y = out.toTensor();
  if (!r.header.train) {
    if (stage == st.last) {
      st.outputs.at(chunk) = y;
    } else {
      io.send(kActivation, stage + 1, y);
    }
  } else if (stage == st.last) {
    at::Tensor l = st.loss(y, r.targets.at(chunk).to(y.device()));
    st.losses.data_ptr<double>()[chunk] = l.detach().item<double>();
    Stash& held = st.stash[{stage, chunk}];
    held.input = x;
    held.output = l * r.weights.at(chunk);
  } else {
    Stash& held = st.stash[{stage, chunk}];
    held.input = x;
    held.output = y;
    io.send(kActivation, stage + 1, y.detach());
  }
  st.peak = std::max(st.peak, static_cast<int64_t>(st.stash.size()));
}

void backward_pass(StepState& st, const Action& pass, PassIo& io) {
  auto it = stashed(st, pass);
  Stash s = std::move(it->second);
  st.stash.erase(it);
  at::Tensor g = output_gradient(st, pass, s, io);
  io.running();
  const bool input_grad = pass.stage > 0 && s.input.requires_grad();
  at::Tensor input_gradient;
  std::vector<at::Tensor> wrt = st.params[pass.stage];
  if (input_grad) wrt.push_back(s.input);
  if (!wrt.empty() && s.output.requires_grad()) {
    auto grads = torch::autograd::grad({s.output}, wrt, {g}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    if (input_grad) {
      input_gradient = grads.back();
      grads.pop_back();
    }
    add_to_sums(st, pass.stage, grads);
  }
  send_input_gradient(pass, s, input_gradient, io);
}

void input_grad_pass(StepState& st, const Action& pass, PassIo& io) {
  Stash& s = stashed(st, pass)->second;  // stays for the W pass
  at::Tensor g = output_gradient(st, pass, s, io);
  io.running();
  const bool input_grad = pass.stage > 0 && s.input.requires_grad();
  at::Tensor input_gradient;
  s.input_done = true;
  s.grad = g;
  if (input_grad && s.output.is_same(s.input)) {
    input_gradient = g;  // the stage gave back its input
  } else if (input_grad && s.output.requires_grad()) {
    input_gradient = input_pass(s.output, s.input, g, st.params[pass.stage], s.work);
    if (s.work) s.grad = at::Tensor();  // the W pass starts from what the I pass captured
  }
  send_input_gradient(pass, s, input_gradient, io);
}

void weight_grad_pass(StepState& st, const Action& pass, PassIo& io) {
  auto it = st.stash.find({pass.stage, pass.chunk});
  if (it == st.stash.end() || !it->second.input_done) {
    throw std::logic_error("no input-gradient pass ran before this weight-gradient pass");
  }
  Stash s = std::move(it->second);
  st.stash.erase(it);
  io.running();
  const std::vector<at::Tensor>& params = st.params[pass.stage];
  if (s.work) {
    auto grads = weight_pass(*s.work, params);
    if (!grads.empty()) add_to_sums(st, pass.stage, grads);
  } else if (!params.empty() && s.output.requires_grad() && s.output.grad_fn()) {
    add_to_sums(st, pass.stage,
                torch::autograd::grad({s.output}, params, {s.grad}, /*retain_graph=*/false,
                                      /*create_graph=*/false, /*allow_unused=*/true));
  }
}

void run_pass(StepState& state, const Action& pass, PassIo& io) {
  switch (pass.kind) {
    case Action::kForward:
      return forward_pass(state, pass, io);
    case Action::kBackward:
      return backward_pass(state, pass, io);
    case Action::kInputGrad:
      return input_grad_pass(state, pass, io);
    case Action::kWeightGrad:
      return weight_grad_pass(state, pass, io);
  }
  throw std::logic_error("unknown pass kind " + std::to_string(static_cast<int>(pass.kind)));
}

void hand_over_gradients(StepState& st, rpc::Agent& agent, uint64_t context) {
  for (auto& [stage, sum] : st.sums) {
    for (size_t p = 0; p < sum.size(); ++p) {
      if (sum[p].defined()) {
        autograd::accumulate_gradient(agent, context, st.params[stage][p], sum[p]);
      }
    }
  }
}

}  // namespace tandem::pipeline::step
