#include "tandem/optim/owner/local_optimizer.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/version.h>

#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace tandem::optim::owner {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Kind kind, std::vector<at::Tensor> params,
                                                        Options o) {
  if (o.eps < 0) o.eps = kind == Kind::kAdagrad ? 1e-10 : 1e-8;
  if (o.weight_decay < 0) o.weight_decay = kind == Kind::kAdamW ? 1e-2 : 0;
  if (o.lr < 0) throw std::invalid_argument("optimizer options: negative learning rate");
  switch (kind) {
    case Kind::kSGD:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr)
                                                             .momentum(o.momentum)
                                                             .dampening(o.dampening)
                                                             .weight_decay(o.weight_decay)
                                                             .nesterov(o.nesterov));
    case Kind::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr)
                                                              .betas({o.beta1, o.beta2})
                                                              .eps(o.eps)
                                                              .weight_decay(o.weight_decay)
                                                              .amsgrad(o.amsgrad));
    case Kind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(o.lr)
                                                               .betas({o.beta1, o.beta2})
                                                               .eps(o.eps)
                                                               .weight_decay(o.weight_decay)
                                                               .amsgrad(o.amsgrad));
    case Kind::kAdagrad:
      return std::make_unique<torch::optim::Adagrad>(
          params, torch::optim::AdagradOptions(o.lr)
                      .lr_decay(o.lr_decay)
                      .weight_decay(o.weight_decay)
                      .initial_accumulator_value(o.initial_accumulator_value)
                      .eps(o.eps));
    case Kind::kRMSprop:
      return std::make_unique<torch::optim::RMSprop>(params, torch::optim::RMSpropOptions(o.lr)
                                                                 .alpha(o.alpha)
                                                                 .eps(o.eps)
                                                                 .weight_decay(o.weight_decay)
                                                                 .momentum(o.momentum)
                                                                 .centered(o.centered));
  }
  throw std::invalid_argument("unknown optimizer kind " + std::to_string(static_cast<int>(kind)));
}

void set_lr(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

namespace {

// torch::optim keys its state by the parameter's TensorImpl: as text in
// LibTorch 1.x, as the pointer itself from 2.0 on.
auto state_key(const at::Tensor& param) {
#if TORCH_VERSION_MAJOR < 2
  return c10::guts::to_string(param.unsafeGetTensorImpl());
#else
  return static_cast<void*>(param.unsafeGetTensorImpl());
#endif
}

}  // namespace

const torch::optim::OptimizerParamState* find_state(const torch::optim::Optimizer& optimizer,
                                                    const at::Tensor& param) {
  auto it = optimizer.state().find(state_key(param));
  return it == optimizer.state().end() ? nullptr : it->second.get();
}

void move_state(torch::optim::Optimizer& from, torch::optim::Optimizer& to,
                const at::Tensor& param) {
  auto key = state_key(param);
  auto it = from.state().find(key);
  if (it == from.state().end()) return;
  to.state()[key] = std::move(it->second);
  from.state().erase(it);
}

StateKey state_key_of(const at::Tensor& param) { return state_key(param); }

void move_state(torch::optim::Optimizer& from, torch::optim::Optimizer& to,
                const at::Tensor& from_param, const at::Tensor& to_param) {
  auto it = from.state().find(state_key(from_param));
  if (it == from.state().end()) return;
  to.state()[state_key(to_param)] = std::move(it->second);
  from.state().erase(it);
}

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  // Into a string of this function's own. Out of memory, an ostringstream
  // only sets its badbit, and LibTorch's zip writer then throws from its
  // destructor, which ends the process; here a failed allocation lets the
  // writer finish on nothing and is reported once it has.
  std::string out;
  bool failed = false;
  archive.save_to([&out, &failed](const void* data, size_t n) -> size_t {
    if (failed) return n;
    try {
      out.append(static_cast<const char*>(data), n);
    } catch (const std::bad_alloc&) {
      failed = true;
    }
    return n;
  });
  if (failed) {
    const size_t had = out.size();
    out = std::string();
    throw std::runtime_error("serializing state: can't allocate memory for its bytes (" +
                             std::to_string(had) + " written)");
  }
  return out;
}

std::string state_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  return archive_bytes(archive);
}

void load_state_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  optimizer.load(archive);
}

std::vector<at::Tensor> state_tensors(const torch::optim::OptimizerParamState& s) {
  using namespace torch::optim;
  if (auto* x = dynamic_cast<const SGDParamState*>(&s)) return {x->momentum_buffer()};
  if (auto* x = dynamic_cast<const AdamParamState*>(&s)) {
    return {x->exp_avg(), x->exp_avg_sq(), x->max_exp_avg_sq()};
  }
  if (auto* x = dynamic_cast<const AdamWParamState*>(&s)) {
    return {x->exp_avg(), x->exp_avg_sq(), x->max_exp_avg_sq()};
  }
  if (auto* x = dynamic_cast<const AdagradParamState*>(&s)) return {x->sum()};
  if (auto* x = dynamic_cast<const RMSpropParamState*>(&s)) {
    return {x->square_avg(), x->momentum_buffer(), x->grad_avg()};
  }
  return {};
}

void map_tensors(torch::optim::OptimizerParamState& s,
                 const std::function<at::Tensor(const at::Tensor&)>& fn) {
  using namespace torch::optim;
  auto f = [&](const at::Tensor& t) { return t.defined() ? fn(t) : t; };
  if (auto* x = dynamic_cast<SGDParamState*>(&s)) {
    x->momentum_buffer(f(x->momentum_buffer()));
  } else if (auto* x = dynamic_cast<AdamParamState*>(&s)) {
    x->exp_avg(f(x->exp_avg()));
    x->exp_avg_sq(f(x->exp_avg_sq()));
    x->max_exp_avg_sq(f(x->max_exp_avg_sq()));
  } else if (auto* x = dynamic_cast<AdamWParamState*>(&s)) {
    x->exp_avg(f(x->exp_avg()));
    x->exp_avg_sq(f(x->exp_avg_sq()));
    x->max_exp_avg_sq(f(x->max_exp_avg_sq()));
  } else if (auto* x = dynamic_cast<AdagradParamState*>(&s)) {
    x->sum(f(x->sum()));
  } else if (auto* x = dynamic_cast<RMSpropParamState*>(&s)) {
    x->square_avg(f(x->square_avg()));
    x->momentum_buffer(f(x->momentum_buffer()));
    x->grad_avg(f(x->grad_avg()));
  }
}

std::unique_ptr<torch::optim::OptimizerParamState> deep_copy(
    const torch::optim::OptimizerParamState& s) {
  std::unique_ptr<torch::optim::OptimizerParamState> out = s.clone();
  // (into host memory: a copy on the GPU would double the state there)
  map_tensors(*out, [](const at::Tensor& t) {
    return t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
  });
  return out;
}

}  // namespace tandem::optim::owner
