// One parameter's optimizer state as bytes (optim/param_state.h).
#include "tandem/optim/param_state.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <stdexcept>

#include "tandem/optim/owner/local_optimizer.h"

namespace tandem::optim {

Kind kind_of(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return Kind::kSGD;
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return Kind::kAdamW;
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return Kind::kAdam;
  if (dynamic_cast<const torch::optim::Adagrad*>(&o)) return Kind::kAdagrad;
  if (dynamic_cast<const torch::optim::RMSprop*>(&o)) return Kind::kRMSprop;
  throw std::invalid_argument(
      "optimizer state by parameter: only SGD, Adam, AdamW, Adagrad and RMSprop keep a state "
      "per parameter that can be saved apart");
}

std::string param_state_bytes(const torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  const torch::optim::OptimizerParamState* state = owner::find_state(optimizer, param);
  if (!state) return "";
  at::Tensor stand_in = at::zeros(param.sizes(), param.options().device(at::kCPU));
  auto alone = owner::make_optimizer(kind_of(optimizer), {stand_in}, Options{});
  // (the state shares its tensors, which are written into the bytes here)
  alone->state()[owner::state_key_of(stand_in)] = state->clone();
  return owner::state_bytes(*alone);
}

std::function<std::string()> param_state_snapshot(const torch::optim::Optimizer& optimizer,
                                                  const at::Tensor& param) {
  const torch::optim::OptimizerParamState* state = owner::find_state(optimizer, param);
  if (!state) return [] { return std::string(); };
  // (its values are never read: only its shape and dtype)
  at::Tensor stand_in = at::empty(param.sizes(), param.options().device(at::kCPU));
  std::shared_ptr<torch::optim::Optimizer> alone =
      owner::make_optimizer(kind_of(optimizer), {stand_in}, Options{});
  alone->state()[owner::state_key_of(stand_in)] = owner::deep_copy(*state);
  return [alone] { return owner::state_bytes(*alone); };
}

void load_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                      const std::string& bytes) {
  if (bytes.empty()) {
    optimizer.state().erase(owner::state_key_of(param));
    return;
  }
  at::Tensor stand_in = at::zeros(param.sizes(), param.options().device(at::kCPU));
  const Kind kind = kind_of(optimizer);
  auto alone = owner::make_optimizer(kind, {stand_in}, Options{});
  try {
    owner::load_state_bytes(*alone, bytes);
  } catch (const c10::Error& e) {
    throw std::invalid_argument("the saved state is not " + kind_name(kind) +
                                "'s for one parameter: " + e.what_without_backtrace());
  }
  const auto* state = owner::find_state(*alone, stand_in);
  if (state) {
    for (const at::Tensor& t : owner::state_tensors(*state)) {
      if (t.defined() && !t.sizes().equals(param.sizes())) {
        throw std::invalid_argument("the saved state is for a parameter of another shape");
      }
    }
  }
  owner::move_state(*alone, optimizer, stand_in, param);
}

}  // namespace tandem::optim
