// Stage stamps: where the time of one call goes, stage by stage, across
// both processes. A build configured with -DTANDEM_STAGE_STAMPS=ON stamps
// the steady clock (CLOCK_MONOTONIC: one clock for every process on a
// host) at each stage below; with $TANDEM_STAGES=DIR set, each process
// writes its stamps to DIR/stages.<pid> at exit, one "stage thread ns" line
// each, and tools/echo_stages.py lines up the two processes' files call by
// call (docs/benchmarks.md, rpc_echo). Every other build compiles the
// stamps out: TANDEM_STAGE(s) is nothing.
//
// A stamp costs a clock read and an atomic add (about 40 ns); at most
// kMaxStamps are kept per process.
#pragma once

#ifdef TANDEM_STAGE_STAMPS
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#endif

namespace tandem::rpc::stages {

// The path of one call (the numbers are what the files hold).
enum Stage : int {
  kCallStart = 1,     // start_call: the call's arguments are in
  kCallEncoded = 2,   // its frame encoded and its call registered; about to send
  kPublished = 3,     // a frame's bytes published in a shared-memory ring
  kRingRead = 4,      // a ring's bytes copied out by their reader
  kDelivered = 5,     // the decoded message reaches the agent
  kRequestTaken = 6,  // a pool thread starts on the request
  kHandlerIn = 7,     // the registered function is called
  kHandlerOut = 8,    // and has returned
  kReplyEncoded = 9,  // the answer's frame encoded; about to send
  kCallDone = 10,     // the caller's future completed
  kSpinDone = 11,     // the blocked caller's spin saw it
  kReturned = 12,     // rpc_sync returned (stamped by the bench)
  kPoolTaken = 13,    // a pool thread took a task
  kPoolPosted = 14,   // a task was posted to the pool
  // A distributed backward's path (autograd/engine/):
  kBackwardStart = 15,  // the root's backward() is called
  kRunsSent = 16,       // and has sent its `run` requests
  kGradSent = 17,       // a part sends gradients to another worker
  kGradTaken = 18,      // gradients from another worker reach their send
  kPartStart = 19,      // a worker's part starts counting (run_part)
  kDrainStart = 20,     // a thread starts running a part's ready nodes
  kPartDone = 21,       // a part has run every node it reached
  kBackwardEnd = 22,    // the root's backward() returns
};

#ifdef TANDEM_STAGE_STAMPS
struct Stamps {
  static constexpr size_t kMaxStamps = size_t{1} << 22;
  struct Stamp {
    int32_t stage, thread;
    int64_t ns;
  };
  const char* dir = std::getenv("TANDEM_STAGES");
  std::unique_ptr<Stamp[]> at{dir ? new Stamp[kMaxStamps] : nullptr};
  std::atomic<size_t> count{0};

  ~Stamps() {
    if (!dir) return;
    char path[512];
    std::snprintf(path, sizeof path, "%s/stages.%d", dir, static_cast<int>(::getpid()));
    if (FILE* f = std::fopen(path, "w")) {
      const size_t n = std::min(count.load(), kMaxStamps);
      for (size_t i = 0; i < n; ++i) {
        std::fprintf(f, "%d %d %lld\n", at[i].stage, at[i].thread,
                     static_cast<long long>(at[i].ns));
      }
      std::fclose(f);
    }
  }
};

inline Stamps& stamps() {
  static Stamps s;
  return s;
}

inline void stamp(Stage stage) {
  Stamps& s = stamps();
  if (!s.dir) return;
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  thread_local const int thread = static_cast<int>(::gettid());
  const size_t i = s.count.fetch_add(1, std::memory_order_relaxed);
  if (i < Stamps::kMaxStamps) {
    s.at[i] = {stage, thread, static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec};
  }
}
#define TANDEM_STAGE(s) ::tandem::rpc::stages::stamp(::tandem::rpc::stages::s)
#else
#define TANDEM_STAGE(s) ((void)0)
#endif

}  // namespace tandem::rpc::stages
