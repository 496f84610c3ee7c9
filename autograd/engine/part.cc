// A worker's part of a backward pass (autograd/engine.h, steps 2 and 4) and
// the messages between the engines: `run` (run_part), gradients in
// (on_grad_from_loop, accept_grad) and out (send_grads), `fail` and `abort`,
// and failures told to the root. Ready nodes run in
// autograd/engine/execute.cc (drain).
#include <cassert>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/engine/walk.h"
#include "tandem/rpc/errors.h"

namespace tandem::autograd {

namespace {

// Gives a send its gradients from the paired receive (task.mu held).
void deliver_to_send(GraphTask& t, SendBackward* send, variable_list grads,
                     const std::string& where) {
  auto it = t.nodes.find(send);
  if (it == t.nodes.end() || it->second.deps <= 0) {
    throw std::logic_error("gradient for autograd message " + std::to_string(send->message()) +
                           " on " + where + ": that send was not expected to get one");
  }
  if (grads.size() != send->num_inputs()) {
    throw std::invalid_argument("autograd message " + std::to_string(send->message()) + " sent " +
                                std::to_string(send->num_inputs()) + " tensor(s) but got " +
                                std::to_string(grads.size()) + " gradient(s) back");
  }
  it->second.inputs = std::move(grads);
  if (--it->second.deps == 0) t.ready.push_back(send);
}

}  // namespace

rpc::RawFuture Engine::run_part(const RunRequest& request) {
  const uint64_t context = request.context, id = request.task;
  const int root = request.root;
  if (root != id_worker(id)) {
    throw std::invalid_argument("graph task " + std::to_string(id) + " names root rank " +
                                std::to_string(root) + " but was made by rank " +
                                std::to_string(id_worker(id)));
  }
  auto ctx = contexts_->get(context);
  std::shared_ptr<GraphTask> task;
  std::vector<std::shared_ptr<SendBackward>> sends;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    sends = sends_of(*ctx, request.sends);
    task = task_of(*ctx, id);
  }
  // The walk holds no lock: gradients arriving meanwhile wait in `early`.
  GraphTask::NodeMap nodes;
  expand_sends(nodes, sends);
  std::vector<std::pair<std::shared_ptr<SendBackward>, variable_list>> early;
  {
    std::lock_guard<std::mutex> lock(task->mu);
    if (task->phase != GraphTask::Phase::kWaitingForRun) {
      throw std::logic_error("graph task " + std::to_string(id) +
                             " was already run (or aborted) on " + name_);
    }
    task->nodes.swap(nodes);
    task->keep_graph = request.keep_graph;
    task->timeout = request.timeout;
    std::weak_ptr<Engine> weak = weak_from_this();
    task->report = [weak, context, id](std::exception_ptr e) {
      if (auto self = weak.lock()) self->tell_root(context, id, e);
    };
    task->phase = GraphTask::Phase::kRunning;
    early.swap(task->early);
    for (auto& [send, grads] : early) deliver_to_send(*task, send.get(), std::move(grads), name_);
  }
  if (auto tracer = link_->tracer()) {
    // rpc/trace.h: the part from its `run` to its end, on a track of its own.
    const auto start = std::chrono::steady_clock::now();
    task->done->addCallback([tracer, start, context, id](c10::ivalue::Future& f) {
      tracer->span("backward part", "autograd.part", id, start, std::chrono::steady_clock::now(),
                   "{\"context\":" + std::to_string(context) + ",\"task\":" + std::to_string(id) +
                       ",\"ok\":" + (f.hasError() ? "false" : "true") + "}");
    });
  }
  // A part with nothing to wait for is done at once; drain() notices.
  drain(ctx, task);
  return task->done;
}

void Engine::on_grad_from_loop(uint64_t context, uint64_t task, uint64_t message,
                               variable_list grads) {
  assert(link_->on_loop_thread());
  try {
    accept_grad(context, task, message, std::move(grads));
  } catch (...) {
    // Gradients come one way (no reply): the root hears of it from here.
    fail_from_loop(context, task, std::current_exception());
  }
}

void Engine::fail_from_loop(uint64_t context, uint64_t task, std::exception_ptr error) {
  assert(link_->on_loop_thread());
  if (id_worker(task) == rank_) return tell_root(context, task, error);  // bounded: in place
  // Telling another worker may mean connecting: not on the loop thread.
  link_->post(
      [self = shared_from_this(), context, task, error] { self->tell_root(context, task, error); });
}

void Engine::on_failure(uint64_t context, uint64_t task, std::exception_ptr error) {
  auto t = find_task(context, task);
  if (!t) return;
  std::function<void(std::exception_ptr)> report;
  {
    std::lock_guard<std::mutex> lock(t->mu);
    report = t->report;
  }
  if (report) report(error);
}

void Engine::on_abort(uint64_t context, uint64_t task) {
  auto ctx = contexts_->find(context);
  if (!ctx) return;
  std::shared_ptr<GraphTask> t;
  {
    // Made here when the abort overtook `run`: that `run` then finds it aborted.
    std::lock_guard<std::mutex> lock(ctx->mu);
    t = task_of(*ctx, task);
  }
  t->abort(name_, "aborted by its root");
}

void Engine::accept_grad(uint64_t context, uint64_t id, uint64_t message, variable_list grads) {
  auto ctx = contexts_->get(context);
  std::shared_ptr<SendBackward> send;
  std::shared_ptr<GraphTask> task;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    send = sends_of(*ctx, {message}).front();
    // Before `run` the task is made here and keeps the gradient; after it
    // finished or was aborted, its record drops the gradient.
    task = task_of(*ctx, id);
  }
  {
    std::lock_guard<std::mutex> lock(task->mu);
    if (task->phase == GraphTask::Phase::kWaitingForRun) {
      task->early.emplace_back(std::move(send), std::move(grads));
      return;
    }
    if (task->phase != GraphTask::Phase::kRunning) return;  // over: nothing more runs
    deliver_to_send(*task, send.get(), std::move(grads), name_);
    if (task->attached) {  // backward()'s own thread drains the root's part
      task->signal_locked();
      return;
    }
    if (task->draining) return;  // the draining thread picks it up
  }
  // Usually on the loop thread: the nodes run on the pool.
  std::weak_ptr<Engine> weak = weak_from_this();
  link_->post([weak, ctx, task] {
    if (auto self = weak.lock()) self->drain(ctx, task);
  });
}

void Engine::send_grads(const std::shared_ptr<ContextState>& ctx,
                        const std::shared_ptr<GraphTask>& task, const RecvBackward& recv,
                        variable_list grads) {
  if (recv.sender() == rank_) {  // a message this worker sent itself
    accept_grad(ctx->id, task->id, recv.message(), std::move(grads));
    return;
  }
  // One way: a reply would only cost both workers a message. A receiver that
  // cannot take the gradient tells the root itself (fail_from_loop); one
  // that died fails the root's `run` request to it.
  link_->send_grad(recv.sender(), ctx->id, task->id, recv.message(), std::move(grads));
}

void Engine::tell_root(uint64_t context, uint64_t task, std::exception_ptr error) {
  const int root = id_worker(task);
  if (root == rank_) {
    if (auto t = find_task(context, task)) t->fail(error);
    return;
  }
  link_->tell_root(root, context, task, error);
}

}  // namespace tandem::autograd
