// char_lm's training loops, run by main.cc on each trainer once the world is
// up and the flags, corpus and checkpoint passed: train() for --mode single
// and hybrid (train.cc), train_pipeline() for --mode pipeline
// (train_pipeline.cc). Each prints its progress, the final loss and a
// sample, and answers the exit code.
#pragma once

#include <ATen/core/ivalue.h>

#include <mutex>
#include <optional>

#include "examples/char_lm/checkpoint.h"
#include "examples/char_lm/config.h"
#include "examples/char_lm/corpus.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rref.h"

namespace char_lm {

using ModuleRef = tandem::rpc::RRef<c10::IValue>;

// --mode hybrid: worker0's references to the shared modules, for the other
// trainers' "shared_module" calls (answered once worker0 made them).
struct Shared {
  std::mutex mu;
  std::optional<tandem::rpc::Promise<ModuleRef>> embedding{tandem::rpc::Promise<ModuleRef>()};
  std::optional<tandem::rpc::Promise<ModuleRef>> decoder{tandem::rpc::Promise<ModuleRef>()};
};

int train(const Config& cfg, const Corpus& corpus, const std::optional<Checkpoint>& resume,
          Clock::time_point started, const Place& at, Shared& shared);

// --mode pipeline: the same model as two pipeline stages, Embedding + LSTM
// on worker0 and the decoder on the server, each batch in 4 micro-batches
// by --schedule (1F1B unless told); Adam with clipping as in single mode,
// from the same initial parameters. No checkpoint.
int train_pipeline(const Config& cfg, const Corpus& corpus, Clock::time_point started,
                   const Place& at);

}  // namespace char_lm
