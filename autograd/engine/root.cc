// backward() on the root worker (autograd/engine.h, steps 1 and 2, and the
// root's wait): discovery of every send that will get a gradient, the `run`
// requests to the other workers' parts, and the root's own part run on the
// calling thread until every part is done or the first error.
#include <ATen/ops/ones_like.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <set>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/engine/walk.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/layer.h"
#include "tandem/rpc/stages.h"

namespace tandem::autograd {

// backward()'s outcome: every part done (the root's `done` and each `run`
// reply, counted down), or the first error from anywhere (a part, a failure
// told to the root later, the timeout), whichever comes first.
struct Engine::Join {
  explicit Join(size_t parts) : left(parts) {}
  rpc::RawFuture result = rpc::make_raw_future();
  std::atomic<size_t> left;  // parts not done
  std::atomic<bool> over{false};
  void fail(std::exception_ptr e) {
    if (!over.exchange(true)) result->setError(e);
  }
  void part_done() {
    if (left.fetch_sub(1) == 1 && !over.exchange(true)) result->markCompleted(c10::IValue());
  }
};

namespace {

// The root node of a backward pass from `roots`, after checking them.
std::shared_ptr<RootBackward> make_root(const std::vector<at::Tensor>& roots) {
  if (roots.empty()) throw std::invalid_argument("backward() needs at least one root");
  torch::autograd::edge_list edges;
  variable_list grads;
  for (size_t i = 0; i < roots.size(); ++i) {
    const at::Tensor& r = roots[i];
    const std::string which = "backward(): root " + std::to_string(i);
    if (!r.defined()) throw std::invalid_argument(which + " is an undefined tensor");
    if (!r.requires_grad()) throw std::invalid_argument(which + " does not require grad");
    if (r.numel() != 1) {
      throw std::invalid_argument(which + " has " + std::to_string(r.numel()) +
                                  " elements; roots must be scalars (reduce it, e.g. .sum())");
    }
    edges.push_back(torch::autograd::impl::gradient_edge(r));
    grads.push_back(at::ones_like(r, at::MemoryFormat::Preserve));
  }
  return std::make_shared<RootBackward>(std::move(edges), std::move(grads));
}

}  // namespace

void Engine::backward(uint64_t context, const std::vector<at::Tensor>& roots, bool retain_graph,
                      std::chrono::milliseconds timeout) {
  TANDEM_STAGE(kBackwardStart);
  auto root = make_root(roots);
  auto ctx = contexts_->get(context);
  const auto tracer = link_->tracer();
  rpc::TraceScope trace(tracer.get(), "autograd");
  if (trace.on()) {
    trace.set_name("backward");
    trace.set_args("{\"context\":" + std::to_string(context) + "}");
  }
  if (timeout.count() < 0) timeout = link_->default_timeout();
  passes_.fetch_add(1, std::memory_order_relaxed);
  const auto start = std::chrono::steady_clock::now();
  auto task =
      std::make_shared<GraphTask>(context, make_id(rank_, next_task_), rank_, /*attached=*/true);
  task->keep_graph = retain_graph;
  task->timeout = timeout;

  // 1. Discovery: every send that will get a gradient, on every worker.
  GraphTask::NodeMap nodes;
  std::vector<RecvBackward*> recvs;
  expand(nodes, root, &recvs);
  std::set<uint64_t> reached;
  for (RecvBackward* r : recvs) {
    reached.insert(r->message());
    reached.insert(r->reach().begin(), r->reach().end());
  }
  std::map<int, std::vector<uint64_t>> parts;  // worker -> its sends that will be reached
  std::vector<uint64_t> own;
  for (uint64_t m : reached) {
    if (id_worker(m) == rank_) {
      own.push_back(m);
    } else {
      parts[id_worker(m)].push_back(m);
    }
  }
  std::vector<std::shared_ptr<SendBackward>> sends;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    sends = sends_of(*ctx, own);
    ctx->tasks.emplace(task->id, task);  // kept (finished) until the context goes
  }
  expand_sends(nodes, sends);
  {
    std::lock_guard<std::mutex> lock(task->mu);
    task->nodes.swap(nodes);
    task->ready.push_back(root.get());
    // Not if a release aborted it meanwhile.
    if (task->phase == GraphTask::Phase::kWaitingForRun) task->phase = GraphTask::Phase::kRunning;
  }

