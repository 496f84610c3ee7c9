#include "tandem/autograd/container.h"

#include "tandem/autograd/autograd.h"
#include "tandem/rpc/api.h"

#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdio>
#include <unordered_set>

#include "tandem/rpc/errors.h"
#include "tandem/rpc/registry.h"

namespace tandem::autograd {
namespace {

constexpr size_t kReleasedMemory = 1 << 16;  // released ids remembered

// The context a Context object made current on this thread.
struct Current {
  std::weak_ptr<Container> owner;
  const Container* raw = nullptr;  // owner, for a cheap comparison on hot paths
  uint64_t id = 0;
};
thread_local Current tls_current;

// Every tensor inside `v` that requires grad (in any order: only the set matters).
void collect_grad_tensors(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.requires_grad()) out.push_back(t);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) collect_grad_tensors(e, out);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) collect_grad_tensors(e, out);
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) {
      collect_grad_tensors(kv.key(), out);
      collect_grad_tensors(kv.value(), out);
    }
  }
}

// The reach of a message carrying `tensors` (autograd/engine.h): for every
// RecvBackward below them on this worker, its message id and its own reach.
std::vector<uint64_t> reach_of(const std::vector<at::Tensor>& tensors) {
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const auto& t : tensors) {
    if (auto* fn = t.grad_fn().get(); fn && seen.insert(fn).second) stack.push_back(fn);
  }
  std::vector<uint64_t> out;
  while (!stack.empty()) {
    torch::autograd::Node* n = stack.back();
    stack.pop_back();
    if (auto* recv = dynamic_cast<RecvBackward*>(n)) {
      out.push_back(recv->message());
      out.insert(out.end(), recv->reach().begin(), recv->reach().end());
      continue;
    }
    for (const auto& e : n->next_edges()) {
      if (e.is_valid() && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

const bool kRegistered = [] {
  rpc::register_agent_extension(
      [](rpc::Agent& agent) { return std::make_shared<Container>(agent); });
  return true;
}();

}  // namespace

variable_list RecvBackward::apply(variable_list&&) {
  throw std::logic_error(
      "this tensor came over RPC inside distributed autograd context " +
      std::to_string(context_) +
      ": differentiate it with tandem::autograd::backward(context_id, roots), not "
      "LibTorch's own backward()");
}

Container::Container(rpc::Agent& agent)
    : agent_(agent), rank_(agent.rank()), name_(agent.name()) {
  (void)kRegistered;
}

bool Container::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

std::shared_ptr<Container> Container::of(rpc::Agent& agent) {
  auto c = agent.extension<Container>();
  if (!c) {
    throw std::logic_error("agent " + agent.name() +
                           " has no distributed autograd: it was created before "
                           "Tandem's autograd library was loaded");
  }
  return c;
}

uint64_t Container::next_id(std::atomic<uint64_t>& counter) const {
  return (static_cast<uint64_t>(rank_) << 48) | counter.fetch_add(1);
}

uint64_t Container::new_context() {
  uint64_t id = next_id(next_context_);
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw rpc::ShutdownError("agent " + name_ + " is shut down");
  contexts_.emplace(id, std::make_shared<ContextState>(id));
  return id;
}

uint64_t Container::current_context() const { return rpc::autograd_context_for(agent_); }

std::shared_ptr<ContextState> Container::find(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(id);
  return it == contexts_.end() ? nullptr : it->second;
}

std::shared_ptr<ContextState> Container::get(uint64_t id) const {
  auto ctx = find(id);
  if (!ctx) {
    throw std::invalid_argument("no distributed autograd context " + std::to_string(id) +
                                " on " + name_ + " (never used here, or released)");
  }
  return ctx;
}

std::shared_ptr<ContextState> Container::get_or_create(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(id);
  if (it != contexts_.end()) return it->second;
  if (closed_ || released_.count(id)) return nullptr;
  return contexts_.emplace(id, std::make_shared<ContextState>(id)).first->second;
}

size_t Container::live_contexts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return contexts_.size();
}

// ---- recording -----------------------------------------------------------------

void Container::before_send(rpc::Message& m, int dest) {
  if (m.kind == rpc::MessageKind::kRequest) {
    // The agent set the context current on the sending thread (rpc/scope.h).
    if (m.autograd_context == 0) return;  // outside any context: nothing to do
    if (m.callee.rfind("tandem.autograd.", 0) == 0) {  // the engine's own traffic
      m.autograd_context = 0;
      return;
    }
  } else if (m.kind != rpc::MessageKind::kResponse || m.autograd_context == 0) {
    return;
  }
  auto ctx = get_or_create(m.autograd_context);
  if (!ctx) {  // released here: the message travels outside any context
    m.autograd_context = 0;
    return;
  }
  std::vector<at::Tensor> tensors;
  for (const auto& v : m.values) collect_grad_tensors(v, tensors);
  bool has_recvs;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    if (ctx->released) {  // released meanwhile: the message travels outside it
      m.autograd_context = 0;
      return;
    }
    ctx->known_workers.insert(dest);
    has_recvs = ctx->recvs > 0;
  }
  if (tensors.empty()) return;
  m.autograd_message = next_id(next_message_);
  // Nothing received here in this context: no gradient can leave this worker
  // from below these tensors, so the reach is empty without a walk.
  if (has_recvs) m.autograd_reach = reach_of(tensors);
}

