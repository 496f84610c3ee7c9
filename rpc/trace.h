// One timeline for a whole job: with AgentOptions::trace_dir (or
// $TANDEM_TRACE) set, every worker records Chrome trace events and writes
// them to <dir>/tandem-trace-rank<R>.json; `tandem-run --trace DIR` joins
// the node's files into <dir>/tandem-trace.json, and `tandem-trace merge`
// joins files from several nodes. Perfetto (ui.perfetto.dev) and
// chrome://tracing open them.
//
//  1. One tracer per (directory, rank) in a process (Tracer::open): the
//     agent and the layers without one (DDP over a process group) share it;
//     its file is written when the agent shuts down and again, if events
//     came after, when the last holder lets it go.
//  2. Events, "cat" naming the layer:
//     - rpc: each call this agent made: a slice on the calling thread from
//       the call to its answer; a call that overlapped another call of the
//       same thread (rpc_async) is instead a 1 µs "send" slice there plus
//       an async span ("rpc.async") from the call to its answer. A flow
//       arrow ("call") goes from the call to the request it became (flow id
//       = caller rank << 48 | call id), and one ("reply") from the served
//       request's end back into the call's (not for an async span).
//     - rpc.serve: each request served, on the thread that answered it.
//     - autograd: a backward() on the root; each worker's part as an async
//       span ("autograd.part"); each run of ready nodes on the thread that
//       ran them.
//     - optim: DistributedOptimizer::step on the caller, and the local step
//       of each owner.
//     - ddp: each bucket's allreduce as an async span from its launch to its
//       completion ("ddp.bucket").
//     - pipeline: each pass (F, B, I, W of a micro-batch) on its worker, and
//       each stage's data-parallel average ("allreduce@1").
//     - agent: the agent's init and shutdown, each with its phases inside
//       it ("init: rendezvous", "shutdown: barrier", ...).
//     - rpc.connect: each dial of a peer that got as far as the handshake's
//       first message ("connect").
//  3. Clocks: each process's steady clock in microseconds, moved onto rank
//     0's by an offset measured at start-up: 8 pings to rank 0, and the one
//     with the shortest round trip gives offset = rank0_time - (t0 + t1) / 2,
//     right to within half that round trip (written as "clock_error_us").
//     On one host the clocks are one and the offset comes out within a few
//     microseconds of 0. A process with no agent (DDP alone) keeps its own
//     clock ("clock_error_us": -1): exact on one host, unaligned across.
//  4. Off, the layers hold no tracer: one null check per event site. On, an
//     event costs a clock read, a few string copies and one lock
//     (rpc_bench's trace_event line: about 0.6 µs). At most kMaxEvents are kept; more are counted
//     as dropped.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tandem::rpc {

// The arrows a slice has (ids; 0: none): a call leaving at its start
// (call_out) and arriving at a served slice's start (call_in); the answer
// leaving in a served slice's last microsecond (reply_out) and arriving in
// the call's (reply_in).
struct TraceFlows {
  uint64_t call_out = 0, call_in = 0, reply_out = 0, reply_in = 0;
};

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kMaxEvents = 1 << 20;

  // This process's tracer for `rank` writing into `dir`: the one already
  // open, or a new one. `worker` names the process in the timeline (the
  // agent's name replaces a layer's "rank R").
  static std::shared_ptr<Tracer> open(const std::string& dir, int rank, const std::string& worker);
  // open($TANDEM_TRACE, rank, "rank R"), or null when $TANDEM_TRACE is unset.
  static std::shared_ptr<Tracer> from_env(int rank);

  Tracer(std::string dir, int rank, std::string worker);
  ~Tracer();  // writes the file again if events came after the last write()
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  using Flows = TraceFlows;
  static constexpr uint64_t kReplyFlow = 1ull << 47;  // an answer's flow id: its call's | this
  // A finished slice [start, end) on a thread (0: this one).
  void slice(const std::string& name, const char* cat, Clock::time_point start,
             Clock::time_point end, const Flows& flows = {}, const std::string& args_json = {},
             long tid = 0);
  // A finished async span [start, end): its own track in the process,
  // shared by spans of the same cat and name that do not overlap.
  void span(const std::string& name, const char* cat, uint64_t id, Clock::time_point start,
            Clock::time_point end, const std::string& args_json = {});
  // The calling thread's id, as slices name it.
  static long this_thread();
  void set_clock(int64_t offset_us, int64_t error_us);
  void set_worker(const std::string& worker);
  int rank() const { return rank_; }
  const std::string& dir() const { return dir_; }
  // Writes <dir>/tandem-trace-rank<R>.json; returns its path.
  std::string write();
  static int64_t micros(Clock::time_point t);

 private:
  void add_locked(std::string event);

  const std::string dir_;
  const int rank_;
  std::mutex mu_;
  std::string worker_;
  std::vector<std::string> events_;  // one JSON object each
  uint64_t dropped_ = 0;
  bool dirty_ = false;  // events since the last write()
  int64_t offset_us_ = 0;
  int64_t error_us_ = -1;  // -1: not measured (rank 0, a world of one, no agent)
};

// A slice from construction to destruction, on this thread; nothing at all
// when the tracer is null. Name it (set_name) only when on().
class TraceScope {
 public:
  TraceScope(Tracer* tracer, const char* cat) : tracer_(tracer), cat_(cat) {
    if (tracer_) start_ = Tracer::Clock::now();
  }
  ~TraceScope() {
    if (tracer_) finish();
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;
  bool on() const { return tracer_ != nullptr; }
  void set_name(std::string name) { name_ = std::move(name); }
  void set_args(std::string json) { args_ = std::move(json); }

 private:
  void finish() noexcept;

  Tracer* tracer_;
  const char* cat_;
  Tracer::Clock::time_point start_;
  std::string name_, args_;
};

}  // namespace tandem::rpc
