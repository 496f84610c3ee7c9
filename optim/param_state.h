// One parameter's optimizer state on its own, as bytes: what a checkpoint
// saves by the parameter's name, so that it loads into whichever optimizer
// steps that parameter later (another rank's share, another world size,
// ZeroRedundancyOptimizer or a plain LibTorch optimizer).
//
//   std::string b = optim::param_state_bytes(adam, weight);    // "" before the first step
//   optim::load_param_state(other_adam, its_weight, b);         // the same state there
//
// The bytes are a LibTorch archive of an optimizer of the same kind over a
// stand-in of the parameter's shape holding that state alone (Adam's moments
// and step count, SGD's momentum, ...), copied when the bytes are made.
// load_param_state refuses (std::invalid_argument, naming what is wrong)
// bytes of another kind or shape; "" clears the parameter's state.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <string>

#include "tandem/optim/options.h"

namespace tandem::optim {

// The kind of a LibTorch optimizer (std::invalid_argument for LBFGS or one
// of your own).
Kind kind_of(const torch::optim::Optimizer& optimizer);

std::string param_state_bytes(const torch::optim::Optimizer& optimizer, const at::Tensor& param);
// The same bytes later: the state is copied now (a memory copy), and made
// into bytes when the function is called (on a saver's thread, say).
std::function<std::string()> param_state_snapshot(const torch::optim::Optimizer& optimizer,
                                                  const at::Tensor& param);
void load_param_state(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                      const std::string& bytes);

}  // namespace tandem::optim
