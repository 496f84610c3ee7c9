// The checkpoint file (examples/char_lm/checkpoint.h).
#include "examples/char_lm/checkpoint.h"

#include <ATen/core/ivalue.h>

#include <filesystem>
#include <stdexcept>

#include "examples/archive.h"
#include "examples/char_lm/config.h"

namespace char_lm {

namespace optim = tandem::optim;
namespace fs = std::filesystem;

using examples::read_named;
using examples::write_named;

void save_checkpoint(const Checkpoint& ck, const std::string& path) {
  torch::serialize::OutputArchive out;
  out.write("step", c10::IValue(ck.step));
  out.write("seed", c10::IValue(ck.seed));
  out.write("corpus_fnv", c10::IValue(static_cast<int64_t>(ck.corpus_fnv)));
  out.write("vocab", c10::IValue(ck.vocab));
  write_named(out, "lstm", ck.lstm);
  write_named(out, "embedding", ck.embedding);
  write_named(out, "decoder", ck.decoder);
  examples::write_optimizer(out, "optim", ck.optim);
  examples::save_replacing(out, path);
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
    ck.optim = examples::read_optimizer(in, "optim", path);
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
