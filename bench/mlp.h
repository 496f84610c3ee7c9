// The model pipeline_bench and pp_dp_bench train: blocks x (Linear + ReLU),
// the first from `input` wide, then a Linear head to kClasses; SGD on a
// seeded batch. As layer specs (for pipeline::partition), and as plain
// LibTorch in one process (the baseline, local_samples_per_s).
#pragma once

#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <vector>

#include "bench/bench_util.h"
#include "tandem/remote_module/remote_module.h"

namespace tandem::bench {

constexpr int64_t kMlpClasses = 10;

struct Mlp {
  int batch = 2048, width = 1024, blocks = 8, input = 1536;
};

inline std::vector<c10::IValue> mlp_layers(const Mlp& m) {
  std::vector<c10::IValue> out;
  for (int i = 0; i < m.blocks; ++i) {
    out.push_back(nn::spec("Linear", {int64_t{i == 0 ? m.input : m.width}, int64_t{m.width}}));
    out.push_back(nn::spec("ReLU"));
  }
  out.push_back(nn::spec("Linear", {int64_t{m.width}, kMlpClasses}));
  return out;
}

struct MlpBatch {
  at::Tensor x, y;
};
inline MlpBatch mlp_batch(const Mlp& m) {
  at::manual_seed(1);
  return {at::randn({int64_t{m.batch}, int64_t{m.input}}),
          at::randint(0, kMlpClasses, {int64_t{m.batch}}, at::kLong)};
}

// Samples per second of `step`: the batch over the median of `steps` step
// times after `warmup` (a median, so that one stall of a shared machine
// does not decide a line).
template <class Step>
double samples_per_s(int batch, int warmup, int steps, Step step) {
  std::vector<double> ms;
  for (int i = 0; i < warmup + steps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    step();
    if (i >= warmup) ms.push_back(ms_since(start));
  }
  return batch / (median(ms) / 1e3);
}

// The same model trained whole in plain LibTorch, in this process; with
// `chunks` > 1 the batch is cut into that many micro-batches whose gradients
// accumulate before the one optimizer step, as a pipeline's stages compute.
inline double local_samples_per_s(const Mlp& m, int warmup, int steps, int chunks = 1) {
  std::vector<torch::nn::Linear> layers;
  std::vector<at::Tensor> params;
  for (int i = 0; i < m.blocks; ++i) layers.emplace_back(i == 0 ? m.input : m.width, m.width);
  layers.emplace_back(m.width, kMlpClasses);
  for (auto& l : layers) {
    for (auto& p : l->parameters()) params.push_back(p);
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.01));
  MlpBatch b = mlp_batch(m);
  const auto xs = b.x.chunk(chunks), ys = b.y.chunk(chunks);
  return samples_per_s(m.batch, warmup, steps, [&] {
    opt.zero_grad();
    for (size_t c = 0; c < xs.size(); ++c) {
      at::Tensor h = xs[c];
      for (size_t i = 0; i < layers.size(); ++i) {
        h = layers[i](h);
        if (i + 1 < layers.size()) h = at::relu(h);
      }
      // Each micro-batch's mean, weighted by its rows, as the pipeline's loss is.
      (torch::nn::functional::cross_entropy(h, ys[c]) *
       (static_cast<double>(xs[c].size(0)) / static_cast<double>(m.batch)))
          .backward();
    }
    opt.step();
  });
}

}  // namespace tandem::bench
