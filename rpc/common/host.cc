#include "tandem/rpc/common/host.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace tandem::rpc {
namespace {

std::atomic<bool> g_retained{false};

bool user_tuned_malloc() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_") ||
      std::getenv("MALLOC_ARENA_MAX")) {
    return true;
  }
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables && std::strstr(tunables, "glibc.malloc.")) return true;
  const char* retain = std::getenv("TANDEM_RETAIN_MEMORY");
  return retain && std::strcmp(retain, "0") == 0;
}

bool apply() {
#if defined(__GLIBC__)
  if (user_tuned_malloc()) return false;
  // The mmap threshold's ceiling is half a thread heap (32 MiB on 64-bit);
  // setting either value turns off glibc's own adjustment of both, so both
  // are set: the mmap threshold alone would leave trimming at 128 KiB.
  constexpr int kMmapThreshold = 32 << 20;
  constexpr int kTrimThreshold = 256 << 20;
  // One arena: a step's tensors are made on whichever pool thread runs its
  // handler, and each thread's own arena (64 MiB heaps) would warm up apart.
  // Small blocks still come from each thread's cache without the lock.
  return mallopt(M_MMAP_THRESHOLD, kMmapThreshold) == 1 &&
         mallopt(M_TRIM_THRESHOLD, kTrimThreshold) == 1 && mallopt(M_ARENA_MAX, 1) == 1;
#else
  return false;
#endif
}

}  // namespace

bool retain_freed_memory() {
  static std::once_flag once;
  std::call_once(once, [] { g_retained.store(apply()); });
  return g_retained.load();
}

bool freed_memory_retained() { return g_retained.load(); }

void set_num_threads(int n) {
  if (n < 1)
    throw std::invalid_argument("set_num_threads: n must be >= 1, not " + std::to_string(n));
  at::set_num_threads(n);
  // Only where LibTorch's BLAS is OpenBLAS (already loaded with it).
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    fn(n);
}

const std::string& boot_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string line;
    std::getline(in, line);
    return line;
  }();
  return id;
}

}  // namespace tandem::rpc
