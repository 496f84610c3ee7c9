#include "tandem/autograd/container.h"

#include "tandem/autograd/autograd.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/layer.h"

#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdio>
#include <unordered_set>

#include "tandem/rpc/errors.h"
#include "tandem/rpc/registry.h"

namespace tandem::autograd {
namespace {

// The context a Context object made current on this thread.
struct Current {
  std::weak_ptr<Container> owner;
  const Container* raw = nullptr;  // owner, for a cheap comparison on hot paths
  uint64_t id = 0;
};
thread_local Current tls_current;

const bool kRegistered = [] {
  rpc::register_agent_extension(
      [](rpc::Agent& agent) { return std::make_shared<Container>(agent); });
  return true;
}();

}  // namespace

Container::Container(rpc::Agent& agent)
    : agent_(agent),
      rank_(agent.rank()),
      name_(agent.name()),
      contexts_(std::make_shared<Contexts>(
          agent.rank(), agent.name(),
          [&agent](int worker, uint64_t id) {
            return agent
                .call(agent.get_worker_info(worker).name, "tandem.autograd.release",
                      {static_cast<int64_t>(id), static_cast<int64_t>(agent.rank())})
                .raw();
          })),
      recorder_(contexts_, [&agent] { return agent.world_size(); }) {
  (void)kRegistered;
}

std::shared_ptr<Container> Container::of(rpc::Agent& agent) {
  auto c = rpc::layer::extension<Container>(agent);
  if (!c) {
    throw std::logic_error("agent " + agent.name() +
                           " has no distributed autograd: it was created before "
                           "Tandem's autograd library was loaded");
  }
  return c;
}

void Container::before_send(rpc::Message& m, int dest) { recorder_.before_send(m, dest); }

void Container::after_encode(const rpc::Message& m, rpc::OutFrame& frame, int dest) {
  recorder_.after_encode(m, frame, dest);
}

void Container::after_receive(rpc::Message& m, int from) { recorder_.after_receive(m, from); }

std::vector<std::string> Container::live_objects() const { return contexts_->live_objects(); }

void Container::close() { contexts_->close(); }

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
    return rpc::Future<void>(
        self()->contexts_->release(static_cast<uint64_t>(id), static_cast<int>(from)), nullptr);
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
    auto state = c->contexts_->find(static_cast<uint64_t>(ctx));
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
        rpc::layer::pool(c->agent_)->post([c, ctx, task, e] { c->tell_root(ctx, task, e); });
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
  id_ = container_->contexts().new_context();
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
    rpc::wait_raw(container_->contexts().release(id_), release_timeout_);
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
      if (c->contexts().closed()) throw rpc::ShutdownError("agent " + c->name() + " is shut down");
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

size_t live_contexts(rpc::Agent& agent) { return Container::of(agent)->contexts().live(); }

}  // namespace tandem::autograd
