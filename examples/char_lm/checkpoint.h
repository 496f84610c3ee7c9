// char_lm's checkpoint: what a single-mode run saves every --checkpoint-every
// steps and --resume loads. main.cc loads it (and checks it against the
// corpus and the flags) before training; train.cc fills and saves it.
//
// The checkpoint is ONE file (torch::serialize archive, written to PATH.tmp
// and renamed over PATH), with these keys:
//   step, seed          int: steps done, and the seed they were drawn with
//   corpus_fnv, vocab   int, string: FNV-1a hash of the text and its vocabulary;
//                       resuming on another text is refused
//   lstm, embedding, decoder
//                       archives of named tensors: the trainer's LSTM and the
//                       two RemoteModules' state_dict()
//   optim               the DistributedOptimizer's state_dict() as
//                       optim::state_to_bytes gives it (a uint8 tensor)
//
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <string>

#include "tandem/optim/optimizer_state.h"

namespace char_lm {

using Named = std::map<std::string, at::Tensor>;  // as examples::Named

struct Checkpoint {
  int64_t step = 0;
  int64_t seed = 0;
  uint64_t corpus_fnv = 0;
  std::string vocab;
  Named lstm, embedding, decoder;
  tandem::optim::OptimizerState optim;
};

// Written to PATH.tmp and renamed over PATH.
void save_checkpoint(const Checkpoint& ck, const std::string& path);
// A missing or unreadable checkpoint throws UsageError.
Checkpoint load_checkpoint(const std::string& path);

Named named_parameters(const torch::nn::Module& m);

}  // namespace char_lm
