// What the optimizer suites share: the split model's per-worker layers and
// their functions, the five kinds with the options every suite trains them
// with, and the LibTorch optimizer each must equal.
#pragma once

#include <ATen/ops/mm.h>
#include <ATen/ops/tanh.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <vector>

#include "tandem/optim/distributed_optimizer.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rref.h"

namespace tandem::test::optim_support {

inline const auto kF64 = at::TensorOptions().dtype(at::kDouble);

// Each worker's layer of the split model: worker r holds W[r].
struct Layers {
  std::vector<at::Tensor> w;
};
inline Layers& L() {
  static Layers l;
  return l;
}

inline void define(rpc::Registry& r) {
  r.def("param", [](int64_t i) {
    return rpc::RRef<at::Tensor>::make_local(*rpc::current_agent(), L().w.at(i));
  });
  r.def("layer", [](int64_t i, at::Tensor x) { return at::tanh(at::mm(x, L().w.at(i))); });
  r.def("linear", [](int64_t i, at::Tensor x) { return at::mm(x, L().w.at(i)); });
}

struct Case {
  optim::Kind kind;
  optim::Options o;
};

// Each kind with the options that exercise it (momentum and nesterov,
// amsgrad, decoupled weight decay, centered RMSprop).
inline std::vector<Case> every_kind() {
  std::vector<Case> cases;
  optim::Options sgd;
  sgd.lr = 0.1;
  sgd.momentum = 0.9;
  sgd.nesterov = true;
  sgd.weight_decay = 0.01;
  cases.push_back({optim::Kind::kSGD, sgd});
  optim::Options adam;
  adam.lr = 0.05;
  adam.amsgrad = true;
  cases.push_back({optim::Kind::kAdam, adam});
  optim::Options adamw;
  adamw.lr = 0.05;
  adamw.weight_decay = 0.1;
  cases.push_back({optim::Kind::kAdamW, adamw});
  optim::Options adagrad;
  adagrad.lr = 0.1;
  cases.push_back({optim::Kind::kAdagrad, adagrad});
  optim::Options rms;
  rms.lr = 0.01;
  rms.momentum = 0.5;
  rms.centered = true;
  cases.push_back({optim::Kind::kRMSprop, rms});
  return cases;
}

// The LibTorch optimizer a DistributedOptimizer of `kind` with `o` must equal.
inline std::unique_ptr<torch::optim::Optimizer> local_optimizer(optim::Kind kind,
                                                                std::vector<at::Tensor> p,
                                                                optim::Options o) {
  if (o.weight_decay < 0) o.weight_decay = kind == optim::Kind::kAdamW ? 1e-2 : 0;
  switch (kind) {
    case optim::Kind::kSGD:
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(o.lr)
                                                        .momentum(o.momentum)
                                                        .dampening(o.dampening)
                                                        .weight_decay(o.weight_decay)
                                                        .nesterov(o.nesterov));
    case optim::Kind::kAdam:
      return std::make_unique<torch::optim::Adam>(
          p, torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay).amsgrad(o.amsgrad));
    case optim::Kind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          p, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay).amsgrad(o.amsgrad));
    case optim::Kind::kAdagrad:
      return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(o.lr));
    case optim::Kind::kRMSprop:
      return std::make_unique<torch::optim::RMSprop>(
          p, torch::optim::RMSpropOptions(o.lr).momentum(o.momentum).centered(o.centered));
  }
  return nullptr;
}

}  // namespace tandem::test::optim_support
