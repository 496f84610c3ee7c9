// The small model the pipeline's tests split into stages (pipe_test.cc, and
// the mesh's pp x dp tests): stage s is Linear(dims[s], dims[s + 1]),
// then Tanh but on the last stage, from kIn features to kClasses.
#pragma once

#include <ATen/ops/randn.h>

#include <cstdint>
#include <vector>

namespace tandem::test {

constexpr int64_t kIn = 6, kHidden = 8, kClasses = 3;

struct Weights {
  std::vector<at::Tensor> w, b;  // per stage
};

inline std::vector<int64_t> dims(int stages) {
  std::vector<int64_t> d(stages + 1, kHidden);
  d.front() = kIn;
  d.back() = kClasses;
  return d;
}

// Every stage's weights, drawn from at::manual_seed(seed).
inline Weights initial(int stages, uint64_t seed) {
  at::manual_seed(seed);
  auto d = dims(stages);
  Weights w;
  for (int s = 0; s < stages; ++s) {
    w.w.push_back(at::randn({d[s + 1], d[s]}) * 0.5);
    w.b.push_back(at::randn({d[s + 1]}) * 0.1);
  }
  return w;
}

}  // namespace tandem::test
