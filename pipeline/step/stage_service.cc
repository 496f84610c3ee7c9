#include "tandem/pipeline/step/stage_service.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "tandem/autograd/autograd.h"
#include "tandem/pipeline/pipe.h"
#include "tandem/pipeline/step/errors.h"
#include "tandem/pipeline/step/grad_sync.h"
#include "tandem/pipeline/step/mailbox.h"
#include "tandem/pipeline/step/messages.h"
#include "tandem/pipeline/step/passes.h"
#include "tandem/rpc/common/bounded_set.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/layer.h"
#include "tandem/rpc/registry.h"
#include "tandem/rpc/trace.h"

namespace tandem::pipeline::step {

namespace {

using Clock = std::chrono::steady_clock;

class PipeService final : public rpc::AgentExtension,
                          public std::enable_shared_from_this<PipeService> {
 public:
  explicit PipeService(rpc::Agent& agent) : agent_(agent) {}

  static std::shared_ptr<PipeService> of(rpc::Agent& agent) {
    return rpc::layer::require_extension<PipeService>(agent, "pipeline service", "pipeline");
  }

  // The mailbox of `step`, made if need be; null when the step is over here
  // or the service is closed. A message for it keeps an unclaimed box
  // `timeout` longer; the run claims it.
  std::shared_ptr<Mailbox> box(int64_t step, std::chrono::milliseconds timeout, bool claim) {
    std::lock_guard<std::mutex> lock(mu_);
    drop_expired();
    if (finished_.contains(static_cast<uint64_t>(step))) return nullptr;  // late: dropped
    auto it = boxes_.find(step);
    if (it == boxes_.end()) {
      if (closed_) return nullptr;
      it = boxes_.emplace(step, std::make_shared<Mailbox>()).first;
    }
    Mailbox& b = *it->second;
    if (claim) b.claimed = true;
    b.expires = std::max(b.expires, Clock::now() + timeout);
    return it->second;
  }

  // Steps with a box here: running, or sent messages whose run has not come.
  size_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    drop_expired();
    return boxes_.size();
  }

  // Hands `t` to `worker` (this one: straight into the box).
  void send(const StepHeader& h, const std::vector<std::string>& names, int64_t worker, Slot slot,
            int64_t stage, int64_t chunk, at::Tensor t) {
    if (worker == h.me) {
      if (auto b = box(h.step, h.timeout, false)) b->put(slot, stage, chunk, std::move(t));
      return;
    }
    rpc::LayerAccess::notify(agent_, names[worker], kPutFn,
                             Handoff{h.step, h.timeout, slot, stage, chunk, std::move(t)}.encode());
  }

  RunReply run(const RunRequest& r) {
    const StepHeader& h = r.header;
    const uint64_t context = autograd::current_context_id();
    if (h.train && context == 0) {
      throw std::invalid_argument(
          "tandem.pipe.run: a training step must come inside a "
          "distributed autograd context");
    }
    auto b = box(h.step, h.timeout, true);
    if (!b) {
      throw rpc::ShutdownError("agent " + agent_.name() + " is shutting down, or step " +
                               std::to_string(h.step) +
                               " is over here (it ran, or its messages expired waiting for it)");
    }
    try {
      RunReply reply = run_passes(r, b, context);
      finish(h.step);
      return reply;
    } catch (const StepAborted&) {
      finish(h.step);  // an echo: the worker that failed told everyone
      throw;
    } catch (const std::exception& e) {
      finish(h.step);
      abort_step(agent_, r.worker_names, static_cast<size_t>(h.workers), h.step, h.timeout,
                 e.what(), h.me);
      throw;
    }
  }

  void register_handlers(rpc::Registry& internal) override {
    std::weak_ptr<PipeService> weak = weak_from_this();
    internal.def_ivalue(kRunFn, [weak](std::vector<c10::IValue>& args) -> c10::IValue {
      const RunRequest request = RunRequest::decode(args);
      auto self = weak.lock();
      if (!self) throw rpc::ShutdownError("the pipeline service is shut down");
      return self->run(request).encode();
    });
  }

  // Puts and aborts are bounded and never block: where they are delivered
  // (the loop thread, or a thread polling the connection: rpc/transport.h, 8.), so
  // that runs holding pool threads for a whole step cannot starve them.
  void register_loop_handlers(rpc::Registry& on_loop) override {
    std::weak_ptr<PipeService> weak = weak_from_this();
    on_loop.def_ivalue(kPutFn, [weak](std::vector<c10::IValue>& args) -> c10::IValue {
      Handoff h = Handoff::decode(args);
      if (auto s = weak.lock()) {
        if (auto b = s->box(h.step, h.timeout, false)) {
          b->put(h.slot, h.stage, h.chunk, std::move(h.tensor));
        }
      }
      return c10::IValue();
    });
    on_loop.def_ivalue(kAbortFn, [weak](std::vector<c10::IValue>& args) -> c10::IValue {
      const AbortNote note = AbortNote::decode(args);
      if (auto s = weak.lock()) {
        if (auto b = s->box(note.step, note.timeout, false)) b->abort(note.why);
      }
      return c10::IValue();
    });
  }

