// A worker's part of a backward pass (autograd/engine.h, steps 2 and 4) and
// the messages between the engines: `run` (run_part), gradients in
// (on_grad_from_loop, accept_grads) and out (send_out), `fail` and `abort`,
// and failures told to the root. Ready nodes run in
// autograd/engine/execute.cc (drain).
#include <cassert>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/engine/walk.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/stages.h"

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

void MessageGrads::append(std::vector<c10::IValue>& out, std::vector<MessageGrads> all) {
  for (auto& g : all) {
    std::vector<c10::IValue> items;
    items.reserve(g.grads.size());
    for (auto& t : g.grads) items.push_back(t.defined() ? c10::IValue(std::move(t)) : c10::IValue());
    out.emplace_back(static_cast<int64_t>(g.message));
    out.emplace_back(c10::ivalue::Tuple::create(std::move(items)));
  }
}

std::vector<MessageGrads> MessageGrads::parse(const std::vector<c10::IValue>& items, size_t first,
                                              const char* what) {
  if (items.size() <= first || (items.size() - first) % 2 != 0) {
    throw std::invalid_argument(std::string(what) +
                                " does not hold (message, (gradient or None, ...)) pairs");
  }
  std::vector<MessageGrads> out;
  out.reserve((items.size() - first) / 2);
  for (size_t i = first; i < items.size(); i += 2) {
    if (!items[i].isInt() || !items[i + 1].isTuple()) {
      throw std::invalid_argument(std::string(what) +
                                  ": expected a message id and a tuple of gradients, got " +
                                  items[i].tagKind() + " and " + items[i + 1].tagKind());
    }
    MessageGrads g;
    g.message = static_cast<uint64_t>(items[i].toInt());
    for (const auto& t : items[i + 1].toTupleRef().elements()) {
      if (t.isNone()) {
        g.grads.emplace_back();
      } else if (t.isTensor()) {
        g.grads.push_back(t.toTensor());
      } else {
        throw std::invalid_argument(std::string(what) +
                                    ": a gradient must be a tensor or None, got " + t.tagKind());
      }
    }
    out.push_back(std::move(g));
  }
  return out;
}

rpc::RawFuture Engine::run_part(const RunRequest& request) {
  TANDEM_STAGE(kPartStart);
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

void Engine::on_grad_from_loop(uint64_t context, uint64_t task, std::vector<MessageGrads> grads) {
  assert(link_->on_loop_thread());
  received_.fetch_add(grads.size(), std::memory_order_relaxed);
  try {
    accept_grads(context, task, std::move(grads));
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

void Engine::accept_grads(uint64_t context, uint64_t id, std::vector<MessageGrads> grads) {
  TANDEM_STAGE(kGradTaken);
  auto ctx = contexts_->get(context);
  std::vector<std::shared_ptr<SendBackward>> sends;
  std::shared_ptr<GraphTask> task;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    std::vector<uint64_t> messages;
    messages.reserve(grads.size());
    for (const auto& g : grads) messages.push_back(g.message);
    sends = sends_of(*ctx, messages);
    // Before `run` the task is made here and keeps the gradients; after it
    // finished or was aborted, its record drops them.
    task = task_of(*ctx, id);
  }
  {
    std::lock_guard<std::mutex> lock(task->mu);
    if (task->phase == GraphTask::Phase::kWaitingForRun) {
      for (size_t i = 0; i < sends.size(); ++i) {
        task->early.emplace_back(std::move(sends[i]), std::move(grads[i].grads));
      }
      return;
    }
    if (task->phase != GraphTask::Phase::kRunning) return;  // over: nothing more runs
    for (size_t i = 0; i < sends.size(); ++i) {
      deliver_to_send(*task, sends[i].get(), std::move(grads[i].grads), name_);
    }
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

bool Engine::send_out(const std::shared_ptr<GraphTask>& task, Outbox& out) {
  // One message per worker, the workers in the order their first gradient
  // came. One way: a reply would only cost both workers a message. A
  // receiver that cannot take them tells the root itself (fail_from_loop);
  // one that died fails the root's `run` request to it.
  try {
    while (!out.empty()) {
      const int to = out.front().first;
      std::vector<MessageGrads> grads;
      grads.reserve(out.size());
      Outbox rest;
      for (auto& [worker, g] : out) {
        if (worker == to) {
          grads.push_back(std::move(g));
        } else {
          rest.emplace_back(worker, std::move(g));
        }
      }
      out.swap(rest);
      TANDEM_STAGE(kGradSent);
      link_->send_grads(to, task->context, task->id, std::move(grads));
    }
    return true;
  } catch (...) {
    out.clear();
    task->fail(std::current_exception());
    return false;
  }
}

PartReply Engine::take_for(Outbox& out, int worker) {
  std::vector<MessageGrads> mine;
  Outbox rest;
  for (auto& [to, g] : out) {
    if (to == worker) {
      mine.push_back(std::move(g));
    } else {
      rest.emplace_back(to, std::move(g));
    }
  }
  out.swap(rest);
  if (mine.empty()) return PartReply();
  std::vector<c10::IValue> items;
  MessageGrads::append(items, std::move(mine));
  return c10::ivalue::Tuple::create(std::move(items));
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
