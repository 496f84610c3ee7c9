// The progress lines (examples/progress.h).
#include "examples/progress.h"

#include <cstdio>

namespace examples {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void Progress::add(int64_t done, double loss) {
  sum += loss;
  ++since;
  if (done % log_every != 0 && done != steps && done != 1) return;
  const double dt = seconds_since(last_line);
  std::printf("step %lld/%lld  loss %.3f  tokens/s %.0f  elapsed %.1fs\n",
              static_cast<long long>(done), static_cast<long long>(steps), sum / since,
              since * tokens_per_step / dt, seconds_since(started));
  std::fflush(stdout);
  if (!csv.empty()) {
    // Written afresh by a run from step 1, appended to by a resumed one.
    const bool fresh = csv_rows == 0 && !resumed;
    if (FILE* f = std::fopen(csv.c_str(), fresh ? "w" : "a")) {
      if (fresh) std::fprintf(f, "step,loss,tokens_per_s,elapsed_s\n");
      std::fprintf(f, "%lld,%.6f,%.0f,%.3f\n", static_cast<long long>(done), sum / since,
                   since * tokens_per_step / dt, seconds_since(started));
      std::fclose(f);
      ++csv_rows;
    }
  }
  sum = 0;
  since = 0;
  last_line = Clock::now();
}

void report_skipped(const tandem::optim::NonFiniteGuard& guard) {
  if (guard.skipped() == 0) return;
  std::string steps;
  for (int64_t s : guard.skipped_steps()) steps += (steps.empty() ? "" : ", ") + std::to_string(s);
  std::printf("%lld step(s) skipped for a loss or gradient norm that was not finite: %s\n",
              static_cast<long long>(guard.skipped()), steps.c_str());
}

}  // namespace examples
