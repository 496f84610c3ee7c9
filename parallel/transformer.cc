// A transformer block split over a tensor-parallel group (parallel/transformer.h).
#include "tandem/parallel/transformer.h"
#include "tandem/parallel/random.h"

#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <utility>

#include "tandem/ddp/process_group.h"
#include "tandem/parallel/node.h"

namespace tandem::parallel {

namespace {

// A copy of its own (same values, dtype and device).
torch::nn::LayerNorm copy_of(const torch::nn::LayerNorm& whole) {
  return torch::nn::LayerNorm(std::dynamic_pointer_cast<torch::nn::LayerNormImpl>(whole->clone()));
}

}  // namespace

at::Tensor layer_norm_of_piece(torch::nn::LayerNorm ln, const at::Tensor& x,
                               const Group& group) {
  check_group(group, "layer_norm_of_piece");
  if (group->size() == 1 || !ln->weight.defined()) return ln(x);
  // (its weight and bias through copy_to_region: their gradients, each
  // rank's over its piece of the sequence, summed as backward reaches them)
  const auto& o = ln->options;
  return at::layer_norm(x, o.normalized_shape(), copy_to_region(ln->weight, group),
                        ln->bias.defined() ? copy_to_region(ln->bias, group) : at::Tensor(),
                        o.eps());
}

ParallelBlockImpl::ParallelBlockImpl(const torch::nn::LayerNorm& ln1_whole,
                                     const torch::nn::Linear& qkv_whole,
                                     const torch::nn::Linear& proj_whole,
                                     const torch::nn::LayerNorm& ln2_whole,
                                     const torch::nn::Linear& fc_whole,
                                     const torch::nn::Linear& out_whole, int64_t heads,
                                     Group group, BlockOptions o)
    : group_(std::move(group)), options_(o), heads_(heads) {
  check_group(group_, "ParallelBlock");
  width_ = proj_whole->weight.size(0);
  if (heads < 1 || width_ % heads != 0) {
    throw std::invalid_argument("ParallelBlock: the width " + std::to_string(width_) +
                                " is not a multiple of " + std::to_string(heads) + " heads");
  }
  if (heads % group_->size() != 0) {
    throw std::invalid_argument("ParallelBlock: " + std::to_string(heads) +
                                " heads do not split over the tensor-parallel group's " +
                                std::to_string(group_->size()) + " ranks");
  }
  for (double p : {o.attention_dropout, o.residual_dropout}) {
    if (!(p >= 0 && p < 1)) {
      throw std::invalid_argument("ParallelBlock: a dropout probability must be in [0, 1), got " +
                                  std::to_string(p));
    }
  }
  if (qkv_whole->weight.size(0) != 3 * width_) {
    throw std::invalid_argument("ParallelBlock: qkv has " +
                                std::to_string(qkv_whole->weight.size(0)) +
                                " outputs, not 3 x the width " + std::to_string(width_));
  }
  ColumnParallelOptions in_attention, in_mlp;
  in_attention.stride = 3;  // [q; k; v], each split by heads
  in_attention.sequence_parallel = in_mlp.sequence_parallel = o.sequence_parallel;
  in_attention.sequence_dim = in_mlp.sequence_dim = o.sequence_dim;
  RowParallelOptions back;
  back.sequence_parallel = o.sequence_parallel;
  back.sequence_dim = o.sequence_dim;
  back.sum_partial_grads = o.sum_partial_grads;
  ln1 = register_module("ln1", copy_of(ln1_whole));
  qkv = register_module("qkv", ColumnParallelLinear(ColumnParallelLinearImpl::from_whole(
                                   qkv_whole, group_, in_attention)));
  proj = register_module(
      "proj", RowParallelLinear(RowParallelLinearImpl::from_whole(proj_whole, group_, back)));
  ln2 = register_module("ln2", copy_of(ln2_whole));
  fc = register_module(
      "fc", ColumnParallelLinear(ColumnParallelLinearImpl::from_whole(fc_whole, group_, in_mlp)));
  out = register_module(
      "out", RowParallelLinear(RowParallelLinearImpl::from_whole(out_whole, group_, back)));
  mark_replicated(*this, group_);  // (the LayerNorms: a checkpoint holds them once)
}

at::Tensor ParallelBlockImpl::forward(const at::Tensor& input) {
  at::Tensor x = input;
  const int64_t local_heads = heads_ / group_->size(), hd = width_ / heads_;
  // [B, T, 3 x its heads x hd] (T whole: the sequence was gathered) ->
  // [3, B, its heads, T, hd]
  const at::Tensor q_k_v = qkv(norm(ln1, x));
  const int64_t B = q_k_v.size(0), T = q_k_v.size(1);
  const at::Tensor parts =
      q_k_v.view({B, T, 3, local_heads, hd}).permute({2, 0, 3, 1, 4});
  const at::Tensor q = parts[0], k = parts[1], v = parts[2];
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
  const at::Tensor future = at::ones({T, T}, q.options().dtype(at::kBool)).triu(1);
  att = at::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
  att = drop(att, options_.attention_dropout, {B, heads_, T, T}, 1,
             group_->rank() * local_heads);
  const at::Tensor y = at::matmul(att, v).transpose(1, 2).reshape({B, T, local_heads * hd});
  // (the residual branches: whole, or this rank's piece of the sequence)
  auto residual = [&](const at::Tensor& branch) {
    if (!options_.sequence_parallel) return drop(branch, options_.residual_dropout, {}, -1, 0);
    std::vector<int64_t> whole = branch.sizes().vec();
    const int64_t d = options_.sequence_dim;
    whole[static_cast<size_t>(d)] *= group_->size();
    return drop(branch, options_.residual_dropout, whole, d, group_->rank() * branch.size(d));
  };
  x = x + residual(proj(y));
  return x + residual(out(at::gelu(fc(norm(ln2, x)))));
}

at::Tensor ParallelBlockImpl::norm(torch::nn::LayerNorm ln, const at::Tensor& x) const {
  if (!options_.sequence_parallel || !options_.sum_partial_grads) return ln(x);
  return layer_norm_of_piece(ln, x, group_);
}

at::Tensor ParallelBlockImpl::drop(const at::Tensor& x, double p, std::vector<int64_t> whole,
                                   int64_t dim, int64_t start) {
  if (p == 0 || !is_training()) return x;
  RngTracker& rng = options_.tracker ? *options_.tracker : rng_tracker();
  if (dim < 0) return dropout(x, p, true, rng.get(options_.rng));
  if (!options_.masks_like_one_process) {
    return dropout(x, p, true, rng.get(options_.rng + "/tp" + std::to_string(group_->rank())));
  }
  return dropout_piece(x, p, true, rng.get(options_.rng), whole, dim, start);
}

int64_t ParallelBlockImpl::split_dim(const std::string& name) const {
  const auto dot = name.find('.');
  const std::string child = name.substr(0, dot), leaf = name.substr(dot + 1);
  if (child == "qkv") return qkv->split_dim(leaf);
  if (child == "fc") return fc->split_dim(leaf);
  if (child == "proj") return proj->split_dim(leaf);
  if (child == "out") return out->split_dim(leaf);
  return -1;  // the LayerNorms: whole on every rank
}

std::vector<at::Tensor> ParallelBlockImpl::partial_grad_parameters() const {
  if (!options_.sequence_parallel || options_.sum_partial_grads) return {};
  std::vector<at::Tensor> out_params;
  for (const auto& ln : {ln1, ln2}) {
    for (const auto& p : ln->parameters()) out_params.push_back(p);
  }
  return out_params;  // (the row-parallel biases are their modules' own)
}

}  // namespace tandem::parallel
