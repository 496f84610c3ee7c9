#pragma once
// The stage service: the pipeline's part of every agent (an
// rpc::AgentExtension, made for each agent created once this library is
// loaded), what runs on the workers holding stages. What it promises:
//  - tandem.pipe.run, from a driver (pipe.cc): the RunRequest decoded
//    (messages.h), its passes run in the order sent, each over the worker's
//    StepState (passes.h) with a PassIo over the step's Mailbox
//    (mailbox.h); the parameters' gradients go into the request's
//    distributed autograd context, and the answer is a RunReply.
//  - tandem.pipe.put and tandem.pipe.abort, from the step's other workers:
//    into the step's mailbox, where they are delivered (the loop thread),
//    never blocking, so that runs holding pool threads for a whole step
//    cannot starve them.
//  - A run that fails tells the step's other workers (abort_step), so none
//    waits out its timeout, unless it failed as an echo of such news
//    (StepAborted, errors.h); a failing pass names itself (PassError).
//  - A mailbox whose run never comes (a driver that died, a run never sent)
//    goes once the step's pass timeout has passed since its last message;
//    messages for a step over here are dropped.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/rpc/agent.h"

namespace tandem::pipeline::step {

// std::logic_error when `agent` has no stage service (it was made before
// this library was loaded).
void require_stage_service(rpc::Agent& agent);

// Tells workers 0 .. count - 1 of `names` but `skip` that `step` (whose
// passes wait `timeout` for their messages) failed, `why`. Best effort: a
// worker that cannot be reached waits out its pass timeout.
void abort_step(rpc::Agent& agent, const std::vector<std::string>& names, size_t count,
                int64_t step, std::chrono::milliseconds timeout, const std::string& why,
                int64_t skip = -1);

}  // namespace tandem::pipeline::step
