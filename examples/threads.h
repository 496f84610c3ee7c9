// How many intra-op threads an example process should use.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>

namespace examples {

// Splits this machine's cores among the workers tandem-run started on it
// (LOCAL_WORLD_SIZE), unless OMP_NUM_THREADS says otherwise. LibTorch's
// default, every core in every process, oversubscribes them: on a 2-core
// machine two workers each running 2 intra-op threads beside the RPC
// threads' brief spins made char_lm's steps about 4x slower.
inline void share_cores() {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return;
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  int workers = 1;
  try {
    if (local != nullptr) workers = std::max(1, std::stoi(local));
  } catch (const std::exception&) {
    workers = 1;
  }
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  at::set_num_threads(std::max(1, cores / workers));
}

}  // namespace examples
