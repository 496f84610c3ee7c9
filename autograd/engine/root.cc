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

namespace tandem::autograd {

// backward()'s outcome: every part done (rpc::when_all_raw of the root's
// `done` and each `run` reply), or the first error from anywhere (a part, a
// failure told to the root later, the timeout), whichever comes first.
struct Engine::Join {
  rpc::RawFuture failed = rpc::make_raw_future();  // the first error only
  std::atomic<bool> over{false};
  rpc::RawFuture result;  // when_any_raw({failed, when_all_raw(parts)})
  void fail(std::exception_ptr e) {
    if (!over.exchange(true)) failed->setError(e);
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
  //    count from.
  auto join = std::make_shared<Join>();
  {
    std::lock_guard<std::mutex> lock(task->mu);
    task->report = [join, me = name_](std::exception_ptr e) {
      auto [code, text] = rpc::describe_error(e);
      join->fail(rpc::make_error(code, me, text));
    };
  }
  // Each part's error reaches `join` before when_all_raw sees it (callbacks
  // run in the order they were added), with this worker's name on the root's.
  std::vector<rpc::RawFuture> done{task->done};
  task->done->addCallback([join, me = name_](c10::ivalue::Future& f) {
    if (!f.hasError()) return;
    auto [code, text] = rpc::describe_error(f.exception_ptr());
    join->fail(rpc::make_error(code, me, text));
  });
  for (auto& [worker, sends] : parts) {
    try {
      auto f = link_->run(worker, {context, task->id, rank_, retain_graph, timeout, sends});
      // The reply's error is typed and names that worker already.
      f->addCallback([join](c10::ivalue::Future& f) {
        if (f.hasError()) join->fail(f.exception_ptr());
      });
      {
        std::lock_guard<std::mutex> lock(task->mu);
        task->parts.emplace_back(worker, f);
      }
      done.push_back(std::move(f));
    } catch (...) {
      join->fail(std::current_exception());
      break;
    }
  }

  // `failed` first: an error already there wins.
  join->result = rpc::when_any_raw({join->failed, rpc::when_all_raw(done)});
  join->result->addCallback([task](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(task->mu);
    task->signal_locked();
  });

  // 3. This worker's part runs on this thread: gradients that come back are
  //    delivered on the loop thread, which wakes this one.
  run_root_part(ctx, task, *join, start, timeout);
  if (join->result->hasError()) {
    task->abort(name_, "backward failed");
    for (auto& [worker, _] : parts) link_->abort(worker, context, task->id);
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
