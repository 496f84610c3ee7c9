// char_lm's text (load_corpus: the file or the default directory, its
// vocabulary and tokens; examples/text.h) and the batch of each step
// (batch_at), a function of (seed, step) alone. Read by main.cc before training, and by the
// training loops (train.cc, train_pipeline.cc) and the sampler (model.cc).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "examples/char_lm/config.h"
#include "examples/text.h"

namespace char_lm {

using examples::Corpus;

// The text --corpus names, or every regular file of the default directory;
// bad input throws UsageError.
inline Corpus load_corpus(const std::string& flag) {
  return examples::load_corpus(flag, kWindow + 1);
}

// The batch of step `step`: a function of (seed, step) alone, so that a
// resumed run draws exactly the batches an uninterrupted one would.
struct Batch {
  at::Tensor x, y;  // [B, T] int64: inputs and the characters that follow them
};
Batch batch_at(const Corpus& c, int64_t seed, int64_t step);
// The mean cross-entropy of `logits` [.., V] against the characters `y`;
// NaN when a target is negative (a poisoned batch: char_lm --nan-at), so
// that its gradients are NaN too.
at::Tensor char_loss(const at::Tensor& logits, const at::Tensor& y);
// `b` with its first target poisoned when `step` + 1 is `nan_at`.
void poison_if_asked(int64_t nan_at, int64_t step, Batch& b);

}  // namespace char_lm
