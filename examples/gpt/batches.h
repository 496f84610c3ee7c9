// The windows of text each replica trains on at each step (examples/gpt),
// shared by the pipeline's drivers (train.cc) and the data-parallel path
// (data_parallel.cc).
#pragma once

#include <ATen/ops/arange.h>
#include <ATen/ops/tensor.h>

#include <utility>
#include <vector>

#include "examples/gpt/train.h"
#include "tandem/ddp/sampler.h"

namespace gpt {

// The windows of `tokens` starting at `starts`: inputs and the next
// characters, [starts.size(), context] int64 each.
inline std::pair<at::Tensor, at::Tensor> windows_at(const at::Tensor& tokens,
                                                    const std::vector<int64_t>& starts,
                                                    int64_t context) {
  const at::Tensor s = at::tensor(starts).view({-1, 1});
  at::Tensor rows = tokens.index_select(0, (s + at::arange(context + 1)).reshape(-1));
  rows = rows.view({static_cast<int64_t>(starts.size()), context + 1});
  return {rows.narrow(1, 0, context), rows.narrow(1, 1, context)};
}

// This replica's windows of each step: the job's global batch of step s is
// the sampler's positions [s * b, (s + 1) * b) of every replica's share (b
// = batch / dp), the epoch changing when a share runs out, so the union
// over the replicas is the same whatever --dp is.
class Batches {
 public:
  Batches(const Job& job)
      : cfg_(job.cfg),
        tokens_(job.corpus.tokens),
        per_replica_(job.cfg.batch / job.cfg.dp),
        sampler_(static_cast<size_t>(tokens_.size(0) - job.cfg.context), job.mesh.size("dp"),
                 job.mesh.coordinate("dp"), /*shuffle=*/true, static_cast<uint64_t>(job.cfg.seed)) {
    steps_per_epoch_ = static_cast<int64_t>(sampler_.num_samples()) / per_replica_;
    if (steps_per_epoch_ < 1) {
      throw UsageError("the text has too few windows for a batch of " + std::to_string(cfg_.batch) +
                       "; pass a smaller --batch");
    }
  }

  // x, y: [b, context] int64.
  std::pair<at::Tensor, at::Tensor> at_step(int64_t step) {
    const int64_t epoch = step / steps_per_epoch_;
    if (epoch != epoch_) {
      sampler_.set_epoch(epoch);
      indices_ = sampler_.indices();
      epoch_ = epoch;
    }
    const int64_t first = (step % steps_per_epoch_) * per_replica_;
    std::vector<int64_t> starts(indices_.begin() + first, indices_.begin() + first + per_replica_);
    return windows_at(tokens_, starts, cfg_.context);
  }

 private:
  const Config& cfg_;
  at::Tensor tokens_;
  int64_t per_replica_;
  tandem::ddp::DistributedSampler sampler_;
  int64_t steps_per_epoch_ = 0;
  int64_t epoch_ = -1;
  std::vector<size_t> indices_;
};

}  // namespace gpt
