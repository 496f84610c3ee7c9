// The vocabulary split over a tensor-parallel group (parallel/vocab.h).
#include "tandem/parallel/vocab.h"

#include <ATen/ops/embedding.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/log.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <stdexcept>
#include <utility>

#include "tandem/checkpoint/placement.h"
#include "tandem/ddp/process_group.h"
#include "tandem/parallel/node.h"

namespace tandem::parallel {

namespace {

void check_ids(const at::Tensor& ids, int64_t vocab, const char* who, const char* what) {
  if (!ids.defined() || ids.numel() == 0) return;
  const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
  if (lo < 0 || hi >= vocab) {
    throw std::invalid_argument(std::string(who) + ": " + what + " " +
                                std::to_string(lo < 0 ? lo : hi) + " is outside [0, " +
                                std::to_string(vocab) + ")");
  }
}

}  // namespace

// ---- the embedding ----

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, Group group,
                                                       VocabParallelOptions o)
    : group_(std::move(group)), options_(o), vocab_(vocab) {
  check_group(group_, "VocabParallelEmbedding");
  if (vocab < group_->size()) {
    throw std::invalid_argument("VocabParallelEmbedding: a vocabulary of " +
                                std::to_string(vocab) + " is smaller than the group's " +
                                std::to_string(group_->size()) + " ranks");
  }
  // (2.: the whole table, drawn as one process would, then this rank's rows)
  torch::nn::Embedding whole(vocab, dim);
  take_rows(whole->weight);
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const torch::nn::Embedding& whole,
                                                       Group group, VocabParallelOptions o)
    : group_(std::move(group)), options_(o), vocab_(whole->weight.size(0)) {
  check_group(group_, "VocabParallelEmbedding");
  take_rows(whole->weight);
}

void VocabParallelEmbeddingImpl::take_rows(const at::Tensor& whole) {
  words_ = range_of(vocab_, group_->rank(), group_->size());
  weight = register_parameter("weight", whole.detach().narrow(0, words_.start, words_.length).clone());
  if (group_->size() > 1) {  // (where the rows lie in the whole table, for checkpoints)
    checkpoint::set_placement(weight, {whole.sizes().vec(), 0,
                                       {{words_.start, words_.start + words_.length}}});
  }
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  check_ids(ids, vocab_, "VocabParallelEmbedding", "id");
  const at::Tensor outside = (ids < words_.start).logical_or(ids >= words_.end());
  const at::Tensor local = (ids - words_.start).masked_fill(outside, 0);
  // Another rank's words give rows of zeros here (multiplied, so that their
  // gradient is zero too).
  const at::Tensor mine = at::embedding(weight, local) *
                          outside.logical_not().unsqueeze(-1).to(weight.scalar_type());
  return options_.sequence_parallel ? reduce_scatter(mine, options_.sequence_dim, group_)
                                    : reduce_from_region(mine, group_);
}

// ---- the loss ----

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        int64_t vocab, const Group& group) {
  static const char* kWho = "vocab_parallel_cross_entropy";
  check_group(group, kWho);
  if (!logits.defined() || !targets.defined()) {
    throw std::invalid_argument(std::string(kWho) + ": undefined logits or targets");
  }
  const Range words = range_of(vocab, group->rank(), group->size());
  if (logits.dim() < 1 || logits.size(-1) != words.length ||
      logits.sizes().slice(0, logits.dim() - 1) != targets.sizes()) {
    throw std::invalid_argument(std::string(kWho) + ": rank " + std::to_string(group->rank()) +
                                " holds " + std::to_string(words.length) + " of " +
                                std::to_string(vocab) + " words, so its logits are [targets' "
                                "shape..., " + std::to_string(words.length) + "], not " +
                                c10::str(logits.sizes()) + " for targets " +
                                c10::str(targets.sizes()));
  }
  check_ids(targets, vocab, kWho, "target");
  at::Tensor z, softmax, target_mask, local_target;
  at::Tensor loss;
  {
    at::NoGradGuard no_grad;
    const at::Tensor x = logits.detach();
    // The largest logit of each position over the group, for a stable sum.
    at::Tensor top = std::get<0>(x.max(-1));
    group->all_reduce(top, ddp::ReduceOp::kMax);
    z = x - top.unsqueeze(-1);
    // The target's logit, from the rank that holds its word.
    target_mask = (targets >= words.start).logical_and(targets < words.end());
    local_target = (targets - words.start).masked_fill(target_mask.logical_not(), 0);
    at::Tensor picked = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) *
                        target_mask.to(z.scalar_type());
    group->all_reduce(picked, ddp::ReduceOp::kSum);
    const at::Tensor e = at::exp(z);
    at::Tensor sum = e.sum(-1);
    group->all_reduce(sum, ddp::ReduceOp::kSum);
    softmax = e / sum.unsqueeze(-1);
    loss = at::log(sum) - picked;
  }
  // 3.: the gradient of each position's loss over this rank's logits is
  // softmax - one-hot: no collective.
  return with_backward(logits, loss, "tandem::parallel::VocabParallelCrossEntropyBackward",
                       [softmax, target_mask, local_target](const at::Tensor& g) {
                         at::Tensor grad = softmax.clone();
                         const at::Tensor hot = target_mask.to(grad.scalar_type()).unsqueeze(-1);
                         grad.scatter_add_(-1, local_target.unsqueeze(-1), -hot);
                         return grad * g.unsqueeze(-1);
                       });
}

}  // namespace tandem::parallel
