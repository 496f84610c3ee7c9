#include "tandem/pipeline/pipe.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/tensor_split.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "tandem/autograd/autograd.h"
#include "tandem/pipeline/step/errors.h"
#include "tandem/pipeline/step/losses.h"
#include "tandem/pipeline/step/messages.h"
#include "tandem/pipeline/step/split_backward.h"
#include "tandem/remote_module/served.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/bounded_set.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/layer.h"

namespace tandem::pipeline {

namespace {

using Clock = std::chrono::steady_clock;

// ---- a worker's side of one step ----

using namespace step;  // the step's messages and errors

// Tells workers 0 .. count - 1 of `names` but `skip` that `step` (whose
// passes wait `timeout` for their messages) is off. Best effort: a worker
// that cannot be reached waits out its pass timeout.
void abort_step(rpc::Agent& agent, const std::vector<std::string>& names, size_t count,
                int64_t step, std::chrono::milliseconds timeout, const std::string& why,
                int64_t skip = -1) {
  for (size_t w = 0; w < count; ++w) {
    if (static_cast<int64_t>(w) == skip) continue;
    try {
      rpc::LayerAccess::notify(agent, names[w], kAbortFn, AbortNote{step, timeout, why}.encode());
    } catch (const std::exception&) {
    }
  }
}

// What other workers sent this one for a step: stage inputs and output
// gradients, by (slot, stage, chunk). A box whose step's run has not come
// (it was never sent, or its driver died) is dropped once the step's pass
// timeout has passed since its last message.
struct Box {
  bool claimed = false;           // the step's run is here (PipeService::mu_)
  Clock::time_point expires{};    // unclaimed past this: dropped (PipeService::mu_)
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::tuple<int64_t, int64_t, int64_t>, at::Tensor> items;
  std::string aborted;  // non-empty: the step failed elsewhere

  void put(Slot slot, int64_t stage, int64_t chunk, at::Tensor t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      items[{slot, stage, chunk}] = std::move(t);
    }
    cv.notify_all();
  }
  void abort(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (aborted.empty()) aborted = why;
    }
    cv.notify_all();
  }
  // std::nullopt when it did not come within `timeout`.
  std::optional<at::Tensor> take(Slot slot, int64_t stage, int64_t chunk,
                                 std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    const auto key = std::make_tuple(static_cast<int64_t>(slot), stage, chunk);
    const bool came = cv.wait_for(lock, timeout, [&] { return items.count(key) || !aborted.empty(); });
    if (!aborted.empty()) throw StepAborted(aborted);
    if (!came) return std::nullopt;
    at::Tensor t = std::move(items[key]);
    items.erase(key);
    return t;
  }
};