  // 2. Every other worker that has a part is told which of its sends to
  //    count from, before anything runs here: its walk, and its wake-up
  //    where it slept, overlap this worker's first nodes.
  auto join = std::make_shared<Join>(1 + parts.size());
  join->result->addCallback([task](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(task->mu);
    task->signal_locked();
  });
  {
    std::lock_guard<std::mutex> lock(task->mu);
    task->report = [join, me = name_](std::exception_ptr e) {
      auto [code, text] = rpc::describe_error(e);
      join->fail(rpc::make_error(code, me, text));
    };
  }
  // Each part's error reaches `join` with the worker's name on it (a `run`
  // reply's names its worker already).
  task->done->addCallback([join, me = name_](c10::ivalue::Future& f) {
    if (!f.hasError()) return join->part_done();
    auto [code, text] = rpc::describe_error(f.exception_ptr());
    join->fail(rpc::make_error(code, me, text));
  });
  std::weak_ptr<Engine> weak = weak_from_this();
  for (auto& [worker, sends] : parts) {
    try {
      auto f = link_->run(worker, {context, task->id, rank_, retain_graph, timeout, sends});
      f->addCallback([join, weak, weak_task = std::weak_ptr<GraphTask>(task), context,
                      id = task->id, me = name_, from = worker](c10::ivalue::Future& f) {
        if (f.hasError()) return join->fail(f.exception_ptr());
        if (auto t = weak_task.lock()) {
          // Done: its record lets go of the reply, so that the gradients in
          // it are this task's alone (AccumulateGrad need not copy them).
          std::lock_guard<std::mutex> lock(t->mu);
          for (auto& [_, part] : t->parts) {
            if (part.get() == &f) part.reset();
          }
        }
        // The part's last gradients for this worker may ride in its reply.
        if (!f.value().isNone()) {
          try {
            std::vector<MessageGrads> grads;
            try {
              if (!f.value().isTuple()) throw std::invalid_argument("it is not a tuple");
              grads = MessageGrads::parse(f.value().toTupleRef().elements().vec(), 0,
                                          "the `run` reply of a part");
            } catch (const std::invalid_argument& e) {
              throw rpc::ProtocolError(e.what());
            }
            for (const auto& g : grads) {
              if (id_worker(g.message) != id_worker(id)) {
                throw rpc::ProtocolError("it carried gradients for message " +
                                         std::to_string(g.message) +
                                         ", which this worker did not send");
              }
            }
            if (auto self = weak.lock()) {
              self->received_.fetch_add(grads.size(), std::memory_order_relaxed);
              self->accept_grads(context, id, std::move(grads));
            }
          } catch (...) {
            auto [code, text] = rpc::describe_error(std::current_exception());
            return join->fail(rpc::make_error(
                code, me, "the `run` reply from rank " + std::to_string(from) + ": " + text));
          }
        }
        join->part_done();
      });
      std::lock_guard<std::mutex> lock(task->mu);
      task->parts.emplace_back(worker, f);
    } catch (...) {
      join->fail(std::current_exception());
      break;
    }
  }
  TANDEM_STAGE(kRunsSent);

  // 3. This worker's part runs on this thread: gradients that come back are
  //    delivered where they are read (the loop thread, or this one polling
  //    its connection), which wakes this one.
  run_root_part(ctx, task, *join, start, timeout);
  TANDEM_STAGE(kBackwardEnd);
  if (join->result->hasError()) {
    task->abort(name_, "backward failed");
    std::vector<int> sent;
    {
      std::lock_guard<std::mutex> lock(task->mu);
      for (const auto& [worker, _] : task->parts) sent.push_back(worker);
    }
    for (int worker : sent) link_->abort(worker, context, task->id);
    std::rethrow_exception(join->result->exception_ptr());
  }
}

void Engine::run_root_part(const std::shared_ptr<ContextState>& ctx,
                           const std::shared_ptr<GraphTask>& task, Join& join,
                           std::chrono::steady_clock::time_point start,
                           std::chrono::milliseconds timeout) {
  uint64_t seen = task->signals.load();
  const auto until = timeout.count() == 0 ? std::chrono::steady_clock::time_point::max()
                                          : start + timeout;
  while (!join.result->completed()) {
    drain(ctx, task);
    // A wake-up costs more than a loopback hop: spin a little first, then
    // sleep where the gradients come in (EngineLink::wait_for).
    link_->wait_for(
        [&] { return task->signals.load(std::memory_order_acquire) != seen; },
        [&](std::function<void()> waker) {
          std::lock_guard<std::mutex> lock(task->mu);
          task->waker = std::move(waker);
        },
        until);
    std::unique_lock<std::mutex> lock(task->mu);
    auto news = [&] { return task->signals.load() != seen; };
    if (timeout.count() == 0) {
      task->cv.wait(lock, news);
    } else if (!task->cv.wait_until(lock, start + timeout, news)) {
      lock.unlock();
      // The parts' own `run` calls time out too; this also covers the
      // gradients this part still waits for.
      join.fail(std::make_exception_ptr(rpc::TimeoutError(
          "distributed backward of context " + std::to_string(task->context) + " on " + name_ +
          " did not finish within " + std::to_string(timeout.count()) + " ms")));
      return;
    }
    seen = task->signals.load();
  }
}

}  // namespace tandem::autograd
