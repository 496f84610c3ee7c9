// Contexts: one worker's distributed autograd contexts, from creation to
// release. Recording (autograd/recording.h) fills them, the engine
// (autograd/engine.h) runs backward over them; neither owns them.
//
// What it promises:
//  1. Ids: a context id is (rank << 48) | counter, unique across the job.
//  2. A context exists on a worker once that worker created it
//     (new_context), or sent or received a message inside it
//     (get_or_create, called by recording).
//  3. Release (release(id, from)): the context is dropped here, its graph
//     tasks aborted, and the release forwarded to every worker this one sent
//     to inside it (but `from`, who sent the release). The future completes
//     when all of those have answered (with the first error among them, if
//     any: release is best effort, its callers do not wait past a timeout).
//     Releasing an unknown id completes at once.
//  4. A released id is remembered (the last kReleasedMemory of them), so a
//     late message does not bring the context back: get_or_create refuses it.
//  5. Gradients accumulate per context (ContextState::grads, gradients()),
//     never into .grad.
//  6. close() is terminal and idempotent: every context goes; a backward()
//     running here fails with ShutdownError, parts run for other workers stop
//     without answering (their root sees the connection close). Afterwards
//     new_context() throws ShutdownError and get_or_create() returns null.
//  7. live_objects() names the contexts still alive, for the agent's leak
//     report at a graceful shutdown.
#pragma once

#include <ATen/core/Dict.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tandem/autograd/functions.h"
#include "tandem/autograd/graph_task.h"
#include "tandem/rpc/common/bounded_set.h"
#include "tandem/rpc/future.h"

namespace tandem::autograd {

// One context's state on one worker.
struct ContextState {
  explicit ContextState(uint64_t id) : id(id) {}
  const uint64_t id;
  std::mutex mu;
  std::unordered_map<uint64_t, std::shared_ptr<SendBackward>> sends;  // by message id
  size_t recvs = 0;             // messages received with grads; 0: sends reach nothing
  std::set<int> known_workers;  // sent to inside this context
  c10::Dict<at::Tensor, at::Tensor> grads;
  std::unordered_map<uint64_t, std::shared_ptr<GraphTask>> tasks;  // by task id
  bool released = false;  // set by release(): nothing more is recorded in it
};

class Contexts {
 public:
  static constexpr size_t kReleasedMemory = 1 << 16;  // released ids remembered

  // Sends "release context `id`" to `worker` (over the agent: a
  // "tandem.autograd.release" call); the future completes when it has. May
  // throw when `worker` cannot be reached.
  using ForwardRelease = std::function<rpc::RawFuture(int worker, uint64_t id)>;

  // `name`: this worker's, for messages.
  Contexts(int rank, std::string name, ForwardRelease forward);
  Contexts(const Contexts&) = delete;
  Contexts& operator=(const Contexts&) = delete;

  int rank() const { return rank_; }
  const std::string& name() const { return name_; }

  uint64_t new_context();
  std::shared_ptr<ContextState> find(uint64_t id) const;  // null if not here
  // Like find(), but throws std::invalid_argument naming the id.
  std::shared_ptr<ContextState> get(uint64_t id) const;
  // Null once `id` was released here, or after close().
  std::shared_ptr<ContextState> get_or_create(uint64_t id);
  rpc::RawFuture release(uint64_t id, int from = -1);
  // A copy of this worker's leaf gradients in the context.
  c10::Dict<at::Tensor, at::Tensor> gradients(uint64_t id) const;

  size_t live() const;
  std::vector<std::string> live_objects() const;
  // The live contexts, by id (for debug_info).
  std::vector<std::shared_ptr<ContextState>> all() const;
  void close();
  bool closed() const;

 private:
  const int rank_;
  const std::string name_;
  const ForwardRelease forward_;
  std::atomic<uint64_t> next_context_{1};
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<ContextState>> contexts_;
  rpc::BoundedSet<uint64_t> released_{kReleasedMemory};  // recently released ids
  bool closed_ = false;
};

}  // namespace tandem::autograd
