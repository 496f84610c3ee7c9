// GraphTask: one backward pass's record on one worker (autograd/engine.h has
// the algorithm), and the one phase it is in.
//
// Phases (changed only under `mu`):
//
//   kWaitingForRun --run counted--> kRunning --every node ran--> kDone
//         |                            |                          |
//         +-------------+--------------+                          |
//                       v                                         v
//      kFailed (fail) / kAborted (abort) / kClosed (close)  <-----+
//
//  1. kWaitingForRun: made here by a gradient or an abort that overtook the
//     `run` request (Engine::task_of). Gradients wait in `early`; nothing runs.
//  2. kRunning: `run` counted the nodes (on the root: backward() did), and
//     ready nodes run. A `run` for a task in any other phase is refused.
//  3. kDone: every node it reached ran: `done` completed with None. A failure
//     noticed later still goes to the root, through `report`.
//  4. kFailed (fail(error)): `done` fails with the error; from kDone, which
//     already answered, `report` gets it instead.
//  5. kAborted (abort()): the root gave up on the task, or its context was
//     released: `done` fails with ShutdownError unless it had completed, and
//     nothing more is reported.
//  6. kClosed (close()): the agent shuts down; `done` is left as it is: the
//     root learns of it from the connection closing, as if this worker died.
// kFailed, kAborted and kClosed are final: later failures are dropped. Leaving
// kWaitingForRun or kRunning completes `done` exactly once, except into
// kClosed. Every phase after kRunning has dropped its work (buffers freed).
// A task is kept (in its ContextState) until its context goes, so that a late
// gradient or an abort that overtook `run` finds it.
//
// Orthogonal to the phase: `draining` (a thread is running the ready nodes;
// one at a time) and `attached` (fixed at creation: on the root, backward()'s
// own thread drains; gradients that arrive only wake it).
#pragma once

#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tandem/autograd/functions.h"
#include "tandem/rpc/future.h"

namespace tandem::autograd {

struct GraphTask {
  enum class Phase { kWaitingForRun, kRunning, kDone, kFailed, kAborted, kClosed };

  GraphTask(uint64_t context, uint64_t id, int root, bool attached)
      : context(context), id(id), root(root), attached(attached), done(rpc::make_raw_future()) {}

  struct NodeState {
    std::shared_ptr<torch::autograd::Node> fn;
    int deps = 0;  // inputs still to come
    torch::autograd::variable_list inputs;
  };
  using NodeMap = std::unordered_map<torch::autograd::Node*, NodeState>;

  const uint64_t context;
  const uint64_t id;
  const int root;
  const bool attached;  // backward()'s thread drains (the root's part)

  const std::chrono::steady_clock::time_point made = std::chrono::steady_clock::now();

  std::mutex mu;
  Phase phase = Phase::kWaitingForRun;
  bool draining = false;  // a thread is running ready nodes
  // Set (under mu) before kRunning, fixed after.
  bool keep_graph = false;
  std::chrono::milliseconds timeout{0};  // for the gradients this part sends
  // Where a failure goes once `done` has completed (on the root: backward();
  // elsewhere: a `fail` message to the root). Cleared by abort() and close().
  std::function<void(std::exception_ptr)> report;

  NodeMap nodes;  // reached, not yet run
  std::vector<torch::autograd::Node*> ready;
  // Gradients for sends that arrived before `run`.
  std::vector<std::pair<std::shared_ptr<SendBackward>, torch::autograd::variable_list>> early;
  std::atomic<uint64_t> signals{0};  // bumped (under mu) when the attached thread has news
  std::condition_variable cv;
  // Wakes the attached thread where it sleeps on a connection instead of on
  // cv (EngineLink::wait_for); null otherwise (under mu).
  std::function<void()> waker;
  // What a bump of `signals` does next (mu held): wakes the attached thread.
  void signal_locked() {
    ++signals;
    cv.notify_one();
    if (waker) waker();
  }
  // This worker's part: completes with its PartReply (autograd/engine.h)
  // when done, or with the error.
  rpc::RawFuture done;
  // On the root: the other workers' parts (their `run` calls), for
  // debug_info; null once a part has answered.
  std::vector<std::pair<int, rpc::RawFuture>> parts;
  // Queued by hooks (autograd/pass.h): run when the part has run its nodes.
  std::vector<std::function<void()>> on_done;

  // No more failures are taken (mu held).
  bool final_locked() const {
    return phase == Phase::kFailed || phase == Phase::kAborted || phase == Phase::kClosed;
  }
  // Into `to` (mu held), dropping the remaining work.
  void stop_locked(Phase to) {
    phase = to;
    nodes.clear();
    ready.clear();
    early.clear();
    on_done.clear();
  }

  // -> kFailed: `done` fails with `error`, or (from kDone) `report` gets it.
  // Dropped in a final phase.
  void fail(std::exception_ptr error);
  // -> kAborted: `done` fails with ShutdownError("distributed backward task
  // <id> on <worker>: <why>") unless it had completed; `report` is cleared.
  void abort(const std::string& worker, const std::string& why);
  // -> kClosed: the work and `report` are dropped; `done` is left as it is.
  void close();
};

}  // namespace tandem::autograd
