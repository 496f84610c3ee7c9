#pragma once
// DistributedSampler: each rank's share of a dataset's indices, exactly as
// PyTorch's torch.utils.data.DistributedSampler gives them for the same
// arguments (tests/ddp/data holds its indices, made by python3-torch).
//
// Per epoch: a permutation of [0, size) from a CPU generator seeded with
// seed + epoch (or [0, size) in order without shuffle); padded by repeating
// it from its start until it divides by num_replicas, or cut to a multiple
// of num_replicas with drop_last; then every num_replicas-th index from
// rank. Call set_epoch(e) before each epoch, or every epoch repeats the
// first one's order (as in PyTorch).
//
// It is a torch::data sampler, so it plugs into LibTorch's data loaders:
//   auto loader = torch::data::make_data_loader(dataset.map(Stack<>()),
//       ddp::DistributedSampler(dataset.size().value(), world, rank), batch);
// (LibTorch's own DistributedRandomSampler orders indices differently.)
#include <torch/data/samplers/base.h>

#include <c10/util/Optional.h>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace tandem::ddp {

class DistributedSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  // num_replicas / rank < 0: the default process group's (as PyTorch does).
  // Throws std::invalid_argument for a rank outside [0, num_replicas).
  explicit DistributedSampler(size_t dataset_size, int num_replicas = -1, int rank = -1,
                              bool shuffle = true, uint64_t seed = 0, bool drop_last = false);

  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }
  // This rank's indices for the current epoch, in order (len: num_samples()).
  std::vector<size_t> indices() const;
  // PyTorch's len(sampler).
  size_t num_samples() const { return num_samples_; }
  size_t total_size() const { return num_samples_ * static_cast<size_t>(replicas_); }
  int num_replicas() const { return replicas_; }
  // How many of this epoch's indices next() has handed out.
  size_t position() const { return cursor_; }
  // Goes on within `epoch` after `position` indices of this rank's
  // (set_epoch, reset, then skips them). Throws std::invalid_argument past
  // the epoch's end.
  void resume(int64_t epoch, size_t position);

  // torch::data::samplers::Sampler: reset() starts the epoch's indices over
  // (a new size re-derives the shares); next(n) hands out up to n of them.
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  void derive_sizes();

  size_t size_;
  int replicas_, rank_;
  bool shuffle_, drop_last_;
  uint64_t seed_;
  int64_t epoch_ = 0;
  size_t num_samples_ = 0;
  std::vector<size_t> current_;
  size_t cursor_ = 0;
};

}  // namespace tandem::ddp