class PipeService final : public rpc::AgentExtension,
                          public std::enable_shared_from_this<PipeService> {
 public:
  explicit PipeService(rpc::Agent& agent) : agent_(agent) {}

  static std::shared_ptr<PipeService> of(rpc::Agent& agent) {
    return rpc::layer::require_extension<PipeService>(agent, "pipeline service", "pipeline");
  }

  // The box of `step`, made if need be; null when the step is over here or
  // the service is closed. A message for it keeps an unclaimed box
  // `timeout` longer; the run claims it.
  std::shared_ptr<Box> box(int64_t step, std::chrono::milliseconds timeout, bool claim) {
    std::lock_guard<std::mutex> lock(mu_);
    drop_expired();
    if (finished_.contains(static_cast<uint64_t>(step))) return nullptr;  // late: dropped
    auto it = boxes_.find(step);
    if (it == boxes_.end()) {
      if (closed_) return nullptr;
      it = boxes_.emplace(step, std::make_shared<Box>()).first;
    }
    Box& b = *it->second;
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

  // Hands `t` to `worker` (this one: straight into the box).
  void send(const RunRequest& r, int64_t worker, Slot slot, int64_t stage, int64_t chunk,
            at::Tensor t) {
    const StepHeader& h = r.header;
    if (worker == h.me) {
      if (auto b = box(h.step, h.timeout, false)) b->put(slot, stage, chunk, std::move(t));
      return;
    }
    rpc::LayerAccess::notify(agent_, r.worker_names[worker], kPutFn,
                             Handoff{h.step, h.timeout, slot, stage, chunk, std::move(t)}.encode());
  }

  RunReply run(const RunRequest& r) {
    const StepHeader& a = r.header;
    const uint64_t context = autograd::current_context_id();
    if (a.train && context == 0) {
      throw std::invalid_argument("tandem.pipe.run: a training step must come inside a "
                                  "distributed autograd context");
    }
    auto b = box(a.step, a.timeout, true);
    if (!b) {
      throw rpc::ShutdownError("agent " + agent_.name() + " is shutting down, or step " +
                               std::to_string(a.step) +
                               " is over here (it ran, or its messages expired waiting for it)");
    }
    try {
      RunReply reply = run_passes(r, *b, context);
      finish(a.step);
      return reply;
    } catch (const StepAborted&) {
      finish(a.step);  // an echo: the worker that failed told everyone
      throw;
    } catch (const std::exception& e) {
      finish(a.step);
      abort_step(agent_, r.worker_names, static_cast<size_t>(a.workers), a.step, a.timeout,
                 e.what(), a.me);
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
    std::map<int64_t, std::shared_ptr<Box>> boxes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      boxes.swap(boxes_);
    }
    for (auto& [_, b] : boxes) b->abort("agent " + agent_.name() + " shut down");
  }

 private:
  struct Stash {
    at::Tensor input;   // a leaf (requires grad past stage 0)
    at::Tensor output;  // the stage's output, or the weighted loss on the last stage
    // Between a split backward's I and W passes:
    at::Tensor grad;                    // the output's gradient
    std::shared_ptr<step::WeightWork> work;  // null: W runs the whole parameter backward
    bool input_done = false;
  };

  RunReply run_passes(const RunRequest& a, Box& box, uint64_t context) {
    const StepHeader& h = a.header;
    std::map<int64_t, std::shared_ptr<nn::Served>> served;
    std::map<int64_t, std::vector<at::Tensor>> params;
    for (size_t i = 0; i < a.stage_ids.size(); ++i) {
      auto s = nn::served_of(a.modules[i].local_value());
      if (!s) throw std::invalid_argument("pipeline stage " + std::to_string(a.stage_ids[i]) +
                                          " is not a RemoteModule's module");
      served[a.stage_ids[i]] = s;
      for (auto& [_, p] : s->parameters()) {
        if (p.requires_grad()) params[a.stage_ids[i]].push_back(p);
      }
    }
    const int64_t last = h.stages - 1;
    LossFn loss_fn;
    if (served.count(last) && h.train) loss_fn = step::loss_named(a.loss, agent_.name());
    std::vector<at::Tensor> outputs(served.count(last) && !h.train ? h.chunks : 0);
    std::map<std::pair<int64_t, int64_t>, Stash> stash;
    std::map<int64_t, std::vector<at::Tensor>> sums;  // per stage, per parameter
    at::Tensor losses = at::full({h.chunks}, std::numeric_limits<double>::quiet_NaN(), at::kDouble);
    RunReply reply;
    rpc::Tracer* const tracer = agent_.tracer().get();
    const auto t0 = Clock::now();
    auto us = [&] { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); };
    int64_t peak = 0;
    c10::AutoGradMode grad_on(h.train);
    // Adds one pass's parameter gradients to the stage's sums.
    auto add_to_sums = [&](int64_t stage, const std::vector<at::Tensor>& grads) {
      auto& sum = sums[stage];
      sum.resize(params[stage].size());
      for (size_t p = 0; p < params[stage].size(); ++p) {
        if (!grads[p].defined()) continue;
        // autograd's results are fresh tensors of ours: add in place.
        if (sum[p].defined()) {
          sum[p].add_(grads[p]);
        } else {
          sum[p] = grads[p];
        }
      }
    };
    for (const Action& pass : a.passes.passes) {
      const auto kind = pass.kind;
      const bool fwd = kind == Action::kForward;
      const int64_t stage = pass.stage, chunk = pass.chunk;
      PassTime time{pass};
      auto take = [&](Slot slot) {
        auto t = box.take(slot, stage, chunk, h.timeout);
        if (!t) {
          throw PassTimeoutError(pass, agent_.name(),
                                 std::string("its ") +
                                     (slot == kActivation ? "input" : "output's gradient") +
                                     " did not come within " + std::to_string(h.timeout.count()) +
                                     " ms");
        }
        return std::move(*t);
      };
      try {
        if (fwd) {
          at::Tensor x = stage == 0 ? a.inputs.at(chunk)
                                    : take(kActivation);
          time.start_us = us();  // the pass runs from here; waiting for its input is bubble
          const c10::Device device = served.at(stage)->device;
          x = x.detach().to(device);  // tensors arrive on the CPU; the stage may be on a GPU
          if (h.train && stage > 0 && x.is_floating_point()) x.requires_grad_(true);
          std::vector<c10::IValue> args{x};
          c10::IValue out = served.at(stage)->forward(args);
          if (!out.isTensor()) {
            throw std::invalid_argument("the stage's forward gave a " + out.tagKind() +
                                        ", not one tensor");
          }
          at::Tensor y = out.toTensor();
          if (!h.train) {
            if (stage == last) {
              outputs.at(chunk) = y;
            } else {
              send(a, (stage + 1) % h.workers, kActivation, stage + 1, chunk, y);
            }
          } else if (stage == last) {
            at::Tensor l = loss_fn(y, a.targets.at(chunk).to(y.device()));
            losses.data_ptr<double>()[chunk] = l.detach().item<double>();
            Stash& held = stash[{stage, chunk}];
            held.input = x;
            held.output = l * a.weights.at(chunk);
          } else {
            Stash& held = stash[{stage, chunk}];
            held.input = x;
            held.output = y;
            send(a, (stage + 1) % h.workers, kActivation, stage + 1, chunk, y.detach());
          }
          peak = std::max(peak, static_cast<int64_t>(stash.size()));
        } else if (kind == Action::kWeightGrad) {
          auto it = stash.find({stage, chunk});
          if (it == stash.end() || !it->second.input_done) {
            throw std::logic_error("no input-gradient pass ran before this weight-gradient pass");
          }
          Stash s = std::move(it->second);
          stash.erase(it);
          time.start_us = us();
          if (s.work) {
            auto grads = step::weight_pass(*s.work, params[stage]);
            if (!grads.empty()) add_to_sums(stage, grads);
          } else if (!params[stage].empty() && s.output.requires_grad() && s.output.grad_fn()) {
            add_to_sums(stage, torch::autograd::grad({s.output}, params[stage], {s.grad},
                                                     /*retain_graph=*/false,
                                                     /*create_graph=*/false, /*allow_unused=*/true));
          }
        } else {
          auto it = stash.find({stage, chunk});
          if (it == stash.end()) throw std::logic_error("no forward ran before this backward");
          if (it->second.input_done) throw std::logic_error("this backward's input gradient ran already");
          const bool split = kind == Action::kInputGrad;
          Stash whole;
          if (!split) {
            whole = std::move(it->second);
            stash.erase(it);
          }
          Stash& s = split ? it->second : whole;
          at::Tensor g = stage == last ? at::ones_like(s.output)
                                       : take(kGradient).to(s.output.device());
          time.start_us = us();
          const bool input_grad = stage > 0 && s.input.requires_grad();
          at::Tensor input_gradient;
          if (split) {
            s.input_done = true;
            s.grad = g;
            if (input_grad && s.output.is_same(s.input)) {
              input_gradient = g;  // the stage gave back its input
            } else if (input_grad && s.output.requires_grad()) {
              input_gradient = step::input_pass(s.output, s.input, g, params[stage], s.work);
              if (s.work) s.grad = at::Tensor();  // the W pass starts from what the roots got
            }
          } else {
            std::vector<at::Tensor> wrt = params[stage];
            if (input_grad) wrt.push_back(s.input);
            if (!wrt.empty() && s.output.requires_grad()) {
              auto grads = torch::autograd::grad({s.output}, wrt, {g}, /*retain_graph=*/false,
                                                 /*create_graph=*/false, /*allow_unused=*/true);
              if (input_grad) {
                input_gradient = grads.back();
                grads.pop_back();
              }
              add_to_sums(stage, grads);
            }
          }
          // The previous stage waits for an answer even when its output got
          // no gradient (not floating point, or not used): zeros.
          if (stage > 0) {
            send(a, (stage - 1) % h.workers, kGradient, stage - 1, chunk,
                 input_gradient.defined() ? input_gradient : at::zeros_like(s.input));
          }
        }
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
                      "{\"step\":" + std::to_string(h.step) + ",\"stage\":" +
                          std::to_string(stage) + ",\"micro_batch\":" + std::to_string(chunk) +
                          "}");
      }
    }
    for (auto& [stage, sum] : sums) {
      for (size_t p = 0; p < sum.size(); ++p) {
        if (sum[p].defined()) autograd::accumulate_gradient(agent_, context, params[stage][p], sum[p]);
      }
    }
    reply.losses = losses;
    reply.peak_stash = peak;
    reply.outputs = std::move(outputs);
    return reply;
  }

  rpc::Agent& agent_;
  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<Box>> boxes_;
  rpc::BoundedSet<uint64_t> finished_{1024};
  bool closed_ = false;
};

