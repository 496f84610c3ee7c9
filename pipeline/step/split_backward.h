#pragma once
// Zero-bubble's backward split in two passes over a stage's graph: I, the
// input's gradient alone (the previous stage waits for it), and W, later,
// the parameters' gradients (nobody waits for it). What it promises:
// together they compute exactly what one backward would, each gradient
// contribution once, and I leaves W only what W needs. The passes
// (passes.cc) call input_pass() for I and keep the WeightWork it gives
// until their W pass calls weight_pass(); they know nothing of the graph.
//
// How: the I pass runs the engine from the stage's output to its input
// only, so nodes compute no parameter gradients. On the way it records what
// reached each node that lies between output and input and also leads to
// parameters (a Linear's AddmmBackward, say): those nodes are where the
// parameters' gradients leave the input's path. The W pass then cuts those
// nodes' edges toward the input and runs the engine from them, with what
// they got in the I pass, to the parameters: each gradient path to a
// parameter leaves the input's path exactly once, so nothing is computed
// twice and every contribution is counted once.
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace tandem::pipeline::step {

// What the W pass of one micro-batch through one stage needs from its I pass.
struct WeightWork;

// The I pass: from `grad`, the gradient of `output`, the gradient of
// `input` (a leaf that requires grad), and in `work` what the W pass needs.
// When `input` is not on `output`'s graph nothing runs: the gradient
// returned is undefined, `work` null, and the W pass is the whole parameter
// backward from `output` (the caller's).
at::Tensor input_pass(const at::Tensor& output, const at::Tensor& input, const at::Tensor& grad,
                      const std::vector<at::Tensor>& params, std::shared_ptr<WeightWork>& work);

// The W pass after input_pass: each of `params`' gradient (undefined where
// it got none), or an empty list when there was nothing to run.
std::vector<at::Tensor> weight_pass(WeightWork& work, const std::vector<at::Tensor>& params);

}  // namespace tandem::pipeline::step
