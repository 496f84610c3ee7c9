// The training examples' progress lines (char_lm, gpt): every log_every
// steps (and after the first and the last), the mean loss since the last
// line, tokens per second and the time since the start; with a CSV path,
// each line also as a row there.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "tandem/optim/nonfinite.h"

namespace examples {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0);

struct Progress {
  int64_t steps;      // the last step
  int64_t log_every;  // a line every N steps
  std::string csv;    // empty: no CSV
  bool resumed;       // a resumed run appends to the CSV, a fresh one starts it
  Clock::time_point started;
  int64_t tokens_per_step;  // of the whole job
  double sum = 0;
  int64_t since = 0;
  int64_t csv_rows = 0;
  Clock::time_point last_line = Clock::now();

  // Step `done` (1-based) had loss `loss`.
  void add(int64_t done, double loss);
};

// Prints "N step(s) skipped for ...: s1, s2" when `guard` skipped any
// (--on-nonfinite skip).
void report_skipped(const tandem::optim::NonFiniteGuard& guard);

}  // namespace examples
