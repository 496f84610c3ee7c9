// char_lm's common ground: the model's sizes, the flags' values (Config) and
// where the processes are (Place). Every piece of examples/char_lm/ includes
// it; it includes none of them. The program itself is described in main.cc.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "examples/flags.h"

namespace char_lm {

using Clock = std::chrono::steady_clock;

constexpr int64_t kBatch = 32;
constexpr int64_t kWindow = 64;  // characters predicted per sequence (+1 read)
constexpr int64_t kEmbed = 32;
constexpr int64_t kHidden = 128;

struct Config {
  int64_t steps = 400;
  int64_t checkpoint_every = 100;
  int64_t seed = 0;
  int64_t log_every = 25;
  double lr = 6e-3;
  std::string corpus;  // empty: kDefaultCorpus
  std::string checkpoint = "char_lm.ckpt";
  std::string mode = "single";    // or "hybrid", "pipeline"
  std::string schedule = "1f1b";  // --mode pipeline's
  std::string losses;             // --losses: each progress line also goes there as CSV
  bool resume = false;
  // A step whose loss or gradient norm is not finite: "stop" or "skip"
  // (tandem/optim/nonfinite.h); and, to try it, a step whose batch gets a
  // poisoned target (0: none).
  std::string on_nonfinite = "stop";
  int64_t nan_at = 0;
  bool hybrid() const { return mode == "hybrid"; }
  bool pipeline() const { return mode == "pipeline"; }
};

// Where the processes are: trainers 0..trainers-1, then the parameter server.
struct Place {
  int rank = 0;
  int trainers = 1;
  std::string server() const { return "worker" + std::to_string(trainers); }
};

using examples::UsageError;

}  // namespace char_lm
