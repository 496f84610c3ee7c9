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

#include "examples/flags.h"
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

// What every training example's checkpoint starts with: the steps done, the
// seed they were drawn with, and the text (its FNV-1a hash and vocabulary),
// so that a resume on other terms is refused.
struct RunRecord {
  int64_t step = 0;
  int64_t seed = 0;
  uint64_t corpus_fnv = 0;
  std::string vocab;
};

inline void write_run(torch::serialize::OutputArchive& out, const RunRecord& r) {
  out.write("step", c10::IValue(r.step));
  out.write("seed", c10::IValue(r.seed));
  out.write("corpus_fnv", c10::IValue(static_cast<int64_t>(r.corpus_fnv)));
  out.write("vocab", c10::IValue(r.vocab));
}

inline RunRecord read_run(torch::serialize::InputArchive& in) {
  RunRecord r;
  c10::IValue v;
  in.read("step", v);
  r.step = v.toInt();
  in.read("seed", v);
  r.seed = v.toInt();
  in.read("corpus_fnv", v);
  r.corpus_fnv = static_cast<uint64_t>(v.toInt());
  in.read("vocab", v);
  r.vocab = v.toStringRef();
  return r;
}

// A crash mid-write leaves the old file whole.
inline void save_replacing(torch::serialize::OutputArchive& out, const std::string& path) {
  const std::string tmp = path + ".tmp";
  out.save_to(tmp);
  std::filesystem::rename(tmp, path);
}

// --resume's checkpoint: `read` takes what it needs from the archive at
// `path`. A missing file, one that is not a `program` checkpoint, or an
// optimizer state that does not check out throws UsageError naming it.
template <class Read>
void read_checkpoint(const std::string& path, const std::string& program, Read read) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    throw UsageError("--resume: no checkpoint at '" + path + "' (set it with --checkpoint)");
  }
  try {
    torch::serialize::InputArchive in;
    in.load_from(path);
    read(in);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  } catch (const c10::Error& e) {
    // LibTorch's message carries a C++ backtrace; its first line says enough.
    std::string what = e.what_without_backtrace();
    throw UsageError("'" + path + "' is not a " + program + " checkpoint (" +
                     what.substr(0, what.find('\n')) + ")");
  }
}

}  // namespace examples