const bool kRegistered = [] {
  rpc::register_agent_extension(
      [](rpc::Agent& agent) { return std::make_shared<PipeService>(agent); });
  return true;
}();

std::atomic<int64_t> g_next_step{1};

}  // namespace

size_t pending_steps(rpc::Agent& agent) { return PipeService::of(agent)->pending(); }

Pipe::Pipe(std::vector<nn::RemoteModule> stages, PipeOptions options)
    : Pipe(*rpc::current_agent(), std::move(stages), std::move(options)) {}

Pipe::Pipe(rpc::Agent& agent, std::vector<nn::RemoteModule> stages, PipeOptions options,
           std::shared_ptr<const Schedule> schedule)
    : agent_(agent.weak_from_this()),
      stages_(std::move(stages)),
      options_(std::move(options)),
      schedule_(schedule ? std::move(schedule) : make_schedule(options_.schedule)) {
  (void)kRegistered;
  PipeService::of(agent);  // this agent knows the pipeline (it was made after the library loaded)
  if (stages_.empty()) throw std::invalid_argument("Pipe: no stages");
  if (options_.chunks < 1) {
    throw std::invalid_argument("Pipe: chunks must be at least 1, got " +
                                std::to_string(options_.chunks));
  }
  if (options_.timeout.count() <= 0) throw std::invalid_argument("Pipe: timeout must be > 0");
  const int per = schedule_->stages_per_worker();
  const int n = static_cast<int>(stages_.size());
  if (n % per != 0) {
    throw std::invalid_argument("Pipe: schedule " + schedule_->name() + " holds " +
                                std::to_string(per) + " stages per worker; " + std::to_string(n) +
                                " stages are not a multiple of that");
  }
  workers_ = n / per;
  for (int s = 0; s < n; ++s) {
    const std::string owner = stages_[s].owner().name;
    if (s < workers_) {
      for (int w = 0; w < s; ++w) {
        if (worker_names_[w] == owner) {
          throw std::invalid_argument("Pipe: stages " + std::to_string(w) + " and " +
                                      std::to_string(s) + " both live on " + owner + "; schedule " +
                                      schedule_->name() + " wants stage s on the worker of stage s % " +
                                      std::to_string(workers_) + ", one worker each");
        }
      }
      worker_names_.push_back(owner);
    } else if (owner != worker_names_[s % workers_]) {
      throw std::invalid_argument("Pipe: stage " + std::to_string(s) + " lives on " + owner +
                                  "; schedule " + schedule_->name() + " wants it on " +
                                  worker_names_[s % workers_] + " (the worker of stage " +
                                  std::to_string(s % workers_) + ")");
    }
  }
  // The plan is checked once here; a user's schedule that cannot run, or
  // that plans another shape than this pipe's, fails now.
  plan_ = schedule_->plan(workers_, options_.chunks);
  check(plan_);
  if (plan_.workers != workers_ || plan_.stages != n || plan_.chunks != options_.chunks) {
    throw std::invalid_argument("Pipe: schedule " + schedule_->name() + " planned " +
                                std::to_string(plan_.workers) + " workers and " +
                                std::to_string(plan_.stages) + " stages for a pipe of " +
                                std::to_string(workers_) + " workers and " + std::to_string(n) +
                                " stages");
  }
}

