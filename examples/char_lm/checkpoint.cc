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
  examples::write_run(out, {ck.step, ck.seed, ck.corpus_fnv, ck.vocab});
  write_named(out, "lstm", ck.lstm);
  write_named(out, "embedding", ck.embedding);
  write_named(out, "decoder", ck.decoder);
  examples::write_optimizer(out, "optim", ck.optim);
  examples::save_replacing(out, path);
}

Checkpoint load_checkpoint(const std::string& path) {
  Checkpoint ck;
  examples::read_checkpoint(path, "char_lm", [&](torch::serialize::InputArchive& in) {
    const examples::RunRecord run = examples::read_run(in);
    ck.step = run.step;
    ck.seed = run.seed;
    ck.corpus_fnv = run.corpus_fnv;
    ck.vocab = run.vocab;
    ck.lstm = read_named(in, "lstm");
    ck.embedding = read_named(in, "embedding");
    ck.decoder = read_named(in, "decoder");
    ck.optim = examples::read_optimizer(in, "optim", path);
  });
  return ck;
}

Named named_parameters(const torch::nn::Module& m) {
  Named out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  return out;
}

}  // namespace char_lm
