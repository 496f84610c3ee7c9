// One timeline for a whole job: with AgentOptions::trace_dir (or
// $TANDEM_TRACE) set, every agent records Chrome trace events and writes
// them to <dir>/tandem-trace-rank<R>.json when it shuts down; `tandem-run
// --trace DIR` joins the workers' files into <dir>/tandem-trace.json, which
// Perfetto (ui.perfetto.dev) and chrome://tracing open.
//
//  1. Events: each call this agent made (a slice on the calling thread, from
//     the call to its answer, "cat":"rpc"), each request it served (a slice
//     on the pool thread, handler to answer), and a flow arrow from the one
//     to the other (flow id = caller rank << 48 | call id). Layers add
//     their own through Tracer::slice.
//  2. Clocks: each process's steady clock in microseconds, moved onto rank
//     0's by an offset measured at start-up: 8 pings to rank 0, and the one
//     with the shortest round trip gives offset = rank0_time - (t0 + t1) / 2,
//     right to within half that round trip (written as "clock_error_us").
//     On one host the clocks are one and the offset comes out within a few
//     microseconds of 0.
//  3. Off, the agent holds no tracer: one null check per call and request.
//     On, an event costs a clock read, a few string copies and one lock
//     (bench: about 1 us). At most kMaxEvents are kept; more are counted
//     as dropped.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tandem::rpc {

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kMaxEvents = 1 << 20;

  Tracer(std::string dir, int rank, std::string worker);
  // A finished slice [start, end) on this thread. flow_out / flow_in: the
  // id of a flow this slice starts or ends (0: none).
  void slice(const std::string& name, const char* cat, Clock::time_point start,
             Clock::time_point end, uint64_t flow_out = 0, uint64_t flow_in = 0,
             const std::string& args_json = {}, long tid = 0);
  // The calling thread's id, as slices name it.
  static long this_thread();
  void set_clock(int64_t offset_us, int64_t error_us);
  // Writes <dir>/tandem-trace-rank<R>.json; returns its path.
  std::string write();
  static int64_t micros(Clock::time_point t);

 private:
  const std::string dir_;
  const int rank_;
  const std::string worker_;
  std::mutex mu_;
  std::vector<std::string> events_;  // one JSON object each
  uint64_t dropped_ = 0;
  int64_t offset_us_ = 0;
  int64_t error_us_ = -1;  // -1: not measured (rank 0, or a world of one)
};

}  // namespace tandem::rpc
