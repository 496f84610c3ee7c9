#pragma once
// Data parallelism over pipelines: a stage's gradients averaged over the
// same stage of the other replicas (its data-parallel group), on the worker
// that holds it. What it promises:
//  - The average of a stage starts as soon as the stage's last gradient
//    pass of the step has run (its last B, or its last W under zero-bubble),
//    so it runs while this worker and the others still run passes; the
//    worker waits for it only at the end of its step.
//  - It is bucketed as DDP's gradients are: the stage's parameters in
//    reverse order, a bucket closed once it holds at least the cap (and at
//    a change of dtype or device), one all_reduce a bucket, divided by the
//    group's size first. Every replica's stage has the same parameters and
//    runs the same passes, so the buckets and their order agree.
//  - A gradient that a stage accumulated in earlier steps of the same
//    distributed autograd context (Pipe::no_sync) is part of the average;
//    the context then holds the average.
//  - A parameter that no replica gave a gradient stays without one (a
//    count travels with each bucket), as with DDP's unused parameters.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "tandem/autograd/autograd.h"
#include "tandem/ddp/process_group.h"
#include "tandem/pipeline/step/mailbox.h"
#include "tandem/pipeline/step/messages.h"
#include "tandem/pipeline/step/passes.h"

namespace tandem::pipeline::step {

class GradSync {
 public:
  // Inactive (nothing to do) unless the request trains and asks for
  // averaging; then the group must be registered with `agent` under the
  // note's name (std::invalid_argument naming the worker and the group
  // otherwise). A group of one replica averages nothing: inactive too. Times are in µs since `t0`,
  // when the step began here. The waits end early when the step is aborted (`box`): a replica whose
  // step failed elsewhere would never join the average.
  GradSync(rpc::Agent& agent, const RunRequest& request, uint64_t context,
           std::shared_ptr<Mailbox> box, std::chrono::steady_clock::time_point t0);
  ~GradSync();
  bool active() const { return group_ != nullptr; }

  // After pass `i` of the request's list has run: launches the average of
  // its stage when it was the stage's last gradient pass.
  void after_pass(StepState& state, size_t i);
  // Waits for every average launched (throws ddp::CollectiveError naming
  // who is gone, StepAborted when the step failed elsewhere meanwhile) and
  // puts them into the context; the stages' sums are then taken, so
  // hand_over_gradients adds nothing twice.
  void finish(StepState& state);

  const AllReduceTimes& times() const { return times_; }

 private:
  struct Bucket;
  void launch(StepState& state, int64_t stage);
  double now_us() const;

  rpc::Agent& agent_;
  const RunRequest& request_;
  uint64_t context_;
  std::shared_ptr<Mailbox> box_;
  std::chrono::steady_clock::time_point t0_;
  std::shared_ptr<ddp::ProcessGroup> group_;
  std::map<int64_t, size_t> last_grad_pass_;  // per stage
  // What earlier steps of the context left (under no_sync), read once at
  // the first launch: nothing adds to the context until finish() is over.
  std::optional<autograd::Gradients> earlier_;
  std::vector<std::shared_ptr<Bucket>> buckets_;
  AllReduceTimes times_;
};

}  // namespace tandem::pipeline::step
