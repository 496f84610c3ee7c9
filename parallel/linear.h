#pragma once
// Megatron-LM's tensor-parallel linear layers over a process group (a
// mesh's "tp" dimension), as LibTorch modules.
//
//   auto tp = mesh.group("tp");
//   parallel::ColumnParallelLinear up(512, 2048, tp);     // each rank: 2048/tp outputs
//   parallel::RowParallelLinear down(2048, 512, tp);      // each rank: 2048/tp inputs
//   at::Tensor y = down(at::gelu(up(x)));                 // = Linear(512,2048), gelu, Linear(2048,512)
//
// 1. A column-parallel linear splits its output features: rank r holds rows
//    [r * out/tp, (r + 1) * out/tp) of the whole weight (and of the bias;
//    range_of's rows where out does not divide, 6.).
//    Its input is the replicated region's (copy_to_region: identity forward,
//    all-reduce of the gradient backward), or, with sequence parallelism, a
//    piece of the sequence all-gathered first (reduce-scatter backward); as
//    Megatron does, it then keeps only its piece for the weight's gradient
//    and all-gathers it again in backward (a tp-th of the activation held,
//    for one all-gather more). Its output is left split along the last dimension
//    (gather_output false, what a row-parallel layer takes next) or
//    gathered whole (gather_from_region).
// 2. A row-parallel linear splits its input features: rank r holds columns
//    [r * in/tp, (r + 1) * in/tp) of the whole weight, and the whole bias.
//    Its input is already split (input_is_parallel, a column-parallel
//    layer's output) or split here (scatter_to_region). The partial
//    products are summed over the group (reduce_from_region), or, with
//    sequence parallelism, summed and split along the sequence
//    (reduce_scatter); the bias is added after, once.
// 3. Made from a seed, a layer's parameters are exactly the slices of the
//    whole layer's that torch::nn::Linear(in, out) would initialise in one
//    process from the same generator state (each rank draws the whole
//    layer, as one process would, and keeps its slice): every layout starts
//    from the same numbers, and the generator moves on as one process's
//    does. A layer can also be cut from a whole one (from_whole).
// 4. Parameters keep torch::nn::Linear's names ("weight", "bias"), so a
//    state dict names what the whole model's does; split_dim() says along
//    which dimension of the whole parameter a rank's piece lies (-1: not
//    split, replicated). Each split parameter carries its
//    checkpoint::Placement (checkpoint/placement.h; a group of more than
//    one), so checkpoints write it, and its optimizer state, as slices of
//    the whole parameter under the whole one's name, and load it from any
//    split of it or from the whole; a row-parallel bias is marked as a
//    replica (mark_replicated), written by rank 0 alone.
// 5. Gradients: a split parameter's gradient is its slice of the whole
//    gradient. The row-parallel bias is replicated: its gradient is the
//    whole one on every rank, except under sequence parallelism, where each
//    rank's covers its piece of the sequence; partial_grad_parameters()
//    lists such parameters, which all_reduce_partial_grads() sums over the
//    group after backward (Megatron's sequence-parallel gradient sum). Or,
//    with sum_partial_grads, the layer sums it inside backward (the bias
//    used through copy_to_region: an all-reduce of its gradient as
//    backward reaches it), so the gradient any engine accumulates is the
//    whole one: in a distributed autograd context too, where
//    all_reduce_partial_grads cannot reach (a pipeline stage's); it then
//    lists nothing as partial.
// 6. A row-parallel layer's in_features must divide by the group's size,
//    and so must a column-parallel layer's out_features when its output is
//    gathered; else std::invalid_argument naming it. A column-parallel
//    layer whose output stays split may have out_features that do not
//    divide (a vocabulary's: the LM head before
//    vocab_parallel_cross_entropy): its pieces are range_of's, the first
//    out % tp ranks holding one row more.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/parallel/collectives.h"

