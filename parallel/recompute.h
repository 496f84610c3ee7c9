#pragma once
// Activation recomputation (PyTorch's torch.utils.checkpoint, which
// LibTorch's C++ lacks): a function's activations are dropped after its
// forward and made again in backward, trading compute for memory.
//
//   at::Tensor forward(const at::Tensor& x) {        // a model's
//     for (auto& block : blocks) {
//       x = tandem::nn::recompute([&](const at::Tensor& h) { return block(h); }, x,
//                                 block->parameters());
//     }
//     return x;
//   }
//
// 1. Forward runs `fn` without recording: only its input is kept, and the
//    output gets one node (RecomputeBackward) whose next edges are the
//    input's and the parameters'.
// 2. Backward runs `fn` again on the kept input, recording, with the random
//    generators (CPU, the current CUDA device's, and every one of
//    parallel::rng_tracker()'s) as they were at forward: the same dropout
//    masks. It then differentiates that forward with the
//    incoming gradient and hands the input's and every parameter's gradient
//    on through the node's edges, so the engine that runs the backward (the
//    local one, or Tandem's distributed one, whose contexts collect
//    parameter gradients) accumulates them where it accumulates any other.
//    The generator is put back as it was before the recomputation.
// 3. `params` are the leaves `fn` uses (a module's parameters()); a leaf it
//    uses and that is not listed gets no gradient. Collectives inside `fn`
//    (a tensor-parallel block) run again in backward, every rank in the same
//    order, as the forward's did.
// 4. Gradients are those of `fn` run plainly, exactly (the tests compare
//    them bit for bit).
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace tandem::parallel {
class RngTracker;  // parallel/random.h
}

namespace tandem::nn {

// `trackers`: the dropout generators' trackers fn draws from (2.; empty:
// the process's, parallel::rng_tracker()).
at::Tensor recompute(const std::function<at::Tensor(const at::Tensor&)>& fn,
                     const at::Tensor& input, const std::vector<at::Tensor>& params,
                     const std::vector<parallel::RngTracker*>& trackers = {});

}  // namespace tandem::nn
