#include "tandem/autograd/dist_autograd.h"

#include "tandem/rpc/agent/spin.h"
#include "tandem/rpc/layer.h"
#include "tandem/rpc/transport.h"

#include <algorithm>
#include <cassert>
#include <cstdio>

#include "tandem/rpc/errors.h"
#include "tandem/rpc/registry.h"

namespace tandem::autograd {
namespace {

// The engine's messages, over the agent (see dist_autograd.h for the handlers).
class AgentLink final : public EngineLink {
 public:
  explicit AgentLink(rpc::Agent& agent) : agent_(agent) {}

  rpc::RawFuture run(int worker, const RunRequest& r) override {
    c10::List<int64_t> sends;
    sends.reserve(r.sends.size());
    for (uint64_t s : r.sends) sends.push_back(static_cast<int64_t>(s));
    return agent_
        .call(agent_.get_worker_info(worker).name, "tandem.autograd.run",
              {static_cast<int64_t>(r.context), static_cast<int64_t>(r.task),
               static_cast<int64_t>(r.root), r.keep_graph, static_cast<int64_t>(r.timeout.count()),
               std::move(sends)},
              r.timeout)
        .raw();
  }

  void send_grads(int worker, uint64_t context, uint64_t task,
                  std::vector<MessageGrads> grads) override {
    std::vector<c10::IValue> args;
    args.reserve(2 + 2 * grads.size());
    args.emplace_back(static_cast<int64_t>(context));
    args.emplace_back(static_cast<int64_t>(task));
    MessageGrads::append(args, std::move(grads));
    rpc::layer::notify(agent_, agent_.get_worker_info(worker).name, "tandem.autograd.grad",
                       std::move(args));
  }

  void abort(int worker, uint64_t context, uint64_t task) noexcept override {
    try {
      agent_.call(agent_.get_worker_info(worker).name, "tandem.autograd.abort",
                  {static_cast<int64_t>(context), static_cast<int64_t>(task)});
    } catch (const std::exception&) {
      // That worker is gone; so is its part.
    }
  }

  void tell_root(int root, uint64_t context, uint64_t task,
                 std::exception_ptr error) noexcept override {
    try {
      auto [code, text] = rpc::describe_error(error);
      agent_.call(agent_.get_worker_info(root).name, "tandem.autograd.fail",
                  {static_cast<int64_t>(context), static_cast<int64_t>(task),
                   static_cast<int64_t>(code), agent_.name(), text});
    } catch (const std::exception&) {
      // The root is gone: nobody is left to tell.
    }
  }

  void post(std::function<void()> fn) override { rpc::layer::pool(agent_)->post(std::move(fn)); }
  std::chrono::milliseconds default_timeout() const override {
    return agent_.options().rpc_timeout;
  }
  std::chrono::microseconds spin() const override { return agent_.options().sync_spin; }
  void wait_for(const std::function<bool()>& news,
                const std::function<void(std::function<void()>)>& set_waker,
                std::chrono::steady_clock::time_point until) override {
    // As rpc_sync waits (rpc/agent/calls.cc): the spin reads this thread's
    // connection, and past it the thread sleeps there, the gradients'
    // arrival (delivered on this thread) or the task's news ringing it.
    rpc::PollingSpin polling;
    if (rpc::spin_until(spin(), [&] {
          rpc::poll_this_threads_connection();
          return news();
        })) {
      return;
    }
    rpc::ConnectionSleep sleep;
    if (!sleep.ok() || spin().count() == 0) return;
    set_waker(sleep.waker());
    constexpr std::chrono::microseconds kSlice{1000000};  // (a backstop: news rings)
    for (;;) {
      if (news()) break;
      const auto now = std::chrono::steady_clock::now();
      if (now >= until) break;
      const auto left = std::chrono::duration_cast<std::chrono::microseconds>(until - now);
      if (!sleep.wait(std::min(kSlice, left), news)) break;
    }
    set_waker(nullptr);
    rpc::spin_until(spin(), news);  // (what went to the loop thread comes soon)
  }
  bool on_loop_thread() const override { return rpc::layer::on_loop_thread(agent_); }
  std::shared_ptr<rpc::Tracer> tracer() const override { return agent_.tracer(); }

