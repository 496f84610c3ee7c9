// The distributed backward engine: autograd/engine.h has the algorithm.
#include "tandem/autograd/engine.h"
#include "tandem/autograd/pass.h"

#include <ATen/ops/ones_like.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <algorithm>
#include <cassert>
#include <map>
#include <set>

#include "tandem/rpc/errors.h"
#include "tandem/rpc/layer.h"
#include "tandem/rpc/agent/spin.h"

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

using torch::autograd::Edge;
using torch::autograd::Node;

// Adds the graph below `entry` to `nodes`: each node reached for the first
// time is added, and each edge out of a newly added node counts one input
// for its target. Receives reached are appended to `recvs` when given.
// Only the caller sees `nodes` (no lock): the graph itself never changes.
void expand(GraphTask::NodeMap& nodes, const std::shared_ptr<Node>& entry,
            std::vector<RecvBackward*>* recvs) {
  auto [first, fresh] = nodes.try_emplace(entry.get());
  if (!fresh) return;
  first->second.fn = entry;
  std::vector<Node*> stack{entry.get()};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (auto* recv = dynamic_cast<RecvBackward*>(n)) {
      if (recvs) recvs->push_back(recv);
      continue;
    }
    for (const Edge& e : n->next_edges()) {
      if (!e.is_valid()) continue;
      auto [it, added] = nodes.try_emplace(e.function.get());
      ++it->second.deps;
      if (added) {
        it->second.fn = e.function;
        stack.push_back(e.function.get());
      }
    }
  }
}

// Adds the graph below each send, each send counting one more input: the
// gradient its receive will send.
void expand_sends(GraphTask::NodeMap& nodes,
                  const std::vector<std::shared_ptr<SendBackward>>& sends) {
  for (const auto& send : sends) {
    if (nodes.count(send.get())) continue;  // named twice
    expand(nodes, send, nullptr);
    ++nodes[send.get()].deps;
  }
}

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

}  // namespace

Engine::Engine(std::shared_ptr<Contexts> contexts, std::shared_ptr<EngineLink> link)
    : contexts_(std::move(contexts)),
      link_(std::move(link)),
      rank_(contexts_->rank()),
      name_(contexts_->name()) {}

std::shared_ptr<GraphTask> Engine::find_task(uint64_t context, uint64_t task) {
  auto ctx = contexts_->find(context);
  if (!ctx) return nullptr;
  std::lock_guard<std::mutex> lock(ctx->mu);
  auto it = ctx->tasks.find(task);
  return it == ctx->tasks.end() ? nullptr : it->second;
}

std::shared_ptr<GraphTask> Engine::task_of(ContextState& ctx, uint64_t task) {
  auto& t = ctx.tasks[task];
  if (!t) t = std::make_shared<GraphTask>(ctx.id, task, id_worker(task), /*attached=*/false);
  return t;
}

std::vector<std::shared_ptr<SendBackward>> Engine::sends_of(
    ContextState& ctx, const std::vector<uint64_t>& messages) const {
  if (ctx.released) {
    throw std::invalid_argument("context " + std::to_string(ctx.id) + " was released on " + name_);
  }
  std::vector<std::shared_ptr<SendBackward>> out;
  for (uint64_t m : messages) {
    auto it = ctx.sends.find(m);
    if (it == ctx.sends.end()) {
      throw std::invalid_argument("autograd message " + std::to_string(m) + " is not recorded on " +
                                  name_ + " in context " + std::to_string(ctx.id));
    }
    out.push_back(it->second);
  }
  return out;
}

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
    ++task->signals;
    task->cv.notify_all();
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
  const auto spin = link_->spin();
  uint64_t seen = task->signals.load();
  while (!join.result->completed()) {
    drain(ctx, task);
    // A wake-up costs more than a loopback hop: spin a little first.
    rpc::spin_until(spin, [&] { return task->signals.load(std::memory_order_acquire) != seen; });
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
                   "{\"context\":" + std::to_string(context) + ",\"task\":" +
                       std::to_string(id) + ",\"ok\":" + (f.hasError() ? "false" : "true") +
                       "}");
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
      ++task->signals;
      task->cv.notify_one();
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

