// DistAutograd: one agent's distributed autograd, plugged into the agent as
// an rpc::AgentExtension (so rpc/ never knows about autograd). It owns the
// three parts and wires them to the agent:
//   - the contexts and their release (autograd/context.h),
//   - the recording hooks (autograd/recording.h), which the agent's
//     before_send / after_encode / after_receive call,
//   - the engine (autograd/engine.h), whose EngineLink it implements over
//     rpc::Agent::call / notify and the agent's pool.
//
// The messages between workers, internal functions of every agent:
//  1. tandem.autograd.release(context, from): Contexts::release here, which
//     forwards it on; the reply comes once those have answered.
//  2. tandem.autograd.run(context, task, root, keep_graph, timeout_ms, sends):
//     Engine::run_part; the reply is that part's `done`: a PartReply (None,
//     or its last gradients for the root), or its error, whose kind the
//     agent keeps on the wire (Timeout, Disconnected, ...).
//  3. tandem.autograd.grad(context, task, message, (gradient or None, ...),
//     ...): the gradients of RecvBackwards that ran in a row, a message id
//     and a tuple for each (autograd/engine.h's MessageGrads), one way
//     (notify), handled where it is delivered (the loop thread, or a thread
//     polling that connection): Engine::on_grad_from_loop.
//     A malformed one is dropped with a line on stderr, or, once it names
//     its task, fails that task at its root.
//  4. tandem.autograd.fail(context, task, code, worker, message): a failure
//     after a part answered, to the root: Engine::on_failure.
//  5. tandem.autograd.abort(context, task): Engine::on_abort.
// A handler holds the DistAutograd only while it runs, and fails with
// ShutdownError once it is gone. close() closes the contexts (terminal).
#pragma once

#include <atomic>

#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/context.h"
#include "tandem/autograd/engine.h"
#include "tandem/autograd/recording.h"
#include "tandem/rpc/agent.h"

namespace tandem::autograd {

class DistAutograd final : public rpc::AgentExtension,
                           public std::enable_shared_from_this<DistAutograd> {
 public:
  explicit DistAutograd(rpc::Agent& agent);

  // The distributed autograd of `agent`; throws std::logic_error if it has none.
  static std::shared_ptr<DistAutograd> of(rpc::Agent& agent);

  // rpc::AgentExtension
  void register_handlers(rpc::Registry& internal) override;
  void register_loop_handlers(rpc::Registry& on_loop) override;
  void before_send(rpc::Message& m, int dest) override { recorder_.before_send(m, dest); }
  void after_encode(const rpc::Message& m, rpc::OutFrame& frame, int dest) override {
    recorder_.after_encode(m, frame, dest);
  }
  void after_receive(rpc::Message& m, int from) override { recorder_.after_receive(m, from); }
  std::vector<std::string> live_objects() const override { return contexts_->live_objects(); }
  // "autograd.contexts" alive here, "autograd.gradients_received": the
  // messages' gradients other workers' parts sent here (in `grad` messages
  // or riding in `run` requests and replies),
  // "autograd.backward_passes": backward() calls made here, and
  // "autograd.backward_parts": parts (the root's included) run to their end
  // here.
  // debug_info: the live contexts, and where each backward pass not done
  // here waits (Engine::describe).
  std::string debug_info() const override;
  void add_metrics(std::map<std::string, int64_t>& out) const override {
    out["autograd.contexts"] = static_cast<int64_t>(contexts_->live_objects().size());
    out["autograd.gradients_received"] = static_cast<int64_t>(engine_->gradients_received());
    out["autograd.backward_passes"] = static_cast<int64_t>(engine_->passes());
    out["autograd.backward_parts"] = static_cast<int64_t>(engine_->parts_done());
  }
  void close() override { contexts_->close(); }

  const std::string& name() const { return contexts_->name(); }
  Contexts& contexts() { return *contexts_; }
  Engine& engine() { return *engine_; }

 private:
  // For handlers: this DistAutograd, or ShutdownError once it is gone.
  std::function<std::shared_ptr<DistAutograd>()> locker();
  // The "tandem.autograd.grad" handler (see 3. above).
  void grad_from_loop(std::vector<c10::IValue>& args);

  rpc::Agent& agent_;  // valid until close(); the agent owns this extension
  const std::shared_ptr<Contexts> contexts_;
  Recorder recorder_;
  const std::shared_ptr<Engine> engine_;
};

}  // namespace tandem::autograd
