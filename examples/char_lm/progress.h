// char_lm's progress lines (and --losses' CSV rows), printed by the
// training loops (train.cc, train_pipeline.cc) after each step's loss.
#pragma once

#include <cstdint>

#include "examples/char_lm/config.h"

namespace char_lm {

double seconds_since(Clock::time_point t0);

// The progress lines: the mean loss since the last one, every log_every
// steps, after the first and after the last.
struct Progress {
  const Config& cfg;
  Clock::time_point started;
  int64_t tokens_per_step;  // of all trainers
  double sum = 0;
  int64_t since = 0;
  int64_t csv_rows = 0;
  Clock::time_point last_line = Clock::now();

  void add(int64_t done, double loss);
};

}  // namespace char_lm