 private:
  rpc::Agent& agent_;  // valid until close(); the agent owns the DistAutograd
};

const bool kRegistered = [] {
  rpc::register_agent_extension(
      [](rpc::Agent& agent) { return std::make_shared<DistAutograd>(agent); });
  return true;
}();

}  // namespace

DistAutograd::DistAutograd(rpc::Agent& agent)
    : agent_(agent),
      contexts_(std::make_shared<Contexts>(
          agent.rank(), agent.name(),
          [&agent](int worker, uint64_t id) {
            return agent
                .call(agent.get_worker_info(worker).name, "tandem.autograd.release",
                      {static_cast<int64_t>(id), static_cast<int64_t>(agent.rank())})
                .raw();
          })),
      // The world is known only once the agent has met the others.
      recorder_(contexts_, [&agent] { return agent.world_size(); }),
      engine_(std::make_shared<Engine>(contexts_, std::make_shared<AgentLink>(agent))) {
  (void)kRegistered;
}

std::shared_ptr<DistAutograd> DistAutograd::of(rpc::Agent& agent) {
  return rpc::layer::require_extension<DistAutograd>(agent, "distributed autograd", "autograd");
}

std::function<std::shared_ptr<DistAutograd>()> DistAutograd::locker() {
  return [weak = weak_from_this()] {
    auto d = weak.lock();
    if (!d) throw rpc::ShutdownError("distributed autograd is shut down");
    return d;
  };
}

void DistAutograd::register_handlers(rpc::Registry& internal) {
  auto self = locker();
  internal.def("tandem.autograd.release", [self](int64_t id, int64_t from) {
    return rpc::Future<void>(
        self()->contexts_->release(static_cast<uint64_t>(id), static_cast<int>(from)), nullptr);
  });
  internal.def("tandem.autograd.run",
                [self](int64_t ctx, int64_t task, int64_t root, bool keep, int64_t timeout_ms,
                       std::vector<int64_t> sends) {
                  auto d = self();
                  if (root < 0 || root >= d->agent_.world_size()) {
                    throw std::invalid_argument("unknown root rank " + std::to_string(root));
                  }
                  RunRequest r{static_cast<uint64_t>(ctx),
                               static_cast<uint64_t>(task),
                               static_cast<int>(root),
                               keep,
                               std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0)),
                               std::vector<uint64_t>(sends.begin(), sends.end())};
                  // The reply is this part's outcome (a PartReply), or its error,
                  // which keeps its kind (Disconnected, Timeout, ...) and names
                  // this worker (rpc::Agent::reply).
                  return rpc::Future<void>(d->engine_->run_part(r), nullptr);
                });
  internal.def("tandem.autograd.fail", [self](int64_t ctx, int64_t task, int64_t code,
                                              std::string worker, std::string message) {
    auto d = self();
    if (code < 0 || code > static_cast<int64_t>(rpc::ErrorCode::kProtocol)) {
      throw std::invalid_argument("unknown error code " + std::to_string(code));
    }
    d->engine_->on_failure(static_cast<uint64_t>(ctx), static_cast<uint64_t>(task),
                           rpc::make_error(static_cast<rpc::ErrorCode>(code), worker, message));
  });
  internal.def("tandem.autograd.abort", [self](int64_t ctx, int64_t task) {
    self()->engine_->on_abort(static_cast<uint64_t>(ctx), static_cast<uint64_t>(task));
  });
}

void DistAutograd::register_loop_handlers(rpc::Registry& on_loop) {
  auto self = locker();
  // Delivering a gradient is bounded work; running the nodes it makes ready
  // is not, and happens on the pool (or on the root's backward() thread).
  on_loop.def_ivalue("tandem.autograd.grad", [self](std::vector<c10::IValue>& args) {
    self()->grad_from_loop(args);
    return c10::IValue();
  });
}

void DistAutograd::grad_from_loop(std::vector<c10::IValue>& args) {
  assert(rpc::layer::on_loop_thread(agent_));
  uint64_t ctx = 0, task = 0;
  try {
    if (args.size() < 4 || !args[0].isInt() || !args[1].isInt()) {
      throw rpc::ProtocolError(
          "'tandem.autograd.grad' takes (context, task, message, (gradient or None, ...), ...)");
    }
    ctx = static_cast<uint64_t>(args[0].toInt());
    task = static_cast<uint64_t>(args[1].toInt());
    engine_->on_grad_from_loop(ctx, task,
                               MessageGrads::parse(args, 2, "a 'tandem.autograd.grad' message"));
  } catch (...) {
    if (task == 0) {
      std::fprintf(stderr, "tandem[%s]: dropped a malformed gradient message\n", name().c_str());
    } else {
      engine_->fail_from_loop(ctx, task, std::current_exception());
    }
  }
}

std::string DistAutograd::debug_info() const {
  std::string out;
  for (const auto& c : contexts_->live_objects()) out += c + " is alive\n";
  out += engine_->describe([this](int rank) {
    try {
      return agent_.get_worker_info(rank).name;
    } catch (const std::exception&) {
      return "rank " + std::to_string(rank);
    }
  });
  return out;
}

}  // namespace tandem::autograd