  void before_send(rpc::Message&, int) override {}
  void after_encode(const rpc::Message&, rpc::OutFrame&, int) override {}
  void after_receive(rpc::Message&, int) override {}
  std::vector<std::string> live_objects() const override { return {}; }

  void close() override {
    std::map<int64_t, std::shared_ptr<Mailbox>> boxes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      boxes.swap(boxes_);
    }
    for (auto& [_, b] : boxes) b->abort("agent " + agent_.name() + " shut down");
  }

 private:
  // A pass's PassIo: the step's mailbox and the other workers, for the
  // pass's own stage and micro-batch.
  class Io final : public PassIo {
   public:
    Io(PipeService& service, const RunRequest& r, Mailbox& box, const Action& pass,
       std::function<void()> running)
        : service_(service), r_(r), box_(box), pass_(pass), running_(std::move(running)) {}

    at::Tensor take(Slot slot) override {
      auto t = box_.take(slot, pass_.stage, pass_.chunk, r_.header.timeout);
      if (!t) {
        throw PassTimeoutError(
            pass_, service_.agent_.name(),
            std::string("its ") + (slot == kActivation ? "input" : "output's gradient") +
                " did not come within " + std::to_string(r_.header.timeout.count()) + " ms");
      }
      return std::move(*t);
    }
    void send(Slot slot, int64_t stage, at::Tensor t) override {
      service_.send(r_.header, r_.worker_names, r_.header.worker_of(stage), slot, stage,
                    pass_.chunk, std::move(t));
    }
    void running() override { running_(); }

   private:
    PipeService& service_;
    const RunRequest& r_;
    Mailbox& box_;
    const Action& pass_;
    std::function<void()> running_;
  };

  // The step's passes in order, each timed (from when its input was there)
  // and, on a failure, named; then the gradients into `context`.
  RunReply run_passes(const RunRequest& r, const std::shared_ptr<Mailbox>& shared_box,
                      uint64_t context) {
    Mailbox& box = *shared_box;
    StepState state(r, agent_.name());
    rpc::Tracer* const tracer = agent_.tracer().get();
    const auto t0 = Clock::now();
    auto us = [&] { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); };
    RunReply reply;
    c10::AutoGradMode grad_on(r.header.train);
    GradSync sync(agent_, r, context, shared_box, t0);
    for (size_t i = 0; i < r.passes.passes.size(); ++i) {
      const Action& pass = r.passes.passes[i];
      PassTime time{pass};
      Io io(*this, r, box, pass, [&] { time.start_us = us(); });
      try {
        run_pass(state, pass, io);
      } catch (const StepAborted&) {
        throw;  // an echo keeps its words
      } catch (const PassTimeoutError&) {
        throw;  // named already
      } catch (const std::exception& e) {
        throw PassError(pass, agent_.name(), e.what());
      }
      time.end_us = us();
      reply.times.times.push_back(time);
      if (tracer) {
        // rpc/trace.h: "F3@1" (forward of micro-batch 3 through stage 1)
        // from when its input was there.
        const auto begin = t0 + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double, std::micro>(time.start_us));
        tracer->slice(to_string(pass), "pipeline", begin, Clock::now(), {},
                      "{\"step\":" + std::to_string(r.header.step) +
                          ",\"stage\":" + std::to_string(pass.stage) +
                          ",\"micro_batch\":" + std::to_string(pass.chunk) + "}");
      }
      sync.after_pass(state, i);
    }
    sync.finish(state);
    reply.allreduces = sync.times();
    hand_over_gradients(state, agent_, context);
    reply.losses = state.losses;
    reply.peak_stash = state.peak;
    reply.outputs = std::move(state.outputs);
    return reply;
  }

  void finish(int64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    boxes_.erase(step);
    finished_.insert(static_cast<uint64_t>(step));
    drop_expired();
  }

  // mu_ held.
  void drop_expired() {
    const auto now = Clock::now();
    for (auto it = boxes_.begin(); it != boxes_.end();) {
      if (!it->second->claimed && it->second->expires < now) {
        finished_.insert(static_cast<uint64_t>(it->first));
        it = boxes_.erase(it);
      } else {
        ++it;
      }
    }
  }

  rpc::Agent& agent_;
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<Mailbox>> boxes_;
  rpc::BoundedSet<uint64_t> finished_{1024};
  bool closed_ = false;
};

const bool kRegistered = [] {
  rpc::register_agent_extension(
      [](rpc::Agent& agent) { return std::make_shared<PipeService>(agent); });
  return true;
}();

}  // namespace

void require_stage_service(rpc::Agent& agent) {
  (void)kRegistered;
  PipeService::of(agent);
}

void abort_step(rpc::Agent& agent, const std::vector<std::string>& names, size_t count,
                int64_t step, std::chrono::milliseconds timeout, const std::string& why,
                int64_t skip) {
  for (size_t w = 0; w < count; ++w) {
    if (static_cast<int64_t>(w) == skip) continue;
    try {
      rpc::LayerAccess::notify(agent, names[w], kAbortFn, AbortNote{step, timeout, why}.encode());
    } catch (const std::exception&) {
    }
  }
}

}  // namespace tandem::pipeline::step

namespace tandem::pipeline {

size_t pending_steps(rpc::Agent& agent) { return step::PipeService::of(agent)->pending(); }

}  // namespace tandem::pipeline
