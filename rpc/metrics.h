// Agent::metrics(): what an agent did, counted as it goes (cheap enough to
// leave on: a few atomic adds per call, one lookup of the callee's entry).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "tandem/rpc/transport.h"

namespace tandem::rpc {

// Latencies in log-spaced buckets, four per octave from 1 us (about 19%
// wide: a percentile is the upper edge of its bucket). Thread-safe.
class LatencyHistogram {
 public:
  void record(std::chrono::nanoseconds took);
  uint64_t count() const;
  double percentile_us(double q) const;

 private:
  static constexpr int kBuckets = 4 * 36;  // up to ~19 hours
  std::array<std::atomic<uint64_t>, kBuckets> buckets_{};
};

struct FunctionStats {
  uint64_t calls = 0;   // calls of it this agent made that ended (answered or failed)
  uint64_t failed = 0;  // of those, failed
  double p50_us = 0;    // round trip, from the call to its answer
  double p99_us = 0;
};

struct Metrics {
  uint64_t calls_sent = 0;    // calls this agent made (the layers' own "tandem.*" ones too)
  uint64_t calls_failed = 0;  // of those that ended, failed
  std::map<std::string, uint64_t>
      failures;  // by kind: "Timeout", "RemoteError", "Disconnected" ...
  uint64_t calls_in_flight = 0;
  uint64_t requests_served = 0;  // requests whose handler ran here (one-way ones too)
  uint64_t requests_failed = 0;  // of those, answered with an error (unknown functions too)
  uint64_t bytes_sent = 0;       // frames written to sockets, all connections
  uint64_t bytes_received = 0;   // frames read from sockets
  uint64_t connections = 0;      // open now
  size_t pool_queue = 0;         // tasks waiting for a pool thread
  size_t rrefs_owned = 0;        // values this worker owns for RRefs
  size_t rref_users = 0;         // user RRefs alive here
  std::map<std::string, FunctionStats> functions;  // by callee, for calls this agent made
  std::map<std::string, int64_t> layers;  // what the layers count ("autograd.contexts", ...)
  TransportStats transport;
  // One readable block, a line per figure.
  std::string to_string() const;
};

// The agent's counters (internal; Agent::metrics() reads them).
class MetricsRecorder {
 public:
  void call_sent() { sent_.fetch_add(1, std::memory_order_relaxed); }
  // A call ended: answered (error null) or failed.
  void call_done(const std::string& callee, std::chrono::nanoseconds took,
                 const std::exception_ptr& error);
  void request_served(bool failed) {
    served_.fetch_add(1, std::memory_order_relaxed);
    if (failed) served_failed_.fetch_add(1, std::memory_order_relaxed);
  }
  void fill(Metrics& m) const;

 private:
  struct Fn {
    std::atomic<uint64_t> calls{0};
    std::atomic<uint64_t> failed{0};
    LatencyHistogram latency;
  };
  Fn& entry(const std::string& callee);

  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> failed_{0};
  std::atomic<uint64_t> served_{0};
  std::atomic<uint64_t> served_failed_{0};
  mutable std::shared_mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<Fn>> fns_;
  std::map<std::string, uint64_t> failures_;  // under mu_ (unique)
};

}  // namespace tandem::rpc