std::vector<rpc::RRef<at::Tensor>> Pipe::parameters() const {
  std::vector<rpc::RRef<at::Tensor>> out;
  for (const auto& s : stages_) {
    for (auto& p : s.remote_parameters()) out.push_back(std::move(p));
  }
  return out;
}

Pipe::Run Pipe::run(const Plan& plan, const std::vector<at::Tensor>& xs,
                    const std::vector<at::Tensor>& ys, const std::vector<double>& weights,
                    bool train) {
  auto agent = agent_.lock();
  if (!agent) throw rpc::ShutdownError("Pipe: its agent is gone");
  const int64_t step_id = (static_cast<int64_t>(agent->rank()) << 40) | g_next_step.fetch_add(1);
  const int64_t stages = static_cast<int64_t>(stages_.size());
  const int64_t chunks = static_cast<int64_t>(xs.size());
  const int last_worker = plan.worker_of(static_cast<int>(stages - 1));

  struct Wait {
    std::mutex mu;
    std::condition_variable cv;
    size_t done = 0;
    bool failed = false;
  };
  auto wait = std::make_shared<Wait>();
  std::vector<step::RunRequest> requests;  // kept to check the answers against
  std::vector<rpc::Future<c10::IValue>> runs;
  try {
    for (int w = 0; w < workers_; ++w) {
      step::RunRequest r;
      r.header = {step_id, chunks, stages, workers_, w, options_.timeout, train};
      for (int64_t s = w; s < stages; s += workers_) {
        r.stage_ids.push_back(s);
        r.modules.push_back(stages_[s].get_module_rref());
      }
      r.passes.passes = plan.actions[w];
      r.worker_names = worker_names_;
      r.loss = options_.loss;
      if (w == 0) r.inputs = xs;
      if (w == last_worker) r.targets = ys;
      r.weights = weights;
      // Untimed: each pass has its own timeout.
      auto f = agent->call(worker_names_[w], step::kRunFn, r.encode(), rpc::kNoTimeout);
      requests.push_back(std::move(r));
      f.raw()->addCallback([wait](c10::ivalue::Future& done) {
        std::lock_guard<std::mutex> lock(wait->mu);
        ++wait->done;
        if (done.hasError()) wait->failed = true;
        wait->cv.notify_all();
      });
      runs.push_back(std::move(f));
    }
  } catch (...) {
    // Those already started would wait for passes that never come.
    abort_step(*agent, worker_names_, runs.size(), step_id, options_.timeout,
                     "the driver could not start every worker");
    for (auto& r : runs) rpc::wait_raw(r.raw(), std::chrono::milliseconds(0));
    throw;
  }
  {
    // A worker that failed has told the others; one that died (its call
    // failed here) has not: tell them, so nobody waits out a timeout.
    std::unique_lock<std::mutex> lock(wait->mu);
    wait->cv.wait(lock, [&] { return wait->done == runs.size() || wait->failed; });
    if (wait->failed && wait->done < runs.size()) {
      lock.unlock();
      abort_step(*agent, worker_names_, runs.size(), step_id, options_.timeout,
                       "a worker of the step failed");
    }
  }
  std::string first_error, aborted_error;
  Run out;
  for (int w = 0; w < workers_; ++w) {
    try {
      step::RunReply reply = step::RunReply::decode(runs[w].wait(), requests[w]);
      out.stats.peak_stash.push_back(static_cast<int>(reply.peak_stash));
      for (const auto& t : reply.times.times) out.stats.passes.push_back({t.pass, w, t.start_us, t.end_us});
      if (w == last_worker) {
        out.losses = reply.losses;
        out.outputs = std::move(reply.outputs);
      }
    } catch (const std::exception& e) {
      // The cause, not the echoes of it on the other workers.
      if (step::is_step_aborted(e)) {
        if (aborted_error.empty()) aborted_error = e.what();
      } else if (first_error.empty()) {
        first_error = e.what();
      }
    }
  }
  const char* what = train ? "Pipe::step: " : "Pipe::forward: ";
  if (!first_error.empty()) throw std::runtime_error(what + first_error);
  if (!aborted_error.empty()) throw std::runtime_error(what + aborted_error);
  double span = 0;
  std::vector<double> busy(workers_, 0);
  for (const auto& p : out.stats.passes) {
    span = std::max(span, p.end_us);
    busy[p.worker] += p.end_us - p.start_us;
  }
  for (int w = 0; w < workers_; ++w) {
    out.stats.bubble.push_back(span > 0 ? 1 - busy[w] / span : 0);
  }
  return out;
}