void Container::after_encode(const rpc::Message& m, rpc::OutFrame& frame, int) {
  if (m.autograd_message == 0) return;
  auto ctx = find(m.autograd_context);
  if (!ctx) return;
  torch::autograd::edge_list edges;
  edges.reserve(frame.grad_sources.size());
  for (const auto& t : frame.grad_sources) edges.push_back(torch::autograd::impl::gradient_edge(t));
  auto send = std::make_shared<SendBackward>(m.autograd_context, m.autograd_message,
                                             std::move(edges));
  for (const auto& t : frame.grad_sources) send->add_input_metadata(t);
  std::lock_guard<std::mutex> lock(ctx->mu);
  if (!ctx->released) ctx->sends.emplace(m.autograd_message, std::move(send));
}

void Container::after_receive(rpc::Message& m, int from) {
  if (m.autograd_message == 0 || m.grad_tensors.empty()) return;
  if (id_worker(m.autograd_message) != from) {
    throw rpc::ProtocolError("autograd message " + std::to_string(m.autograd_message) +
                             " from rank " + std::to_string(from) + " names another sender");
  }
  for (uint64_t r : m.autograd_reach) {
    if (id_worker(r) < 0 || id_worker(r) >= agent_.world_size()) {
      throw rpc::ProtocolError("autograd reach names unknown rank " +
                               std::to_string(id_worker(r)));
    }
  }
  // Released here: the tensors arrive without history, as new leaves.
  auto as_leaves = [&] {
    for (auto& t : m.grad_tensors) t.set_requires_grad(true);
  };
  auto ctx = get_or_create(m.autograd_context);
  if (!ctx) return as_leaves();
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    if (ctx->released) return as_leaves();
    ++ctx->recvs;
  }
  auto recv = std::make_shared<RecvBackward>(m.autograd_context, m.autograd_message, from,
                                             std::move(m.autograd_reach));
  for (auto& t : m.grad_tensors) torch::autograd::set_history(t, recv);
}

// ---- release -------------------------------------------------------------------

rpc::RawFuture Container::release(uint64_t id, int from) {
  std::shared_ptr<ContextState> ctx;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = contexts_.find(id);
    if (it != contexts_.end()) {
      ctx = std::move(it->second);
      contexts_.erase(it);
    }
    if (released_.insert(id).second) {
      released_order_.push_back(id);
      if (released_order_.size() > kReleasedMemory) {
        released_.erase(released_order_.front());
        released_order_.pop_front();
      }
    }
  }
  if (!ctx) return rpc::when_all_raw({});
  std::vector<int> workers;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    ctx->released = true;
    for (int w : ctx->known_workers) {
      if (w != from && w != rank_) workers.push_back(w);
    }
  }
  std::unordered_map<uint64_t, std::shared_ptr<GraphTask>> live;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    live.swap(ctx->tasks);
  }
  for (auto& [_, task] : live) abort_task(task, "its context was released");
  std::vector<rpc::RawFuture> forwarded;
  for (int w : workers) {
    try {
      forwarded.push_back(agent_
                              .call(agent_.get_worker_info(w).name, "tandem.autograd.release",
                                    {static_cast<int64_t>(id), static_cast<int64_t>(rank_)})
                              .raw());
    } catch (const std::exception&) {
      // Shut down or unreachable: nothing there can be freed from here.
    }
  }
  return rpc::when_all_raw(forwarded);
}

