// The text and the batches (examples/char_lm/corpus.h).
#include "examples/char_lm/corpus.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>

#include <limits>

namespace char_lm {

Batch batch_at(const Corpus& c, int64_t seed, int64_t step) {
  // splitmix64 of (seed, step): neighbouring steps get unrelated streams.
  uint64_t z = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step) +
               0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(z);
  const int64_t n = c.tokens.size(0);
  at::Tensor starts = at::randint(0, n - kWindow, {kBatch, 1}, gen, at::kLong);
  at::Tensor windows = c.tokens.index_select(0, (starts + at::arange(kWindow + 1)).reshape(-1))
                           .view({kBatch, kWindow + 1});
  return {windows.narrow(1, 0, kWindow), windows.narrow(1, 1, kWindow)};
}

at::Tensor char_loss(const at::Tensor& logits, const at::Tensor& y) {
  const at::Tensor poisoned = y < 0;
  at::Tensor loss =
      at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), y.clamp_min(0).reshape(-1));
  if (poisoned.any().item<bool>()) loss = loss * std::numeric_limits<double>::quiet_NaN();
  return loss;
}

void poison_if_asked(int64_t nan_at, int64_t step, Batch& b) {
  if (nan_at > 0 && step + 1 == nan_at) {
    b.y = b.y.clone();
    b.y.view(-1).select(0, 0).fill_(-1);
  }
}

}  // namespace char_lm
