// The engine's walks of the local autograd graph (autograd/engine.h, steps 1
// and 2): what a pass reaches below its roots or its sends, and how many
// inputs each reached node waits for. The root's backward()
// (autograd/engine/root.cc) and each worker's part (autograd/engine/part.cc)
// fill a task's NodeMap with these before execution
// (autograd/engine/execute.cc) counts the inputs down. They read the graph
// only, which never changes once made, so they take no lock.
#pragma once

#include <memory>
#include <vector>

#include "tandem/autograd/functions.h"
#include "tandem/autograd/graph_task.h"

namespace tandem::autograd {

// Adds the graph below `entry` to `nodes`: each node reached for the first
// time is added, and each edge out of a newly added node counts one input
// for its target. Receives reached are appended to `recvs` when given.
// Only the caller sees `nodes` (no lock): the graph itself never changes.
void expand(GraphTask::NodeMap& nodes, const std::shared_ptr<torch::autograd::Node>& entry,
            std::vector<RecvBackward*>* recvs);

// Adds the graph below each send, each send counting one more input: the
// gradient its receive will send.
void expand_sends(GraphTask::NodeMap& nodes,
                  const std::vector<std::shared_ptr<SendBackward>>& sends);

}  // namespace tandem::autograd
