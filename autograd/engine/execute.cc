// Execution (autograd/engine.h, step 3): drain() runs a task's ready nodes,
// one thread at a time, and counts down the inputs of the nodes below;
// run_node() runs one node with its hooks (AccumulateGrad into the context,
// a RecvBackward's gradients sent on); and the thread's current pass that
// autograd/pass.h answers from inside a node.
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/version.h>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/pass.h"
#include "tandem/rpc/stages.h"

namespace tandem::autograd {

namespace {

using torch::autograd::Node;

// The engine's check of a node's outputs against what the next nodes take:
// a broadcast gradient is summed back to shape, a dtype or device converted.
void fit_outputs(const Node& fn, variable_list& outputs) {
  const auto& edges = fn.next_edges();
  if (outputs.size() != edges.size()) {
    throw std::runtime_error(fn.name() + " returned " + std::to_string(outputs.size()) +
                             " gradient(s) for " + std::to_string(edges.size()) + " input(s)");
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    at::Tensor& g = outputs[i];
    if (!edges[i].is_valid() || !g.defined()) continue;
    const auto& meta = edges[i].function->input_metadata(edges[i].input_nr);
    if (!meta.is_same_shape(g)) {
      if (!meta.is_expandable_to_shape(g)) {
        throw std::runtime_error(fn.name() + ": " +
                                 meta.incompatible_shape_error_message(i, g).str());
      }
      g = meta.reduce_grad(g);
    }
    auto dtype = c10::typeMetaToScalarType(meta.options().dtype());
    if (g.scalar_type() != dtype) g = g.to(dtype);
    // Gradients from another worker arrive on the CPU (tensors travel by
    // way of host memory for now): back to where the tensor lived.
    if (g.device() != meta.device()) g = g.to(meta.device());
  }
}

// The pass a thread is running a node of (autograd/pass.h).
struct CurrentPass {
  ContextState* ctx = nullptr;
  GraphTask* task = nullptr;
};
thread_local CurrentPass t_pass;

class PassScope {
 public:
  PassScope(ContextState* ctx, GraphTask* task) : saved_(t_pass) { t_pass = {ctx, task}; }
  ~PassScope() { t_pass = saved_; }
  PassScope(const PassScope&) = delete;
  PassScope& operator=(const PassScope&) = delete;

 private:
  CurrentPass saved_;
};

CurrentPass& current_pass(const char* what) {
  if (!t_pass.ctx) {
    throw std::logic_error(std::string("autograd::pass::") + what +
                           ": not inside a node of a distributed backward pass");
  }
  return t_pass;
}

}  // namespace

namespace pass {

bool active() { return t_pass.ctx != nullptr; }

uint64_t context_id() { return current_pass("context_id").ctx->id; }

at::Tensor gradient(const at::Tensor& leaf) {
  ContextState* ctx = current_pass("gradient").ctx;
  std::lock_guard<std::mutex> lock(ctx->mu);
  auto it = ctx->grads.find(leaf);
  return it == ctx->grads.end() ? at::Tensor() : it->value();
}

void set_gradient(const at::Tensor& leaf, at::Tensor grad) {
  ContextState* ctx = current_pass("set_gradient").ctx;
  std::lock_guard<std::mutex> lock(ctx->mu);
  ctx->grads.insert_or_assign(leaf, std::move(grad));
}

void on_part_done(std::function<void()> fn) {
  GraphTask* task = current_pass("on_part_done").task;
  std::lock_guard<std::mutex> lock(task->mu);
  task->on_done.push_back(std::move(fn));
}

}  // namespace pass

void Engine::drain(const std::shared_ptr<ContextState>& ctx,
                   const std::shared_ptr<GraphTask>& task) {
  c10::AutoGradMode no_grad(false);
  std::unique_lock<std::mutex> lock(task->mu);
  if (task->draining || task->phase != GraphTask::Phase::kRunning) return;
  task->draining = true;
  TANDEM_STAGE(kDrainStart);
  const auto tracer = link_->tracer();
  const auto drain_start =
      tracer ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  size_t ran = 0;
  Outbox out;  // gradients for other workers, not sent yet
  c10::IValue reply;
  for (;;) {
    if (task->phase != GraphTask::Phase::kRunning) break;  // over: what is held goes nowhere
    if (task->ready.empty()) {
      if (out.empty()) break;
      // Nothing more to run for now: what the RecvBackwards left goes, but
      // at the part's end the root's share rides in the `run` reply, unless
      // the hooks' part-end work would hold it (autograd/engine.h, 4.).
      if (!task->attached && task->nodes.empty() && task->on_done.empty() && reply.isNone()) {
        reply = take_for(out, task->root);
      }
      lock.unlock();
      // (a gradient that comes meanwhile is left to this thread: read `ready` again)
      if (!send_out(task, out)) {
        lock.lock();
        break;
      }
      lock.lock();
      continue;
    }
    ++ran;
    Node* n = task->ready.back();
    task->ready.pop_back();
    auto it = task->nodes.find(n);
    std::shared_ptr<Node> fn = std::move(it->second.fn);
    variable_list inputs = std::move(it->second.inputs);
    task->nodes.erase(it);
    lock.unlock();
    // RecvBackwards in a row add to `out`; anything else sends it first, so
    // that those to one worker travel as one message and none waits on work.
    if (!out.empty() && !dynamic_cast<RecvBackward*>(fn.get()) && !send_out(task, out)) {
      lock.lock();
      break;
    }
    variable_list outputs;
    try {
      PassScope scope(ctx.get(), task.get());
      outputs = run_node(ctx, task, *fn, std::move(inputs), out);
    } catch (...) {
      task->fail(std::current_exception());
      lock.lock();
      break;
    }
    lock.lock();
    if (task->phase != GraphTask::Phase::kRunning) break;
    const auto& edges = fn->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      if (!edges[i].is_valid()) continue;
      auto next = task->nodes.find(edges[i].function.get());
      if (next == task->nodes.end()) continue;  // cannot happen: everything below was reached
      auto& state = next->second;
      if (i < outputs.size() && outputs[i].defined()) {
        if (state.inputs.empty()) state.inputs.resize(state.fn->num_inputs());
        at::Tensor& slot = state.inputs.at(edges[i].input_nr);
        slot = slot.defined() ? slot + outputs[i] : std::move(outputs[i]);
      }
      if (--state.deps == 0) task->ready.push_back(next->first);
    }
  }
  bool done = task->phase == GraphTask::Phase::kRunning && task->nodes.empty();
  if (done && !task->on_done.empty()) {
    // The hooks' part-end work, still as "draining" (nothing else can run:
    // every node has), before the part reports done.
    auto callbacks = std::move(task->on_done);
    task->on_done.clear();
    lock.unlock();
    try {
      PassScope scope(ctx.get(), task.get());
      for (auto& fn : callbacks) fn();
    } catch (...) {
      lock.lock();
      task->draining = false;
      lock.unlock();
      task->fail(std::current_exception());
      return;
    }
    lock.lock();
    done = task->phase == GraphTask::Phase::kRunning;
  }
  task->draining = false;
  if (done) task->phase = GraphTask::Phase::kDone;
  lock.unlock();
  if (done) {
    TANDEM_STAGE(kPartDone);
    parts_done_.fetch_add(1, std::memory_order_relaxed);
  }
  if (tracer && ran > 0) {
    tracer->slice("backward nodes", "autograd", drain_start, std::chrono::steady_clock::now(), {},
                  "{\"context\":" + std::to_string(task->context) + ",\"task\":" +
                      std::to_string(task->id) + ",\"nodes\":" + std::to_string(ran) + "}");
  }
  if (done) task->done->markCompleted(std::move(reply));
}