std::vector<std::string> Container::live_objects() const {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, _] : contexts_) {
    out.push_back("distributed autograd context " + std::to_string(id));
  }
  std::sort(out.begin(), out.end());
  return out;
}

void Container::close() {
  std::unordered_map<uint64_t, std::shared_ptr<ContextState>> contexts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    contexts.swap(contexts_);
  }
  for (auto& [id, ctx] : contexts) {
    std::unordered_map<uint64_t, std::shared_ptr<GraphTask>> tasks;
    {
      std::lock_guard<std::mutex> lock(ctx->mu);
      tasks.swap(ctx->tasks);
    }
    for (auto& [tid, task] : tasks) {
      // A backward() running here fails; a part run for another worker just
      // stops: its root learns it from the connection closing, as if this
      // worker had died.
      if (task->root == rank_) {
        fail(task, std::make_exception_ptr(rpc::ShutdownError(
                       "agent " + name_ + " shut down during distributed backward")));
      } else {
        task->close();
      }
    }
  }
}

// ---- handlers ------------------------------------------------------------------

std::function<std::shared_ptr<Container>()> Container::locker() {
  return [weak = weak_from_this()] {
    auto c = weak.lock();
    if (!c) throw rpc::ShutdownError("distributed autograd is shut down");
    return c;
  };
}

void Container::register_handlers(rpc::Registry& internal) {
  auto self = locker();
  internal.def("tandem.autograd.release", [self](int64_t id, int64_t from) {
    return rpc::Future<void>(self()->release(static_cast<uint64_t>(id), static_cast<int>(from)),
                             nullptr);
  });
  internal.def("tandem.autograd.run", [self](int64_t ctx, int64_t task, int64_t root, bool keep,
                                             int64_t timeout_ms, std::vector<int64_t> sends) {
    auto c = self();
    std::vector<uint64_t> ids(sends.begin(), sends.end());
    if (root < 0 || root >= c->agent_.world_size()) {
      throw std::invalid_argument("unknown root rank " + std::to_string(root));
    }
    // The reply is this part's outcome: an error keeps its kind (Disconnected,
    // Timeout, ...) and names this worker (rpc::Agent::reply).
    return rpc::Future<void>(
        c->run_part(static_cast<uint64_t>(ctx), static_cast<uint64_t>(task),
                    static_cast<int>(root), keep, ids,
                    std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0))),
        nullptr);
  });
  internal.def("tandem.autograd.fail", [self](int64_t ctx, int64_t task, int64_t code,
                                              std::string worker, std::string message) {
    auto c = self();
    if (code < 0 || code > static_cast<int64_t>(rpc::ErrorCode::kProtocol)) {
      throw std::invalid_argument("unknown error code " + std::to_string(code));
    }
    auto t = c->find_task(static_cast<uint64_t>(ctx), static_cast<uint64_t>(task));
    if (!t) return;
    std::function<void(std::exception_ptr)> report;
    {
      std::lock_guard<std::mutex> lock(t->mu);
      report = t->report;
    }
    if (report) report(rpc::make_error(static_cast<rpc::ErrorCode>(code), worker, message));
  });
  internal.def("tandem.autograd.abort", [self](int64_t ctx, int64_t task) {
    auto c = self();
    auto state = c->find(static_cast<uint64_t>(ctx));
    if (!state) return;
    std::shared_ptr<GraphTask> t;
    {
      // Made here when the abort overtook `run`: that `run` then finds it aborted.
      std::lock_guard<std::mutex> lock(state->mu);
      t = c->task_of(*state, static_cast<uint64_t>(task));
    }
    c->abort_task(t, "aborted by its root");
  });
}

