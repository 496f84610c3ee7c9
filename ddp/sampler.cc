#include "tandem/ddp/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randperm.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/serialize/archive.h>

#include <stdexcept>
#include <string>

#include "tandem/ddp/process_group.h"

namespace tandem::ddp {

DistributedSampler::DistributedSampler(size_t dataset_size, int num_replicas, int rank,
                                       bool shuffle, uint64_t seed, bool drop_last)
    : size_(dataset_size),
      replicas_(num_replicas >= 0 ? num_replicas : get_world_size()),
      rank_(rank >= 0 ? rank : get_rank()),
      shuffle_(shuffle),
      drop_last_(drop_last),
      seed_(seed) {
  if (replicas_ < 1) throw std::invalid_argument("DistributedSampler: num_replicas must be >= 1");
  if (rank_ >= replicas_) {
    throw std::invalid_argument("DistributedSampler: rank " + std::to_string(rank_) +
                                " is not in [0, num_replicas " + std::to_string(replicas_) + ")");
  }
  derive_sizes();
  reset();
}

void DistributedSampler::derive_sizes() {
  const size_t r = static_cast<size_t>(replicas_);
  // As PyTorch: with drop_last the tail that does not divide is dropped
  // (its ceil((n - r) / r) is floor(n / r) then), else the shares round up.
  num_samples_ = drop_last_ && size_ % r != 0 ? size_ / r : (size_ + r - 1) / r;
}

void DistributedSampler::set_epoch(int64_t epoch) { epoch_ = epoch; }

std::vector<size_t> DistributedSampler::indices() const {
  std::vector<size_t> all(size_);
  if (shuffle_) {
    auto gen = at::detail::createCPUGenerator(seed_ + static_cast<uint64_t>(epoch_));
    at::Tensor perm = at::randperm(static_cast<int64_t>(size_), gen, at::kLong);
    const int64_t* p = perm.data_ptr<int64_t>();
    for (size_t i = 0; i < size_; ++i) all[i] = static_cast<size_t>(p[i]);
  } else {
    for (size_t i = 0; i < size_; ++i) all[i] = i;
  }
  const size_t total = total_size();
  if (all.size() < total && !all.empty()) {
    // Padded by repeating from the start (more than once when short).
    const size_t n = all.size();
    for (size_t i = 0; all.size() < total; ++i) all.push_back(all[i % n]);
  } else {
    all.resize(total);
  }
  std::vector<size_t> mine;
  mine.reserve(num_samples_);
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(replicas_)) {
    mine.push_back(all[i]);
  }
  return mine;
}

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  if (new_size && *new_size != size_) {
    size_ = *new_size;
    derive_sizes();
  }
  current_ = indices();
  cursor_ = 0;
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (cursor_ >= current_.size()) return c10::nullopt;
  size_t end = std::min(current_.size(), cursor_ + batch_size);
  std::vector<size_t> out(current_.begin() + static_cast<std::ptrdiff_t>(cursor_),
                          current_.begin() + static_cast<std::ptrdiff_t>(end));
  cursor_ = end;
  return out;
}

void DistributedSampler::resume(int64_t epoch, size_t position) {
  if (position > num_samples_) {
    throw std::invalid_argument("DistributedSampler::resume: position " + std::to_string(position) +
                                " is past the epoch's " + std::to_string(num_samples_) +
                                " indices of this rank");
  }
  set_epoch(epoch);
  reset();
  cursor_ = position;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", at::scalar_tensor(epoch_, at::kLong), /*is_buffer=*/true);
  archive.write("cursor", at::scalar_tensor(static_cast<int64_t>(cursor_), at::kLong), true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch, cursor;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("cursor", cursor, true);
  epoch_ = epoch.item<int64_t>();
  reset();
  cursor_ = std::min(current_.size(), static_cast<size_t>(cursor.item<int64_t>()));
}

}  // namespace tandem::ddp