namespace tandem::parallel {

// What a tensor-parallel layer tells about its parameters (4., 5.).
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  // Along which dimension of the whole parameter `name` this rank's piece
  // lies; -1 when it is replicated whole.
  virtual int64_t split_dim(const std::string& name) const = 0;
  // Replicated parameters whose gradient on each rank is only a part of
  // the whole one (summed by all_reduce_partial_grads).
  virtual std::vector<at::Tensor> partial_grad_parameters() const { return {}; }
};

struct ColumnParallelOptions {
  bool bias = true;
  bool gather_output = false;     // 1.: the whole output on every rank
  bool sequence_parallel = false;  // 1.: the input is a piece of the sequence
  int64_t sequence_dim = 1;        // which dimension of the input is the sequence
  // The output features are `stride` equal blocks side by side (a fused
  // query, key and value projection: 3), each split over the group: rank r
  // holds its piece of every block, block after block. Not with
  // gather_output; out_features must divide by stride x the group's size.
  int64_t stride = 1;
};

class ColumnParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  ColumnParallelLinearImpl(int64_t in, int64_t out, Group group, ColumnParallelOptions o = {});
  // 3.: this rank's slice of `whole` (a [out, in] weight and its bias).
  static std::shared_ptr<ColumnParallelLinearImpl> from_whole(const torch::nn::Linear& whole,
                                                              Group group,
                                                              ColumnParallelOptions o = {});
  at::Tensor forward(const at::Tensor& x);
  int64_t split_dim(const std::string& name) const override;

  at::Tensor weight, bias;  // [out / tp, in], [out / tp]
  const Group& group() const { return group_; }
  const ColumnParallelOptions& options() const { return options_; }

  // (from_whole's: the slice of `whole`, no drawing)
  ColumnParallelLinearImpl(const torch::nn::Linear& whole, Group group, ColumnParallelOptions o);

 private:
  void take_slice(const torch::nn::Linear& whole);
  Group group_;
  ColumnParallelOptions options_;
  int64_t in_ = 0, out_ = 0;
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelOptions {
  bool bias = true;
  bool input_is_parallel = true;   // 2.: the input is already split (a column-parallel output)
  bool sequence_parallel = false;  // 2.: the output is a piece of the sequence
  int64_t sequence_dim = 1;        // which dimension of the output is the sequence
  bool sum_partial_grads = false;  // 5.: the bias's partial gradient summed in backward
};

class RowParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  RowParallelLinearImpl(int64_t in, int64_t out, Group group, RowParallelOptions o = {});
  static std::shared_ptr<RowParallelLinearImpl> from_whole(const torch::nn::Linear& whole,
                                                           Group group, RowParallelOptions o = {});
  at::Tensor forward(const at::Tensor& x);
  int64_t split_dim(const std::string& name) const override;
  std::vector<at::Tensor> partial_grad_parameters() const override;

  at::Tensor weight, bias;  // [out, in / tp], [out]
  const Group& group() const { return group_; }
  const RowParallelOptions& options() const { return options_; }

  // (from_whole's: the slice of `whole`, no drawing)
  RowParallelLinearImpl(const torch::nn::Linear& whole, Group group, RowParallelOptions o);

 private:
  void take_slice(const torch::nn::Linear& whole);
  bool sums_in_backward() const;
  Group group_;
  RowParallelOptions options_;
  int64_t in_ = 0, out_ = 0;
};
TORCH_MODULE(RowParallelLinear);

// 4.: marks every parameter of `root` that is not a piece of a split one,
// and every buffer, as this rank's copy of a tensor replicated over
// `group` (checkpoint::set_replica), so that a checkpoint holds it once,
// written by rank 0's copy (ParallelBlock marks its LayerNorms; a model
// marks whatever else it keeps whole on every tp rank).
void mark_replicated(torch::nn::Module& root, const Group& group);

// 5.: sums over `group` the gradients of every partial_grad_parameters() in
// `root` and its children (collective over the group; the same modules on
// every rank).
void all_reduce_partial_grads(torch::nn::Module& root, const Group& group);

}  // namespace tandem::parallel
