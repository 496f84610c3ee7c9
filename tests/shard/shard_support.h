// What the sharded layers' tests share: a model of uneven parameters with a
// layer no forward uses, and each rank's batches (ranks are threads).
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/relu.h>
#include <torch/nn/modules/linear.h>

#include <mutex>
#include <vector>

namespace tandem::test::shard {

// Parameters of many sizes (an odd rank count splits them unevenly), and a
// layer no forward uses.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 13));
    fc2 = register_module("fc2", torch::nn::Linear(13, 7));
    fc3 = register_module("fc3", torch::nn::Linear(7, 3));
    unused = register_module("unused", torch::nn::Linear(2, 2));
  }
  at::Tensor forward(const at::Tensor& x) { return fc3(at::relu(fc2(at::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, unused{nullptr};
};
TORCH_MODULE(Net);

// The global generator makes the weights: one thread at a time.
inline std::mutex& seed_mutex() {
  static std::mutex mu;
  return mu;
}
inline Net make_net(uint64_t seed) {
  std::lock_guard<std::mutex> lock(seed_mutex());
  at::manual_seed(seed);
  return Net();
}

struct Batch {
  at::Tensor x, y;
};
// Rank r's micro-batch k of 4 samples, from its own generator (seeded
// `base + 31 r + k`: each test file its own base).
inline Batch batch_of(uint64_t base, int r, int k) {
  auto gen = at::detail::createCPUGenerator(base + static_cast<uint64_t>(31 * r + k));
  return {at::randn({4, 6}, gen), at::randint(0, 3, {4}, gen, at::kLong)};
}
// Micro-batch k of every one of n ranks, concatenated: what one process trains on.
inline Batch concat_of(uint64_t base, int n, int k) {
  std::vector<at::Tensor> xs, ys;
  for (int r = 0; r < n; ++r) {
    auto b = batch_of(base, r, k);
    xs.push_back(b.x);
    ys.push_back(b.y);
  }
  return {at::cat(xs), at::cat(ys)};
}

}  // namespace tandem::test::shard
