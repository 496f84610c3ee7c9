// The checkpoint file (examples/gpt/checkpoint.h).
#include "examples/gpt/checkpoint.h"

#include <ATen/core/ivalue.h>

#include <filesystem>
#include <stdexcept>

#include "examples/archive.h"

namespace gpt {

void save_checkpoint(const Checkpoint& ck, const std::string& path) {
  torch::serialize::OutputArchive out;
  out.write("step", c10::IValue(ck.step));
  out.write("seed", c10::IValue(ck.seed));
  out.write("corpus_fnv", c10::IValue(static_cast<int64_t>(ck.corpus_fnv)));
  out.write("vocab", c10::IValue(ck.vocab));
  out.write("shape", c10::IValue(ck.shape));
  out.write("counts", c10::IValue(ck.counts));
  examples::write_named(out, "model", ck.model);
  examples::write_optimizer(out, "optim", ck.optim);
  examples::save_replacing(out, path);
}

Checkpoint load_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
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
    in.read("shape", v);
    ck.shape = v.toIntVector();
    in.read("counts", v);
    ck.counts = v.toIntVector();
    ck.model = examples::read_named(in, "model");
    ck.optim = examples::read_optimizer(in, "optim", path);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  } catch (const c10::Error& e) {
    // LibTorch's message carries a C++ backtrace; its first line says enough.
    std::string what = e.what_without_backtrace();
    throw UsageError("'" + path + "' is not a gpt checkpoint (" + what.substr(0, what.find('\n')) +
                     ")");
  }
  return ck;
}

}  // namespace gpt
