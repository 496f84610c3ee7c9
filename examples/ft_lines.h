// The lines a replica under tandem::ft::Manager prints, which the checks and
// ft_bench read (examples/ft_mlp.cc, examples/gpt/fault_tolerant.cc):
//   started age_ms A t T replacement R     (at main: A ms after its process began; T wall ms)
//   step S k K loss L t T                  (each committed step: K replicas took part)
//   failed step S t T: WHY                 (a step committed by none)
//   healed bytes B state S ms M            (after it was healed)
//   late: the job finished at step S ...   (a replacement that came as the job ended)
//   final step S loss L norm N             (the program's own)
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/ft/manager.h"

namespace examples {

inline int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// How long ago this process began (its start time in /proc against the uptime).
inline int64_t process_age_ms() {
  std::ifstream stat("/proc/self/stat"), uptime("/proc/uptime");
  std::string line;
  double up = 0;
  if (!std::getline(stat, line) || !(uptime >> up)) return 0;
  std::istringstream rest(line.substr(line.rfind(')') + 2));
  std::string field;
  for (int f = 3; f <= 22 && rest >> field; ++f) {
    if (f == 22) {
      const double started = std::stod(field) / static_cast<double>(::sysconf(_SC_CLK_TCK));
      return static_cast<int64_t>((up - started) * 1000);
    }
  }
  return 0;
}

// The first line: how long ago the process began, and which replacement of
// its rank it is (tandem-run --replace-failed; 0 for the first).
inline void print_started() {
  const char* replaced = std::getenv("TANDEM_REPLACEMENT_COUNT");
  std::printf("started age_ms %lld t %lld replacement %s\n",
              static_cast<long long>(process_age_ms()), static_cast<long long>(wall_ms()),
              replaced ? replaced : "0");
  std::fflush(stdout);
}

// The step's quorum, and the lines it is worth: "healed ..." after a heal,
// "late: ..." (and false: nothing left to train) for a replacement that
// came as the job ended. `heals`: the heals printed so far.
inline bool begin_step(tandem::ft::Manager& manager, int64_t& heals) {
  try {
    manager.start_step();
  } catch (const tandem::ft::JobFinished& e) {
    std::printf("late: the job finished at step %lld before this replica joined\n",
                static_cast<long long>(e.step()));
    return false;
  }
  if (manager.metrics().heals != heals) {
    heals = manager.metrics().heals;
    std::printf("healed bytes %lld state %lld ms %.1f\n",
                static_cast<long long>(manager.metrics().heal_bytes_received),
                static_cast<long long>(manager.metrics().state_bytes),
                manager.metrics().last_heal_ms);
  }
  return true;
}

// --reference's "K1,K2,...": the replicas each committed step had, as the
// "step S k K" lines of a run say.
inline std::vector<int> quorum_sizes(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoi(item));
  return out;
}

// The step's outcome: "step ..." when committed, else "failed step ...".
inline void print_step(const tandem::ft::Manager& manager, bool committed, int k, double loss) {
  if (committed) {
    std::printf("step %lld k %d loss %.6f t %lld\n", static_cast<long long>(manager.step()), k,
                loss, static_cast<long long>(wall_ms()));
  } else {
    std::printf("failed step %lld t %lld: %s\n", static_cast<long long>(manager.step() + 1),
                static_cast<long long>(wall_ms()), manager.last_error().c_str());
  }
  std::fflush(stdout);
}

}  // namespace examples