namespace {

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
  const auto tracer = link_->tracer();
  const auto drain_start = tracer ? std::chrono::steady_clock::now()
                                  : std::chrono::steady_clock::time_point{};
  size_t ran = 0;
  while (!task->ready.empty() && task->phase == GraphTask::Phase::kRunning) {
    ++ran;
    Node* n = task->ready.back();
    task->ready.pop_back();
    auto it = task->nodes.find(n);
    std::shared_ptr<Node> fn = std::move(it->second.fn);
    variable_list inputs = std::move(it->second.inputs);
    task->nodes.erase(it);
    lock.unlock();
    variable_list outputs;
    try {
      PassScope scope(ctx.get(), task.get());
      outputs = run_node(ctx, task, *fn, std::move(inputs));
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
  if (done) parts_done_.fetch_add(1, std::memory_order_relaxed);
  if (tracer && ran > 0) {
    tracer->slice("backward nodes", "autograd", drain_start, std::chrono::steady_clock::now(), {},
                  "{\"context\":" + std::to_string(task->context) + ",\"task\":" +
                      std::to_string(task->id) + ",\"nodes\":" + std::to_string(ran) + "}");
  }
  if (done) task->done->markCompleted(c10::IValue());
}

variable_list Engine::run_node(const std::shared_ptr<ContextState>& ctx,
                               const std::shared_ptr<GraphTask>& task, Node& fn,
                               variable_list inputs) {
  if (inputs.empty()) inputs.resize(fn.num_inputs());  // every input undefined
  if (auto* recv = dynamic_cast<RecvBackward*>(&fn)) {
    send_grads(ctx, task, *recv, std::move(inputs));
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

std::string Engine::describe(const std::function<std::string(int)>& worker_name) const {
  std::string out;
  const auto now = std::chrono::steady_clock::now();
  for (const auto& ctx : contexts_->all()) {
    std::vector<std::shared_ptr<GraphTask>> tasks;
    {
      std::lock_guard<std::mutex> lock(ctx->mu);
      for (const auto& [_, t] : ctx->tasks) tasks.push_back(t);
    }
    for (const auto& t : tasks) {
      std::lock_guard<std::mutex> lock(t->mu);
      if (t->phase != GraphTask::Phase::kWaitingForRun && t->phase != GraphTask::Phase::kRunning) {
        continue;
      }
      const auto age =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - t->made).count();
      out += "backward of context " + std::to_string(t->context) + " (task " +
             std::to_string(t->id) + ", root " + worker_name(t->root) + "), " +
             std::to_string(age) + " ms old: ";
      if (t->phase == GraphTask::Phase::kWaitingForRun) {
        out += "waiting for its run request from " + worker_name(t->root) + " (" +
               std::to_string(t->early.size()) + " gradient(s) held)\n";
        continue;
      }
      // Sends still counting their gradient wait for the worker holding
      // their receive; everything else waits behind them, or is ready.
      std::map<int, std::vector<uint64_t>> waiting;
      for (const auto& [node, state] : t->nodes) {
        if (auto* send = dynamic_cast<SendBackward*>(node); send && state.deps > 0) {
          waiting[send->dest()].push_back(send->message());
        }
      }
      out += std::to_string(t->nodes.size()) + " node(s) to run, " +
             std::to_string(t->ready.size()) + " ready" + (t->draining ? ", running" : "");
      for (auto& [worker, messages] : waiting) {
        std::sort(messages.begin(), messages.end());
        out += "; waiting for gradients from " + worker_name(worker) + " (message(s)";
        for (size_t i = 0; i < messages.size() && i < 8; ++i) out += " " + std::to_string(messages[i]);
        if (messages.size() > 8) out += " ...";
        out += ")";
      }
      std::string parts;
      for (const auto& [worker, f] : t->parts) {
        if (!f->completed()) parts += (parts.empty() ? "" : ", ") + worker_name(worker);
      }
      if (!parts.empty()) out += "; parts not done on " + parts;
      out += "\n";
    }
  }
  return out;
}

}  // namespace tandem::autograd
