// The checkpoint file (examples/gpt/checkpoint.h).
#include "examples/gpt/checkpoint.h"

#include <ATen/core/ivalue.h>

#include <filesystem>
#include <stdexcept>

#include "examples/archive.h"

namespace gpt {

void save_checkpoint(const Checkpoint& ck, const std::string& path) {
  torch::serialize::OutputArchive out;
  examples::write_run(out, {ck.step, ck.seed, ck.corpus_fnv, ck.vocab});
  out.write("shape", c10::IValue(ck.shape));
  out.write("counts", c10::IValue(ck.counts));
  examples::write_named(out, "model", ck.model);
  examples::write_optimizer(out, "optim", ck.optim);
  examples::save_replacing(out, path);
}

Checkpoint load_checkpoint(const std::string& path) {
  Checkpoint ck;
  examples::read_checkpoint(path, "gpt", [&](torch::serialize::InputArchive& in) {
    const examples::RunRecord run = examples::read_run(in);
    ck.step = run.step;
    ck.seed = run.seed;
    ck.corpus_fnv = run.corpus_fnv;
    ck.vocab = run.vocab;
    c10::IValue v;
    in.read("shape", v);
    ck.shape = v.toIntVector();
    in.read("counts", v);
    ck.counts = v.toIntVector();
    ck.model = examples::read_named(in, "model");
    ck.optim = examples::read_optimizer(in, "optim", path);
  });
  return ck;
}

}  // namespace gpt
