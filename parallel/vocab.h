#pragma once
// The vocabulary split over a tensor-parallel group: Megatron-LM's
// vocabulary-parallel embedding and cross-entropy, whose logits are never
// gathered whole.
//
//   parallel::VocabParallelEmbedding embed(vocab, dim, tp);    // rank r: its words' rows
//   parallel::ColumnParallelLinear head(dim, vocab, tp);        // rank r: its words' logits
//   at::Tensor h = embed(ids);                                  // [B, T, dim], whole
//   at::Tensor logits = head(h);                                // [B, T, its words]
//   at::Tensor loss = parallel::vocab_parallel_cross_entropy(logits, targets, vocab, tp).mean();
//
// 1. Rank r holds the words range_of(vocab, r, tp) (parallel/collectives.h):
//    a vocabulary that does not divide is split unevenly, the first
//    vocab % tp ranks holding a word more; nothing is padded, so the
//    loss is the one-process loss, with no padded word in its softmax.
// 2. The embedding looks up the ids in its range and leaves the others'
//    rows zero, then sums over the group (reduce_from_region), or with
//    sequence parallelism sums and keeps its piece of the sequence
//    (reduce_scatter along sequence_dim). Made from a seed, its weight is
//    the slice of torch::nn::Embedding(vocab, dim)'s drawn in one process.
// 3. vocab_parallel_cross_entropy takes this rank's logits [..., its words]
//    and the targets [...] (the same on every rank), and returns the
//    cross-entropy of each position, the same on every rank: the maximum,
//    the target's logit and the sum of the exponentials are all-reduced
//    (three collectives of one number a position), never the logits.
//    Its backward needs no collective: softmax - one-hot, of this rank's
//    words. Forward and backward equal at::cross_entropy_loss's over the
//    whole logits (reduction none).
// 4. An id or target outside [0, vocab), or logits whose last dimension is
//    not this rank's count of words, is std::invalid_argument naming it.
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>

#include "tandem/parallel/collectives.h"
#include "tandem/parallel/linear.h"

namespace tandem::parallel {

struct VocabParallelOptions {
  bool sequence_parallel = false;  // 2.: the output is a piece of the sequence
  int64_t sequence_dim = 1;        // which dimension of the output is the sequence
};

class VocabParallelEmbeddingImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, Group group,
                             VocabParallelOptions o = {});
  // This rank's rows of `whole`.
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& whole, Group group,
                             VocabParallelOptions o = {});
  at::Tensor forward(const at::Tensor& ids);
  int64_t split_dim(const std::string& name) const override { return name == "weight" ? 0 : -1; }

  at::Tensor weight;  // [its words, dim]
  Range words() const { return words_; }
  int64_t vocab() const { return vocab_; }

 private:
  void take_rows(const at::Tensor& whole);
  Group group_;
  VocabParallelOptions options_;
  int64_t vocab_ = 0;
  Range words_;
};
TORCH_MODULE(VocabParallelEmbedding);

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab, const Group& group);

}  // namespace tandem::parallel
