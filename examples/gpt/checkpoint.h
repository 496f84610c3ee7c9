// gpt's checkpoint: ONE file, written by rank 0 every --checkpoint-every
// steps and at the end (to PATH.tmp, renamed over PATH), that --resume
// loads on every driver. A torch::serialize archive with these keys:
//   step, seed            int: steps done, and the seed they were drawn with
//   corpus_fnv, vocab     the text's FNV-1a hash and vocabulary (another text is refused)
//   shape                 int list: layers, dim, heads, context (another model is refused)
//   counts                int list: layers per pipeline stage, in stage order
//   model                 named tensors, the whole model's names ("3.attn.qkv.weight")
//   optim                 replica 0's DistributedOptimizer state, each part's
//                         rank replaced by its owner's stage worker index
//                         (its pp coordinate), so any replica can take it
//                         (optim/optimizer_state.h's format, hash-checked)
// Every replica's parameters and optimizer state are the same (they average
// their gradients), so one copy is the job's; the LR schedule is a function
// of the step, and the batches of step s are a function of (seed, s), so a
// resumed run goes on exactly as an uninterrupted one would, with any --dp
// (the global batch stays --batch). A checkpoint of another --pp, schedule
// layout or model is refused; reshaping a pipeline is not done here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "examples/gpt/model.h"
#include "tandem/optim/optimizer_state.h"

namespace gpt {

struct Checkpoint {
  int64_t step = 0;
  int64_t seed = 0;
  uint64_t corpus_fnv = 0;
  std::string vocab;
  std::vector<int64_t> shape;   // layers, dim, heads, context
  std::vector<int64_t> counts;  // layers per stage
  Named model;
  tandem::optim::OptimizerState optim;
};

void save_checkpoint(const Checkpoint& ck, const std::string& path);
// A missing or unreadable checkpoint throws UsageError.
Checkpoint load_checkpoint(const std::string& path);

}  // namespace gpt
