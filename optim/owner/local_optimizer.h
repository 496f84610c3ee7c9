// The LibTorch optimizer an owner steps its parameters with.
//
// What it promises: make_optimizer builds the torch::optim optimizer of a
// Kind from Options exactly as the same LibTorch class would be built by
// hand (the kind's defaults filled in for a negative eps or weight_decay),
// and refuses options LibTorch refuses; state_tensors and find_state read
// back what LibTorch keeps per parameter, on LibTorch 1.x and 2.x alike.
// Its neighbour: the owners' service (optim/owner/service.h) makes, steps,
// saves and loads these; nothing here knows about RPC.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/output-archive.h>

#include <torch/version.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/optim/options.h"

namespace tandem::optim::owner {

// std::invalid_argument for a negative learning rate; LibTorch's own
// checks (c10::Error) for the rest.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(Kind kind, std::vector<at::Tensor> params,
                                                        Options options);

// Sets the learning rate of all of its param groups.
void set_lr(torch::optim::Optimizer& optimizer, double lr);

// The key LibTorch's optimizers keep `param`'s state under.
#if TORCH_VERSION_MAJOR < 2
using StateKey = std::string;
#else
using StateKey = void*;
#endif
StateKey state_key_of(const at::Tensor& param);

// The state LibTorch keeps for parameter `param`, or null when it keeps
// none (SGD before its first step).
const torch::optim::OptimizerParamState* find_state(const torch::optim::Optimizer& optimizer,
                                                    const at::Tensor& param);

// Moves the state `from` keeps for `param` into `to` (both optimizers over
// that very tensor), replacing what `to` had; nothing when `from` has none.
void move_state(torch::optim::Optimizer& from, torch::optim::Optimizer& to,
                const at::Tensor& param);

// The same between two tensors: what `from` keeps for `from_param` becomes
// what `to` keeps for `to_param` (a checkpoint resharded, optim/reshard.h).
void move_state(torch::optim::Optimizer& from, torch::optim::Optimizer& to,
                const at::Tensor& from_param, const at::Tensor& to_param);

// An archive's bytes, and an optimizer's state (its save()) as such bytes.
std::string archive_bytes(torch::serialize::OutputArchive& archive);
std::string state_bytes(const torch::optim::Optimizer& optimizer);
// Loads state_bytes() into `optimizer` (its load(), matching parameters by
// position); c10::Error for bytes that are not such an archive.
void load_state_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes);

// The tensors of one parameter's state (some may be undefined).
std::vector<at::Tensor> state_tensors(const torch::optim::OptimizerParamState& state);
// Replaces each defined tensor t of one parameter's state by fn(t) (in
// state_tensors' order).
void map_tensors(torch::optim::OptimizerParamState& state,
                 const std::function<at::Tensor(const at::Tensor&)>& fn);
// A copy of one parameter's state whose tensors are copies too, in host
// memory (LibTorch's clone() shares them): what stays as it is while the
// optimizer steps on.
std::unique_ptr<torch::optim::OptimizerParamState> deep_copy(
    const torch::optim::OptimizerParamState& state);

}  // namespace tandem::optim::owner