variable_list Engine::run_node(const std::shared_ptr<ContextState>& ctx,
                               const std::shared_ptr<GraphTask>& task, Node& fn,
                               variable_list inputs, Outbox& out) {
  if (inputs.empty()) inputs.resize(fn.num_inputs());  // every input undefined
  if (auto* recv = dynamic_cast<RecvBackward*>(&fn)) {
    if (recv->sender() == rank_) {  // a message this worker sent itself
      accept_grads(ctx->id, task->id, {{recv->message(), std::move(inputs)}});
    } else {
      out.emplace_back(recv->sender(), MessageGrads{recv->message(), std::move(inputs)});
    }
    return {};
  }
  for (const auto& hook : fn.pre_hooks()) inputs = (*hook)(inputs);
#if TORCH_VERSION_MAJOR >= 2
  for (const auto& hook : fn.tensor_pre_hooks()) inputs = (*hook)(inputs);
  for (const auto& [_, hook] : fn.retains_grad_hooks()) inputs = (*hook)(inputs);
#endif
  if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(&fn)) {
    // The leaf's gradient goes to the context, never to .grad.
    at::Tensor g = std::move(inputs.at(0));
    if (!g.defined()) return {};
    if (!g.is_contiguous()) {
      g = g.contiguous();
    } else if (g.use_count() > 1) {
      g = g.clone();  // someone else holds it: the context gets its own
    }
    {
      std::lock_guard<std::mutex> lock(ctx->mu);
      auto it = ctx->grads.find(acc->variable);
      if (it == ctx->grads.end()) {
        ctx->grads.insert(acc->variable, g.detach());
      } else {
        it->setValue(it->value() + g);
      }
    }
    // Post-hooks see the gradient that was accumulated (DDP's hybrid mode
    // launches its buckets from them), with no outputs, as LibTorch does.
    if (!fn.post_hooks().empty()) {
      const variable_list outputs;
      const variable_list hook_inputs{g};
      for (const auto& hook : fn.post_hooks()) (*hook)(outputs, hook_inputs);
    }
    return {};
  }
  variable_list outputs;
  if (fn.post_hooks().empty()) {
    outputs = fn(std::move(inputs));
  } else {
    variable_list copy = inputs;
    outputs = fn(std::move(inputs));
    for (const auto& hook : fn.post_hooks()) outputs = (*hook)(outputs, copy);
  }
  fit_outputs(fn, outputs);
  if (!task->keep_graph) fn.release_variables();
  return outputs;
}

}  // namespace tandem::autograd
