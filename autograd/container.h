// Container: one agent's distributed autograd state, and its hooks into the
// agent (an rpc::AgentExtension, so rpc/ never knows about autograd).
//
// What it promises:
//  1. Contexts: ids are (rank << 48) | counter, unique across the job. A
//     context exists on a worker once that worker created it, or sent or
//     received a message inside it. A request's context is the sender's
//     current one and becomes current in its handler (and in calls the
//     handler makes); a response carries its request's context.
//  2. Recording (before_send / after_encode / after_receive): inside a
//     context, a message with tensors that require grad gets a SendBackward
//     here and a RecvBackward on the receiver (autograd/functions.h), and
//     carries its reach (autograd/engine.h). Every worker sent to is
//     remembered for release. Outside a context the hooks return at once.
//  3. Release: the context is dropped here, its tasks aborted, and the
//     release forwarded to every worker it was sent to; the returned future
//     completes when all of them have released it. A released id is
//     remembered (bounded), so a late message does not bring it back.
//  4. Gradients accumulate per context (get_gradients), never into .grad.
// The engine's half of this class lives in engine.cc.
#pragma once

#include <ATen/core/Dict.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/functions.h"
#include "tandem/rpc/agent.h"

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
  std::unordered_map<uint64_t, std::shared_ptr<GraphTask>> tasks;
  bool released = false;  // set by release(): nothing more is recorded in it
};

struct Join;

class Container final : public rpc::AgentExtension,
                        public std::enable_shared_from_this<Container> {
 public:
  explicit Container(rpc::Agent& agent);

  // The container of `agent`; throws std::logic_error if it has none.
  static std::shared_ptr<Container> of(rpc::Agent& agent);

  // rpc::AgentExtension
  void register_handlers(rpc::Registry& internal) override;
  void register_loop_handlers(rpc::Registry& on_loop) override;
  void before_send(rpc::Message& m, int dest) override;
  void after_encode(const rpc::Message& m, rpc::OutFrame& frame, int dest) override;
  void after_receive(rpc::Message& m, int from) override;
  std::vector<std::string> live_objects() const override;
  void close() override;

  const std::string& name() const { return name_; }
  bool closed() const;
  uint64_t new_context();
  // The context current on this thread for this agent (0: none).
  uint64_t current_context() const;
  std::shared_ptr<ContextState> find(uint64_t id) const;
  // Like find(), but throws std::invalid_argument naming the id.
  std::shared_ptr<ContextState> get(uint64_t id) const;
  // Completes when every worker that took part has released `id`.
  rpc::RawFuture release(uint64_t id, int from = -1);
  size_t live_contexts() const;

  // The engine (engine.cc).
  void backward(uint64_t context, const std::vector<at::Tensor>& roots, bool retain_graph,
                std::chrono::milliseconds timeout);
  c10::Dict<at::Tensor, at::Tensor> get_gradients(uint64_t context) const;

 private:
  std::shared_ptr<ContextState> get_or_create(uint64_t id);
  // For handlers: this container, or ShutdownError once it is gone.
  std::function<std::shared_ptr<Container>()> locker();
  uint64_t next_id(std::atomic<uint64_t>& counter) const;

  // Engine internals (engine.cc).
  rpc::RawFuture run_part(uint64_t context, uint64_t task, int root, bool keep_graph,
                          const std::vector<uint64_t>& sends, std::chrono::milliseconds timeout);
  std::shared_ptr<GraphTask> task_of(ContextState& ctx, uint64_t task);  // ctx.mu held
  std::shared_ptr<GraphTask> find_task(uint64_t context, uint64_t task);  // or null
  // The recorded sends of these message ids (ctx.mu held); throws naming a missing one.
  std::vector<std::shared_ptr<SendBackward>> sends_of(ContextState& ctx,
                                                      const std::vector<uint64_t>& messages) const;
  void run_root_part(const std::shared_ptr<ContextState>& ctx,
                     const std::shared_ptr<GraphTask>& task, Join& join,
                     std::chrono::steady_clock::time_point start,
                     std::chrono::milliseconds timeout);
  void on_grad(uint64_t context, uint64_t task, uint64_t message,
               torch::autograd::variable_list grads);
  void drain(const std::shared_ptr<ContextState>& ctx, const std::shared_ptr<GraphTask>& task);
  torch::autograd::variable_list run_node(const std::shared_ptr<ContextState>& ctx,
                                          const std::shared_ptr<GraphTask>& task,
                                          torch::autograd::Node& fn,
                                          torch::autograd::variable_list inputs);
  void send_grads(const std::shared_ptr<ContextState>& ctx, const std::shared_ptr<GraphTask>& task,
                  const RecvBackward& recv, torch::autograd::variable_list grads);
  void fail(const std::shared_ptr<GraphTask>& task, std::exception_ptr error);
  // A failure here in task `task` of `context`, told to the task's root
  // (bounded and without blocking when this worker is the root).
  void tell_root(uint64_t context, uint64_t task, std::exception_ptr error);
  // Stops `task` here without reporting (the root already knows).
  void abort_task(const std::shared_ptr<GraphTask>& task, const std::string& why);

  rpc::Agent& agent_;  // valid until close(); the agent owns this container
  const int rank_;
  const std::string name_;  // the agent's name, for messages
  std::atomic<uint64_t> next_context_{1};
  std::atomic<uint64_t> next_message_{1};
  std::atomic<uint64_t> next_task_{1};
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<ContextState>> contexts_;
  std::unordered_set<uint64_t> released_;  // recently released ids
  std::deque<uint64_t> released_order_;
  bool closed_ = false;
};

}  // namespace tandem::autograd
