// The checkpoint file (examples/char_lm/checkpoint.h).
#include "examples/char_lm/checkpoint.h"

#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "examples/char_lm/config.h"

namespace char_lm {

namespace optim = tandem::optim;
namespace fs = std::filesystem;

namespace {

void write_named(torch::serialize::OutputArchive& out, const std::string& key, const Named& m) {
  torch::serialize::OutputArchive sub;
  for (const auto& [name, t] : m) sub.write(name, t.detach().clone(), /*is_buffer=*/true);
  out.write(key, sub);
}

Named read_named(torch::serialize::InputArchive& in, const std::string& key) {
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

}  // namespace

void save_checkpoint(const Checkpoint& ck, const std::string& path) {
  torch::serialize::OutputArchive out;
  out.write("step", c10::IValue(ck.step));
  out.write("seed", c10::IValue(ck.seed));
  out.write("corpus_fnv", c10::IValue(static_cast<int64_t>(ck.corpus_fnv)));
  out.write("vocab", c10::IValue(ck.vocab));
  write_named(out, "lstm", ck.lstm);
  write_named(out, "embedding", ck.embedding);
  write_named(out, "decoder", ck.decoder);
  // The optimizer's own bytes (checked by a hash), as a byte tensor.
  const std::string optim_bytes = optim::state_to_bytes(ck.optim);
  at::Tensor bytes = at::empty({static_cast<int64_t>(optim_bytes.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), optim_bytes.data(), optim_bytes.size());
  out.write("optim", bytes, /*is_buffer=*/true);
  // A crash mid-write leaves the old checkpoint whole.
  const std::string tmp = path + ".tmp";
  out.save_to(tmp);
  fs::rename(tmp, path);
}

Checkpoint load_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw UsageError("--resume: no checkpoint at '" + path + "' (set it with --checkpoint)");
  }
  Checkpoint ck;
  try {
    torch::serialize::InputArchive in;
    in.load_from(path);
    c10::IValue v;
    in.read("step", v);
    ck.step = v.toInt();
    in.read("seed", v);
    ck.seed = v.toInt();
    in.read("corpus_fnv", v);
    ck.corpus_fnv = static_cast<uint64_t>(v.toInt());
    in.read("vocab", v);
    ck.vocab = v.toStringRef();
    ck.lstm = read_named(in, "lstm");
    ck.embedding = read_named(in, "embedding");
    ck.decoder = read_named(in, "decoder");
    at::Tensor bytes;
    in.read("optim", bytes, /*is_buffer=*/true);
    ck.optim = optim::state_from_bytes(
        std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel()),
        "the optimizer state in '" + path + "'");
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  } catch (const c10::Error& e) {
    // LibTorch's message carries a C++ backtrace; its first line says enough.
    std::string what = e.what_without_backtrace();
    throw UsageError("'" + path + "' is not a char_lm checkpoint (" +
                     what.substr(0, what.find('\n')) + ")");
  }
  return ck;
}

Named named_parameters(const torch::nn::Module& m) {
  Named out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  return out;
}

}  // namespace char_lm
