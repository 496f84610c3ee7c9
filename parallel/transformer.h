#pragma once
// A transformer block split over a tensor-parallel group, as Megatron-LM
// splits it: the attention's heads and the MLP's hidden features shared
// out, the LayerNorms replicated (or, with sequence parallelism, run on
// each rank's piece of the sequence).
//
//   // One process's block: pre-LayerNorm causal self-attention with a fused
//   // [q; k; v] projection, then a pre-LayerNorm GELU MLP, each added back.
//   parallel::ParallelBlock block(ln1, qkv, proj, ln2, fc, out, heads, tp);
//   at::Tensor y = block(x);     // = the whole block's forward, on every rank
//
// 1. Made from the whole block's modules (one process's, which may then be
//    dropped): qkv is column-parallel with a stride of 3 (each rank its
//    heads' rows of q, of k and of v), proj row-parallel; fc
//    column-parallel, out row-parallel; the LayerNorms copied whole. The
//    children keep the whole block's names (ln1, qkv, proj, ln2, fc, out),
//    so a state dict names what the whole block's does.
// 2. heads must divide by the group's size, and the width by heads;
//    4 x width's MLP then divides too. Else std::invalid_argument naming it.
// 3. Without sequence parallelism the input and output are whole, the same
//    on every rank. With it, each rank's input and output are its piece of
//    the sequence (sequence_dim): the LayerNorms and the residual sums run
//    on the piece, all-gathered before qkv and fc and reduce-scattered
//    after proj and out; the LayerNorms' and the row-parallel biases'
//    gradients are then partial (partial_grad_parameters(); sum them with
//    all_reduce_partial_grads after backward), or, with sum_partial_grads,
//    summed inside backward (each used through copy_to_region), so that
//    any engine's gradient is whole: a pipeline stage's in a distributed
//    autograd context too. That is an all-reduce of a LayerNorm's or
//    bias's gradient per parameter per backward, every rank in the same
//    order.
// 4. Four collectives forward (two all-reduces, or two all-gathers and two
//    reduce-scatters) and four backward, every rank in the same order.
// 5. Dropout (BlockOptions; parallel/random.h): in training mode, the
//    attention probabilities' mask and each residual branch's, drawn in
//    that order. With masks_like_one_process (the default) every rank
//    draws each whole mask from the same generator and keeps its piece, so
//    a block split over any group, with or without sequence parallelism,
//    computes what the same block on a group of one does.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/parallel/linear.h"
#include "tandem/parallel/random.h"

namespace tandem::parallel {

struct BlockOptions {
  bool sequence_parallel = false;  // 3.
  int64_t sequence_dim = 1;        // the sequence's dimension of [batch, sequence, width]
  bool sum_partial_grads = false;  // 3.: the replicated parameters' gradients summed in backward
  // 5. Dropout, in training mode: on the attention probabilities (this
  // rank's heads: a split region) and on each projection's output before
  // its residual sum (a replicated region, or with sequence parallelism
  // this rank's piece of the sequence), drawn from rng_tracker().get(rng).
  double attention_dropout = 0, residual_dropout = 0;
  std::string rng = "block";
  RngTracker* tracker = nullptr;  // whose generators (null: rng_tracker(), the process's)
  // Each split region's mask its piece of the whole one (a block on one
  // process draws the same: every split trains alike); false: Megatron's,
  // each rank drawing its piece alone from "<rng>/tp<rank>".
  bool masks_like_one_process = true;
};

// `ln` over this rank's piece of the sequence, its replicated weight's and
// bias's gradients (each rank's over its piece) summed over `group` inside
// backward: what a sequence-parallel region's LayerNorm outside a block
// (a model's final one) uses with BlockOptions::sum_partial_grads.
at::Tensor layer_norm_of_piece(torch::nn::LayerNorm ln, const at::Tensor& x,
                               const Group& group);

class ParallelBlockImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  ParallelBlockImpl(const torch::nn::LayerNorm& ln1, const torch::nn::Linear& qkv,
                    const torch::nn::Linear& proj, const torch::nn::LayerNorm& ln2,
                    const torch::nn::Linear& fc, const torch::nn::Linear& out, int64_t heads,
                    Group group, BlockOptions o = {});
  // x: [batch, sequence (or this rank's piece of it), width].
  at::Tensor forward(const at::Tensor& x);
  int64_t split_dim(const std::string& name) const override;
  std::vector<at::Tensor> partial_grad_parameters() const override;

  int64_t heads() const { return heads_; }
  const Group& group() const { return group_; }

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ColumnParallelLinear qkv{nullptr}, fc{nullptr};
  RowParallelLinear proj{nullptr}, out{nullptr};

 private:
  // Dropout of `x` (5.): whole (dim < 0), or the piece of `whole` x is
  // along dim from start.
  at::Tensor norm(torch::nn::LayerNorm ln, const at::Tensor& x) const;
  at::Tensor drop(const at::Tensor& x, double p, std::vector<int64_t> whole, int64_t dim,
                  int64_t start);
  Group group_;
  BlockOptions options_;
  int64_t heads_ = 0, width_ = 0;
};
TORCH_MODULE(ParallelBlock);

}  // namespace tandem::parallel
