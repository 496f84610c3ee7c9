// Container: one agent's distributed autograd: its contexts
// (autograd/context.h), the recording hooks (autograd/recording.h) and the
// engine (autograd/engine.h; its half of this class lives in engine.cc),
// plugged into the agent as an rpc::AgentExtension, so rpc/ never knows
// about autograd.
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

#include "tandem/autograd/context.h"
#include "tandem/autograd/engine.h"
#include "tandem/autograd/functions.h"
#include "tandem/autograd/recording.h"
#include "tandem/rpc/agent.h"

namespace tandem::autograd {

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
  Contexts& contexts() { return *contexts_; }

  // The engine (engine.cc).
  void backward(uint64_t context, const std::vector<at::Tensor>& roots, bool retain_graph,
                std::chrono::milliseconds timeout);
  c10::Dict<at::Tensor, at::Tensor> get_gradients(uint64_t context) const;

 private:
  // For handlers: this container, or ShutdownError once it is gone.
  std::function<std::shared_ptr<Container>()> locker();

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
  const std::shared_ptr<Contexts> contexts_;
  Recorder recorder_;
  std::atomic<uint64_t> next_task_{1};
};

}  // namespace tandem::autograd
