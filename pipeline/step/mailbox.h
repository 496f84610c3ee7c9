#pragma once
// Mailbox: what other workers sent this one for one step, stage inputs and
// output gradients by (slot, stage, micro-batch), until a pass of the
// step's run takes them. What it promises: put() and abort() never block
// for long (the stage service calls them on the agent's loop thread);
// take() waits until its item is there, the step is aborted (StepAborted,
// errors.h) or the timeout passes (no value: the caller names the pass).
// The stage service (stage_service.cc) keeps one per step and decides
// when it goes.
#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "tandem/pipeline/step/messages.h"

namespace tandem::pipeline::step {

class Mailbox {
 public:
  using Clock = std::chrono::steady_clock;

  void put(Slot slot, int64_t stage, int64_t chunk, at::Tensor t);
  // The step failed elsewhere: waiting takes end, now and from now on. The
  // first reason stays.
  void abort(const std::string& why);
  // The item, taken out; std::nullopt when it did not come within `timeout`.
  // Throws StepAborted once the step is aborted, even with the item here.
  std::optional<at::Tensor> take(Slot slot, int64_t stage, int64_t chunk,
                                 std::chrono::milliseconds timeout);
  // Waits until `ready()` holds (asked after every put, abort and wake),
  // the step is aborted (StepAborted), or `timeout` passes (false). For
  // waits on something else than an item: a collective, say.
  bool wait_until(const std::function<bool()>& ready, std::chrono::milliseconds timeout);
  // What a wait_until waits for may have changed: it asks again.
  void wake();

  // The stage service's, under its own lock: whether the step's run is
  // here, and until when an unclaimed box is kept.
  bool claimed = false;
  Clock::time_point expires{};

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, at::Tensor> items_;
  std::string aborted_;  // non-empty: the step failed elsewhere
};

}  // namespace tandem::pipeline::step
