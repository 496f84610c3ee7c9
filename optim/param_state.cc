// One parameter's optimizer state as bytes (optim/param_state.h).
#include "tandem/optim/param_state.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/accumulate.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <map>
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

void check_param_state(Kind kind, at::IntArrayRef shape, const std::string& bytes) {
  if (bytes.empty()) return;
  at::Tensor stand_in = at::zeros(shape);
  auto scratch = owner::make_optimizer(kind, {stand_in}, Options{});
  load_param_state(*scratch, stand_in, bytes);
}

std::string param_state_slice_bytes(const torch::optim::Optimizer& optimizer,
                                    const at::Tensor& param, int64_t start, int64_t numel) {
  return param_state_slice_snapshot(optimizer, param, start, numel)();
}

std::function<std::string()> param_state_slice_snapshot(const torch::optim::Optimizer& optimizer,
                                                        const at::Tensor& param, int64_t start,
                                                        int64_t numel) {
  if (start < 0 || numel < 0 || start + numel > param.numel()) {
    throw std::invalid_argument("param_state_slice_bytes: elements [" + std::to_string(start) +
                                ", " + std::to_string(start + numel) + ") of a parameter of " +
                                std::to_string(param.numel()));
  }
  const torch::optim::OptimizerParamState* state = owner::find_state(optimizer, param);
  if (!state) return [] { return std::string(); };
  // (its values are never read: only its shape and dtype)
  at::Tensor stand_in = at::empty({numel}, param.options().device(at::kCPU));
  std::shared_ptr<torch::optim::Optimizer> alone =
      owner::make_optimizer(kind_of(optimizer), {stand_in}, Options{});
  std::unique_ptr<torch::optim::OptimizerParamState> slice = state->clone();
  owner::map_tensors(*slice, [&](const at::Tensor& t) {
    return t.reshape({-1}).narrow(0, start, numel).to(at::kCPU, false, /*copy=*/true);
  });
  alone->state()[owner::state_key_of(stand_in)] = std::move(slice);
  return [alone] { return owner::state_bytes(*alone); };
}

std::string join_param_states(Kind kind, at::IntArrayRef shape,
                              const std::vector<StatePiece>& pieces) {
  const int64_t total = c10::multiply_integers(shape);
  std::unique_ptr<torch::optim::OptimizerParamState> joined;
  std::vector<bool> defined;
  // Each saved state decoded once, however many pieces take from it.
  struct Decoded {
    std::unique_ptr<torch::optim::Optimizer> alone;
    const torch::optim::OptimizerParamState* state = nullptr;
  };
  std::map<const std::string*, Decoded> decoded;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const StatePiece& piece = pieces[k];
    const std::string which = (piece.what.empty() ? "piece " + std::to_string(k) + " of the state"
                                                  : "'" + piece.what + "'") +
                              ": ";
    if (piece.from < 0 || piece.to < 0 || piece.count < 0 ||
        piece.from + piece.count > piece.numel || piece.to + piece.count > total) {
      throw std::invalid_argument(which + "elements out of range");
    }
    if (!piece.bytes || piece.bytes->empty()) continue;
    auto found = decoded.find(piece.bytes.get());
    if (found == decoded.end()) {
      Decoded d;
      at::Tensor stand_in = at::zeros({piece.numel});
      d.alone = owner::make_optimizer(kind, {stand_in}, Options{});
      try {
        owner::load_state_bytes(*d.alone, *piece.bytes);
      } catch (const c10::Error& e) {
        throw std::invalid_argument(which + "not " + kind_name(kind) +
                                    "'s for one parameter: " + e.what_without_backtrace());
      }
      d.state = owner::find_state(*d.alone, stand_in);
      found = decoded.emplace(piece.bytes.get(), std::move(d)).first;
    }
    const torch::optim::OptimizerParamState* state = found->second.state;
    if (!state) continue;
    const std::vector<at::Tensor> tensors = owner::state_tensors(*state);
    for (const at::Tensor& t : tensors) {
      if (t.defined() && t.numel() != piece.numel) {
        throw std::invalid_argument(which + "a state of " + std::to_string(t.numel()) +
                                    " elements, not " + std::to_string(piece.numel));
      }
    }
    if (!joined) {
      joined = state->clone();
      owner::map_tensors(*joined, [&](const at::Tensor& t) {
        return at::zeros({total}, t.options().device(at::kCPU));
      });
      for (const at::Tensor& t : tensors) defined.push_back(t.defined());
    }
    const std::vector<at::Tensor> into = owner::state_tensors(*joined);
    for (size_t j = 0; j < tensors.size(); ++j) {
      if (tensors[j].defined() != defined[j]) {
        throw std::invalid_argument(which + "its state holds other tensors than the first's");
      }
      if (!defined[j] || piece.count == 0) continue;
      into[j]
          .narrow(0, piece.to, piece.count)
          .copy_(tensors[j].reshape({-1}).narrow(0, piece.from, piece.count));
    }
  }
  if (!joined) return "";
  owner::map_tensors(*joined, [&](const at::Tensor& t) { return t.view(shape); });
  at::Tensor stand_in = at::zeros(shape);
  auto alone = owner::make_optimizer(kind, {stand_in}, Options{});
  alone->state()[owner::state_key_of(stand_in)] = std::move(joined);
  return owner::state_bytes(*alone);
}

}  // namespace tandem::optim