void Container::register_loop_handlers(rpc::Registry& on_loop) {
  auto self = locker();
  // Delivering a gradient is bounded work; running the nodes it makes ready
  // is not, and happens on the pool (or on the root's backward() thread).
  on_loop.def_ivalue("tandem.autograd.grad", [self](std::vector<c10::IValue>& args) {
    auto c = self();
    uint64_t ctx = 0, task = 0;
    try {
      if (args.size() != 4 || !args[0].isInt() || !args[1].isInt() || !args[2].isInt() ||
          !args[3].isTuple()) {
        throw rpc::ProtocolError("'tandem.autograd.grad' takes (context, task, message, tuple)");
      }
      ctx = static_cast<uint64_t>(args[0].toInt());
      task = static_cast<uint64_t>(args[1].toInt());
      variable_list list;
      for (const auto& g : args[3].toTupleRef().elements()) {
        if (g.isNone()) {
          list.emplace_back();
        } else if (g.isTensor()) {
          list.push_back(g.toTensor());
        } else {
          throw std::invalid_argument("a gradient must be a tensor or None, got " + g.tagKind());
        }
      }
      c->on_grad(ctx, task, static_cast<uint64_t>(args[2].toInt()), std::move(list));
    } catch (...) {
      // Gradients come one way (no reply): the root hears of it from here.
      // Telling another worker may mean connecting: not on the loop thread.
      auto e = std::current_exception();
      if (task == 0) {
        std::fprintf(stderr, "tandem[%s]: dropped a malformed gradient message\n",
                     c->name_.c_str());
      } else if (id_worker(task) == c->rank_) {
        c->tell_root(ctx, task, e);
      } else {
        c->agent_.pool()->post([c, ctx, task, e] { c->tell_root(ctx, task, e); });
      }
    }
    return c10::IValue();
  });
}

// ---- the public API ------------------------------------------------------------

Context::Context() : Context(*rpc::current_agent()) {}

Context::Context(rpc::Agent& agent)
    : container_(Container::of(agent)), release_timeout_(agent.options().rpc_timeout) {
  uint64_t outer = current_context_id();
  if (outer != 0) {
    throw std::logic_error("distributed autograd context " + std::to_string(outer) +
                           " is already current on this thread: contexts do not nest");
  }
  id_ = container_->new_context();
  tls_current = {container_, container_.get(), id_};
  rpc::CallScope scope = rpc::current_scope();
  scope.context_agent = &agent;
  scope.autograd_context = id_;
  scope_ = std::make_unique<rpc::ScopeGuard>(scope);
}

Context::~Context() {
  scope_.reset();
  if (tls_current.id == id_) tls_current = {};
  try {
    rpc::wait_raw(container_->release(id_), release_timeout_);
  } catch (const std::exception&) {
    // The agent is gone: nothing is left to release.
  }
}

uint64_t current_context_id() {
  if (tls_current.id != 0) return tls_current.owner.expired() ? 0 : tls_current.id;
  return rpc::current_scope().autograd_context;  // a handler's or a callback's
}

namespace {
// The container that owns `context_id` on this thread, else the current agent's.
std::shared_ptr<Container> container_for(uint64_t context_id) {
  if (tls_current.id == context_id) {
    if (auto c = tls_current.owner.lock()) {
      if (c->closed()) throw rpc::ShutdownError("agent " + c->name() + " is shut down");
      return c;
    }
  }
  return Container::of(*rpc::current_agent());
}
}  // namespace

void backward(uint64_t context_id, const std::vector<at::Tensor>& roots, bool retain_graph) {
  container_for(context_id)->backward(context_id, roots, retain_graph, rpc::kDefaultTimeout);
}

void backward(rpc::Agent& agent, uint64_t context_id, const std::vector<at::Tensor>& roots,
              bool retain_graph, std::chrono::milliseconds timeout) {
  Container::of(agent)->backward(context_id, roots, retain_graph, timeout);
}

Gradients get_gradients(uint64_t context_id) {
  auto c = container_for(context_id);
  return Gradients(c->get_gradients(context_id), context_id, c->name());
}

Gradients get_gradients(rpc::Agent& agent, uint64_t context_id) {
  auto c = Container::of(agent);
  return Gradients(c->get_gradients(context_id), context_id, c->name());
}

at::Tensor Gradients::at(const at::Tensor& t) const {
  auto it = find(t);
  if (it == end()) {
    throw std::out_of_range(
        "get_gradients(" + std::to_string(context_id_) + ") on " + worker_ +
        ": this tensor got no gradient in that context (it was not used by the roots "
        "backward() ran from, does not require grad, or lives on another worker)");
  }
  return it->value();
}

size_t live_contexts(rpc::Agent& agent) { return Container::of(agent)->live_contexts(); }

}  // namespace tandem::autograd
