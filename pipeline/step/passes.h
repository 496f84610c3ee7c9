#pragma once
// The four passes a stage worker runs (schedule.h: F, B, and zero-bubble's
// I and W), each one function over the worker's state for the step
// (StepState). What they promise: run in a valid schedule's order, they
// compute each micro-batch's forward and exactly its gradients, and every
// stage before or after gets what it waits for (an input gradient of zeros
// where the output got none). A pass talks to the neighbouring stages only
// through PassIo: it takes its input or its output's gradient, sends its
// output or its input's gradient on, and says when it starts running
// (waiting before that is bubble). The stage service (stage_service.cc)
// runs them in the order the driver sent and implements PassIo over the
// step's mailbox; I and W's graph surgery is split_backward.h's.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/pipeline/pipe.h"
#include "tandem/pipeline/step/messages.h"
#include "tandem/pipeline/step/split_backward.h"

namespace tandem::nn {
struct Served;
}

namespace tandem::pipeline::step {

// One pass's link to the rest of the step: the stages before and after
// its own, for its own micro-batch.
class PassIo {
 public:
  virtual ~PassIo() = default;
  // This pass's input (kActivation, from the stage before) or its output's
  // gradient (kGradient, from the stage after). Waits; throws
  // PassTimeoutError or StepAborted (errors.h).
  virtual at::Tensor take(Slot slot) = 0;
  // `t` to the worker holding `stage` (the next or the previous one).
  virtual void send(Slot slot, int64_t stage, at::Tensor t) = 0;
  // The pass runs from here: the time before was spent waiting.
  virtual void running() = 0;
};

// What one micro-batch leaves on a stage between its forward and backward.
struct Stash {
  at::Tensor input;   // a leaf (requires grad past stage 0)
  at::Tensor output;  // the stage's output, or the weighted loss on the last stage
  // Between a split backward's I and W passes:
  at::Tensor grad;                   // the output's gradient, for a W with no work
  std::shared_ptr<WeightWork> work;  // null: W runs the whole parameter backward
  bool input_done = false;
};

// A worker's state over one step.
struct StepState {
  // The request's stages and, on the last stage's worker when training,
  // its loss. std::invalid_argument for a module that is not a
  // RemoteModule's, or an unknown loss (naming `worker`).
  StepState(const RunRequest& request, const std::string& worker);

  const RunRequest& request;
  const int64_t last;  // the last stage
  std::map<int64_t, std::shared_ptr<nn::Served>> served;
  std::map<int64_t, std::vector<at::Tensor>> params;  // per stage: those that require grad
  LossFn loss;  // set on the last stage's worker when training
  std::map<std::pair<int64_t, int64_t>, Stash> stash;  // by (stage, micro-batch)
  std::map<int64_t, std::vector<at::Tensor>> sums;     // per stage, per parameter: gradients so far
  at::Tensor losses;                // [chunks] double: the last stage's, NaN elsewhere
  std::vector<at::Tensor> outputs;  // forwards only, on the last stage's worker
  int64_t peak = 0;                 // most micro-batches stashed at once
};

// F: the stage's forward of the micro-batch; training, it is stashed, and
// on the last stage the loss computed.
void forward_pass(StepState& state, const Action& pass, PassIo& io);
// B: the whole backward: the parameters' and the input's gradients.
void backward_pass(StepState& state, const Action& pass, PassIo& io);
// I: the input's gradient only; W comes later.
void input_grad_pass(StepState& state, const Action& pass, PassIo& io);
// W: the parameters' gradients, after the micro-batch's I.
void weight_grad_pass(StepState& state, const Action& pass, PassIo& io);
// The one of the four `pass` names.
void run_pass(StepState& state, const Action& pass, PassIo& io);

// At the end of the step: the summed parameter gradients into distributed
// autograd context `context`, for DistributedOptimizer::step.
void hand_over_gradients(StepState& state, rpc::Agent& agent, uint64_t context);

}  // namespace tandem::pipeline::step
