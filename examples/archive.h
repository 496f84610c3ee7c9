// What the training examples' checkpoints are made of (char_lm, gpt): named
// tensors and a DistributedOptimizer's state inside one torch::serialize
// archive, written beside the path and renamed over it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>

#include "tandem/optim/optimizer_state.h"

namespace examples {

using Named = std::map<std::string, at::Tensor>;

inline void write_named(torch::serialize::OutputArchive& out, const std::string& key,
                        const Named& m) {
  torch::serialize::OutputArchive sub;
  for (const auto& [name, t] : m) sub.write(name, t.detach().clone(), /*is_buffer=*/true);
  out.write(key, sub);
}

inline Named read_named(torch::serialize::InputArchive& in, const std::string& key) {
  torch::serialize::InputArchive sub;
  in.read(key, sub);
  Named m;
  for (const auto& name : sub.keys()) {
    at::Tensor t;
    sub.read(name, t, /*is_buffer=*/true);
    m[name] = t;
  }
  return m;
}

// The optimizer's own bytes (checked by their hash: optim/optimizer_state.h),
// as a byte tensor.
inline void write_optimizer(torch::serialize::OutputArchive& out, const std::string& key,
                            const tandem::optim::OptimizerState& state) {
  const std::string data = tandem::optim::state_to_bytes(state);
  at::Tensor bytes = at::empty({static_cast<int64_t>(data.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), data.data(), data.size());
  out.write(key, bytes, /*is_buffer=*/true);
}

// std::invalid_argument naming `path` when the bytes are not such a state.
inline tandem::optim::OptimizerState read_optimizer(torch::serialize::InputArchive& in,
                                                    const std::string& key,
                                                    const std::string& path) {
  at::Tensor bytes;
  in.read(key, bytes, /*is_buffer=*/true);
  return tandem::optim::state_from_bytes(
      std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel())),
      "the optimizer state in '" + path + "'");
}

// A crash mid-write leaves the old file whole.
inline void save_replacing(torch::serialize::OutputArchive& out, const std::string& path) {
  const std::string tmp = path + ".tmp";
  out.save_to(tmp);
  std::filesystem::rename(tmp, path);
}

}  // namespace examples
