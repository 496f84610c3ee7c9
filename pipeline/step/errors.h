#pragma once
// A step's failures as types. What this promises: a pass that fails throws
// PassError (or PassTimeoutError when its input never came), naming the
// pass and its worker; a pass stopped because the step failed somewhere
// else throws StepAborted, an echo of that failure. The stage service
// (stage_service.h) lets the first failure tell the step's other workers,
// whose waiting passes then end as echoes; the driver (pipe.cc) reports the
// cause, never an echo, so it tells them apart with is_step_aborted().
//
// Across workers: a run's error reaches the driver as the rpc layer carries
// it (rpc/errors.h), a code and a text, so the type is gone there. A
// PassTimeoutError keeps its code (it is an rpc::TimeoutError); the other
// two are std::runtime_errors and arrive as rpc::RemoteErrors holding their
// text. StepAborted's text always begins with its marker (kMarker), written
// here and nowhere else, and is_step_aborted() reads a RemoteError's remote
// message for it: the one place where the text stands for the type.
//
// The what() texts are those the pipeline has always given:
//   "step aborted: <why>"
//   "forward of micro-batch 3 through stage 1 on worker2: <cause>"
#include <exception>
#include <stdexcept>
#include <string>

#include "tandem/pipeline/schedule.h"
#include "tandem/rpc/errors.h"

namespace tandem::pipeline::step {

// "forward of micro-batch 3 through stage 1 on worker2": how errors name a pass.
std::string pass_name(const Action& pass, const std::string& worker);

// A pass stopped because its step failed elsewhere, or because this agent
// shut down; `why` is the cause as the worker that saw it put it.
class StepAborted : public std::runtime_error {
 public:
  static constexpr const char* kMarker = "step aborted: ";
  explicit StepAborted(const std::string& why);
  const std::string& why() const { return why_; }

 private:
  std::string why_;
};

// A pass that failed on this worker: its name, then what went wrong.
class PassError : public std::runtime_error {
 public:
  PassError(const Action& pass, const std::string& worker, const std::string& cause);
  const Action& pass() const { return pass_; }

 private:
  Action pass_;
};

// A pass whose input (or output's gradient) did not come within the step's
// pass timeout. An rpc::TimeoutError, so the driver gets it as one.
class PassTimeoutError : public rpc::TimeoutError {
 public:
  PassTimeoutError(const Action& pass, const std::string& worker, const std::string& cause);
  const Action& pass() const { return pass_; }

 private:
  Action pass_;
};

// Whether `error`, a stage worker's run failing, is an echo: a StepAborted
// thrown in this process, or one that came over the wire (an
// rpc::RemoteError whose remote message begins with StepAborted::kMarker).
bool is_step_aborted(const std::exception& error);

}  // namespace tandem::pipeline::step
