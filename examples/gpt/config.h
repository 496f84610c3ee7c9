// gpt's common ground: the flags' values (Config) and where this process
// is in the job (Place). Every piece of examples/gpt/ includes it; it
// includes none of them. The program itself is described in main.cc.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "examples/flags.h"

namespace gpt {

using Clock = std::chrono::steady_clock;
using examples::UsageError;

struct Config {
  // The job's layout: pp pipeline stages times dp data-parallel replicas,
  // each stage's layers split over tp tensor-parallel ranks.
  int64_t pp = 2, dp = 2, tp = 1;
  bool recompute = false;  // each block's activations made again in backward
  // With --tp: the regions between the split layers hold this rank's piece
  // of the sequence (Megatron's sequence parallelism).
  bool sequence_parallel = false;
  double dropout = 0;  // on each block's attention probabilities and residual branches
  std::string schedule = "1f1b";
  int64_t chunks = 4;  // micro-batches per replica and step
  // The model.
  int64_t layers = 4, dim = 64, heads = 4, context = 64;
  // Training.
  int64_t steps = 600;  // the schedule's length
  int64_t stop_at = 0;  // stop after this step (0: --steps), as if interrupted
  int64_t batch = 32;   // sequences per step, over all replicas
  double lr = 3e-3;
  int64_t warmup = 30;  // steps of linear warm-up before the cosine decay
  double clip = 1.0;    // global gradient norm
  int64_t seed = 0;
  int64_t log_every = 25;
  std::string corpus;                   // empty: /usr/share/common-licenses/*
  std::string losses;                   // each progress line also as a CSV row
  std::string checkpoint = "gpt.ckpt";  // a directory of steps (checkpoint.h)
  int64_t checkpoint_every = 100;
  bool checkpoint_sync = false;  // write in the step, not in the background
  bool resume = false;
  int64_t sample = 200;  // characters generated at the end
  // ZeRO: 1 shards each stage's optimizer state over its replicas; 0 none.
  int64_t zero = 0;
  // Failures: how long a silent worker may be before it counts as stalled
  // (seconds; -1: the agent's default, $TANDEM_PEER_TIMEOUT or 30; 0:
  // never); a damaged newest checkpoint refused instead of passed over;
  // what a step whose loss or gradient norm is not finite does ("stop" or
  // "skip"); and, for trying that, a step whose batch gets a poisoned token.
  int64_t peer_timeout = -1;
  bool strict_resume = false;
  std::string on_nonfinite = "stop";
  int64_t nan_at = 0;
  // pp x dp under tandem::ft::Manager (fault_tolerant.cc): each pipeline row
  // a replica that trains on through a failure; --reference K1,K2,...
  // trains the same in one process over the quorums a run printed.
  bool ft = false;
  int64_t min_replicas = 1;  // --ft: a quorum's fewest rows
  std::string reference;
};

// `rows` (a batch's inputs, token ids) with its first token poisoned
// (model.h: the embedding makes it NaN) when `step` + 1 is cfg.nan_at.
inline void poison_if_asked(const Config& cfg, int64_t step, at::Tensor& rows) {
  if (cfg.nan_at > 0 && step + 1 == cfg.nan_at) {
    rows = rows.clone();
    rows.select(0, 0).select(0, 0).fill_(-1);
  }
}

// Where this process is: its rank, and its coordinates in the mesh
// (pp, dp, tp). Replica d's drivers are the ranks at (0, d, t), one a
// tensor-parallel rank.
struct Place {
  int rank = 0;
  int stage = 0;    // coordinate along pp
  int replica = 0;  // coordinate along dp
  bool driver() const { return stage == 0; }
};

}  // namespace gpt
