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
#include <memory>
#include <string>
#include <vector>

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
// What load_param_state would refuse in `bytes` for a parameter of `shape`
// under an optimizer of `kind` (std::invalid_argument), loading nothing.
void check_param_state(Kind kind, at::IntArrayRef shape, const std::string& bytes);

// A flat slice of a parameter's state: elements [start, start + numel) of
// its flattened state tensors, as the bytes of a parameter of shape [numel]
// (what each FullyShardedDataParallel rank saves of the parameters its
// shard holds a piece of). "" when the optimizer keeps no state for it.
std::string param_state_slice_bytes(const torch::optim::Optimizer& optimizer,
                                    const at::Tensor& param, int64_t start, int64_t numel);
// The same, the slice copied now and made into bytes when called.
std::function<std::string()> param_state_slice_snapshot(const torch::optim::Optimizer& optimizer,
                                                        const at::Tensor& param, int64_t start,
                                                        int64_t numel);

// One piece of a state being joined: `bytes` hold a parameter's state (of
// any shape, `numel` elements; "" for none); its flattened elements [from,
// from + count) go to [to, to + count) of the joined parameter's.
struct StatePiece {
  // (shared: the pieces of one saved state, a block's rows, hold it once and
  // it is decoded once)
  std::shared_ptr<const std::string> bytes;
  int64_t numel = 0;
  int64_t from = 0, to = 0, count = 0;
  std::string what;  // the piece in errors (a checkpoint's entry); "": "piece K"
};
// The state of a parameter of `shape`, made of `pieces` of saved states of
// `kind` (elements no piece covers, and those of a piece without state, are
// zeros; the step counts are those of the first piece that has state: the
// others' are not compared): the bytes load_param_state takes. "" when no
// piece holds state. std::invalid_argument naming the piece that is of
// another kind or size, or whose tensors differ from the first's.
std::string join_param_states(Kind kind, at::IntArrayRef shape,
                              const std::vector<StatePiece>& pieces);

}  // namespace tandem::optim