double Pipe::step(uint64_t context_id, const at::Tensor& inputs, const at::Tensor& targets) {
  if (context_id == 0) throw std::invalid_argument("Pipe::step: no distributed autograd context");
  if (context_id != autograd::current_context_id()) {
    throw std::invalid_argument("Pipe::step: context " + std::to_string(context_id) +
                                " is not the one current on this thread; call step inside its "
                                "autograd::Context");
  }
  if (!inputs.defined() || inputs.dim() < 1 || !targets.defined() || targets.dim() < 1) {
    throw std::invalid_argument("Pipe::step: inputs and targets must be tensors of a batch");
  }
  const int64_t batch = inputs.size(0);
  if (targets.size(0) != batch) {
    throw std::invalid_argument("Pipe::step: " + std::to_string(batch) + " inputs but " +
                                std::to_string(targets.size(0)) + " targets");
  }
  if (batch < options_.chunks) {
    throw std::invalid_argument("Pipe::step: a batch of " + std::to_string(batch) +
                                " cannot make " + std::to_string(options_.chunks) +
                                " micro-batches");
  }
  std::vector<at::Tensor> xs = at::tensor_split(inputs, options_.chunks);
  std::vector<at::Tensor> ys = at::tensor_split(targets, options_.chunks);
  std::vector<double> weights;
  for (const auto& x : xs) weights.push_back(static_cast<double>(x.size(0)) / batch);
  Run r = run(plan_, xs, ys, weights, /*train=*/true);
  double loss = 0;
  for (int m = 0; m < options_.chunks; ++m) loss += r.losses[m].item<double>() * weights[m];
  last_ = std::move(r.stats);
  return loss;
}

at::Tensor Pipe::forward(const at::Tensor& inputs) {
  if (!inputs.defined() || inputs.dim() < 1 || inputs.size(0) < 1) {
    throw std::invalid_argument("Pipe::forward: inputs must be a non-empty batch");
  }
  const int chunks = static_cast<int>(std::min<int64_t>(options_.chunks, inputs.size(0)));
  // Forwards only: each worker takes the micro-batches in turn through its stages.
  Plan plan;
  plan.workers = workers_;
  plan.stages = static_cast<int>(stages_.size());
  plan.chunks = chunks;
  plan.actions.resize(workers_);
  for (int m = 0; m < chunks; ++m) {
    for (int s = 0; s < plan.stages; ++s) plan.actions[s % workers_].push_back({Action::kForward, s, m});
  }
  Run r = run(plan, at::tensor_split(inputs, chunks), {}, std::vector<double>(chunks, 0),
              /*train=*/false);
  return at::cat(r.outputs);
}

void Pipe::write_trace(const std::string& path) const {
  pipeline::write_trace(last_, worker_names_, path);
}

}  // namespace tandem::pipeline
