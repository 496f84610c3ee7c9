#pragma once
// The messages of a pipeline step, as types: what the driver (pipe.cc)
// and the stage workers (stage_service.h) send each other. Each has one
// encoder, to what travels (the rpc layer's IValues, in the positional
// layout the pipeline has always used), and one decoder, which checks every
// field of what a peer sent before anything reads it: a message that is
// short, long, of the wrong types or shapes, or whose numbers are out of
// range or disagree with each other, is refused with std::invalid_argument
// naming the message and the field ("tandem.pipe.run: header.me is 5, not
// in 0 .. 1"), never read out of range.
//
//   driver -> each worker   tandem.pipe.run    RunRequest (StepHeader, PassList, ...)
//   worker -> driver        its answer         RunReply (PassTimes, ...)
//   worker -> worker        tandem.pipe.put    Handoff: an activation or a gradient
//   anyone -> worker        tandem.pipe.abort  AbortNote: the step failed
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/pipeline/schedule.h"
#include "tandem/rpc/rref.h"

namespace tandem::pipeline::step {

constexpr const char* kRunFn = "tandem.pipe.run";
constexpr const char* kPutFn = "tandem.pipe.put";
constexpr const char* kAbortFn = "tandem.pipe.abort";

// What a hand-off carries: a stage's input (from the stage before) or its
// output's gradient (from the stage after).
enum Slot : int64_t { kActivation = 0, kGradient = 1 };

// Pass timeouts from the wire are kept within a day, so that deadlines
// cannot overflow.
constexpr std::chrono::milliseconds kMaxPassTimeout{int64_t{24} * 3600 * 1000};

// tandem.pipe.run's first argument, 7 int64 slots in this order.
struct StepHeader {
  int64_t step = 0;                      // > 0: the driver's rank << 40 | its count
  int64_t chunks = 0;                    // micro-batches
  int64_t stages = 0;                    // a multiple of workers
  int64_t workers = 0;                   // the workers holding stages
  int64_t me = 0;                        // the receiving worker's index, 0 .. workers - 1
  std::chrono::milliseconds timeout{0};  // how long a pass waits for its input
  bool train = true;                     // false: forwards only, the last stage answers its outputs

  int64_t worker_of(int64_t stage) const { return stage % workers; }
  bool holds_last() const { return me == worker_of(stages - 1); }

  std::vector<int64_t> encode() const;
  // Checks: 7 slots; step > 0; chunks and stages in 1 .. INT_MAX (a pass
  // holds them as ints); workers in 1 .. stages, dividing stages; me a
  // worker; timeout > 0 (one past a day becomes a day); train 0 or 1.
  static StepHeader decode(const std::vector<int64_t>& slots);
};

// The passes one worker runs, in order: an [n, 3] int64 tensor on the CPU,
// one row (kind, stage, micro-batch) a pass.
struct PassList {
  std::vector<Action> passes;

  at::Tensor encode() const;
  // Checks the tensor's shape, dtype and device, and each row: a kind of
  // pass, one of `held` (the stages the worker holds), a micro-batch in
  // 0 .. chunks - 1.
  static PassList decode(const at::Tensor& t, const std::vector<int64_t>& held, int64_t chunks);
};

// When one pass ran, in µs since its worker began the step.
struct PassTime {
  Action pass;
  double start_us = 0, end_us = 0;
};

// Every pass's time, in the order run: an [n, 5] double tensor on the CPU,
// rows (kind, stage, micro-batch, start µs, end µs).
struct PassTimes {
  std::vector<PassTime> times;

  at::Tensor encode() const;
  // Checks the tensor's shape, dtype and device; that row i is the pass
  // `sent[i]` (a row a pass the worker was sent); that its times are
  // finite, not negative, and end no earlier than they start. `from` names
  // the message in errors.
  static PassTimes decode(const at::Tensor& t, const std::vector<Action>& sent,
                          const std::string& from);
};

// How a training step's gradients are averaged over the data-parallel
// replicas of this worker's stages: two arguments of tandem.pipe.run, the
// group's name (empty: no averaging) and [sync, bucket_cap_bytes].
struct DataParallelNote {
  std::string group;  // ddp::find_group's name on the worker; empty: none
  bool sync = true;   // false: accumulate only (Pipe::no_sync)
  int64_t bucket_cap_bytes = 25 << 20;

  bool averages() const { return !group.empty() && sync; }
};

// When a stage's gradients were averaged: rows (stage, launch µs, done µs)
// of an [n, 3] double tensor, on the worker's clock of PassTimes.
struct AllReduceTime {
  int64_t stage = 0;
  double launch_us = 0, done_us = 0;
};
struct AllReduceTimes {
  std::vector<AllReduceTime> times;

  at::Tensor encode() const;
  // Checks the tensor's shape, dtype and device; each row's stage one of
  // `held`, at most one row a stage; its times finite, not negative, done
  // no earlier than launched.
  static AllReduceTimes decode(const at::Tensor& t, const std::vector<int64_t>& held,
                               const std::string& from);
};

// tandem.pipe.run: run these passes of a step on the stages this worker holds.
struct RunRequest {
  StepHeader header;
  std::vector<int64_t> stage_ids;               // me, me + workers, ... (all of this worker's)
  std::vector<rpc::RRef<c10::IValue>> modules;  // theirs, in that order
  PassList passes;
  std::vector<std::string> worker_names;  // by worker index
  std::string loss;                       // pipeline::register_loss's name
  std::vector<at::Tensor> inputs;         // per micro-batch, to the worker of stage 0; else none
  std::vector<at::Tensor> targets;  // per micro-batch, to the last stage's when training; else none
  std::vector<double> weights;      // per micro-batch: its share of the batch (0 .. 1)
  DataParallelNote data_parallel;

  std::vector<c10::IValue> encode() const;
  // Checks: 11 arguments of their types; the header (StepHeader::decode);
  // the stages are exactly this worker's, with a module each; the passes
  // (PassList::decode); a non-empty name per worker; as many inputs,
  // targets and weights as the worker should get, the weights finite and
  // within 0 .. 1; the data-parallel note's flags (sync 0 or 1, a bucket
  // cap of at least one byte).
  static RunRequest decode(const std::vector<c10::IValue>& args);
};

// A worker's answer to tandem.pipe.run.
struct RunReply {
  // [chunks] double: each micro-batch's loss on the last stage's worker, NaN elsewhere.
  at::Tensor losses;
  PassTimes times;
  int64_t peak_stash = 0;           // most micro-batches held between forward and backward
  std::vector<at::Tensor> outputs;  // forwards only, on the last stage's worker: per micro-batch
  AllReduceTimes allreduces;        // when its stages' gradients were averaged, if they were

  c10::IValue encode() const;
  // Checks it against `request`, the one it answers: a tuple of 5 of their
  // types; losses [chunks] double on the CPU; the times
  // (PassTimes::decode against the passes sent); peak_stash within 0 ..
  // the passes sent; as many defined outputs as the worker owes; the
  // all-reduce times (AllReduceTimes::decode), none unless the request
  // asked for averaging.
  static RunReply decode(const c10::IValue& v, const RunRequest& request);
};

// tandem.pipe.put: an activation or a gradient for micro-batch `chunk` of
// `stage`, sent to the worker holding it; it keeps a step whose run has not
// come `timeout` longer.
struct Handoff {
  int64_t step = 0;
  std::chrono::milliseconds timeout{0};
  Slot slot = kActivation;
  int64_t stage = 0;
  int64_t chunk = 0;
  at::Tensor tensor;

  std::vector<c10::IValue> encode() const;
  // Checks: 6 arguments of their types; step > 0; timeout > 0 (past a day:
  // a day); slot 0 or 1; stage and chunk not negative.
  static Handoff decode(const std::vector<c10::IValue>& args);
};

// tandem.pipe.abort: `step` failed, `why` says how.
struct AbortNote {
  int64_t step = 0;
  std::chrono::milliseconds timeout{0};
  std::string why;

  std::vector<c10::IValue> encode() const;
  // Checks: 3 arguments of their types; step > 0; timeout > 0 (past a day:
  // a day); why not empty.
  static AbortNote decode(const std::vector<c10::IValue>& args);
};

}  // namespace tandem::pipeline::step
