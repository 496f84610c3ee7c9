// The driver: Pipe, on the caller's side. It checks the pipe against its
// schedule once, and for each step splits the batch, sends every worker
// holding stages its passes (step/messages.h: one RunRequest each; the stage
// service, step/stage_service.h, runs them), waits for the answers and
// reports the cause of a failure rather than its echoes (step/errors.h).
#include "tandem/pipeline/pipe.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/tensor_split.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>

#include "tandem/autograd/autograd.h"
#include "tandem/pipeline/step/errors.h"
#include "tandem/pipeline/step/messages.h"
#include "tandem/pipeline/step/stage_service.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/errors.h"

namespace tandem::pipeline {

namespace {

std::atomic<int64_t> g_next_step{1};

}  // namespace

Pipe::Pipe(std::vector<nn::RemoteModule> stages, PipeOptions options)
    : Pipe(*rpc::current_agent(), std::move(stages), std::move(options)) {}

Pipe::Pipe(rpc::Agent& agent, std::vector<nn::RemoteModule> stages, PipeOptions options,
           std::shared_ptr<const Schedule> schedule)
    : agent_(agent.weak_from_this()),
      stages_(std::move(stages)),
      options_(std::move(options)),
      schedule_(schedule ? std::move(schedule) : make_schedule(options_.schedule)) {
  step::require_stage_service(agent);  // the agent was made after the library loaded
  if (stages_.empty()) throw std::invalid_argument("Pipe: no stages");
  if (options_.chunks < 1) {
    throw std::invalid_argument("Pipe: chunks must be at least 1, got " +
                                std::to_string(options_.chunks));
  }
  if (options_.timeout.count() <= 0) throw std::invalid_argument("Pipe: timeout must be > 0");
  if (!(options_.bucket_cap_mb > 0) || options_.bucket_cap_mb > 1 << 20) {
    throw std::invalid_argument("Pipe: bucket_cap_mb must be in (0, 1048576], got " +
                                std::to_string(options_.bucket_cap_mb));
  }
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
                                      schedule_->name() +
                                      " wants stage s on the worker of stage s % " +
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
    throw std::invalid_argument(
        "Pipe: schedule " + schedule_->name() + " planned " + std::to_string(plan_.workers) +
        " workers and " + std::to_string(plan_.stages) + " stages for a pipe of " +
        std::to_string(workers_) + " workers and " + std::to_string(n) + " stages");
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
      r.data_parallel.group = options_.data_parallel_group;
      r.data_parallel.sync = sync_;
      r.data_parallel.bucket_cap_bytes =
          std::max<int64_t>(1, static_cast<int64_t>(options_.bucket_cap_mb * (1 << 20)));
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
    step::abort_step(*agent, worker_names_, runs.size(), step_id, options_.timeout,
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
      step::abort_step(*agent, worker_names_, runs.size(), step_id, options_.timeout,
                       "a worker of the step failed");
    }
  }
  // Once the step failed, a worker that has not answered its run gets the
  // pass timeout to do so: one stalled (stopped, frozen) never would, and the
  // runs are untimed (each pass has its own timeout).
  const bool failed = [&] {
    std::lock_guard<std::mutex> lock(wait->mu);
    return wait->failed;
  }();
  const auto grace_end = std::chrono::steady_clock::now() + options_.timeout;
  std::string first_error, aborted_error, disconnected, unanswered;
  Run out;
  for (int w = 0; w < workers_; ++w) {
    try {
      // (0 would be no limit: at least a moment)
      const auto left = std::max(std::chrono::milliseconds(1),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                     grace_end - std::chrono::steady_clock::now()));
      if (failed && !rpc::wait_raw(runs[w].raw(), left)) {
        if (unanswered.empty()) {
          unanswered = "'" + std::string(step::kRunFn) + "' on " + worker_names_[w] +
                       " did not end within " + std::to_string(options_.timeout.count()) +
                       " ms of the step's failure (that worker is stalled?)";
        }
        continue;
      }
      step::RunReply reply = step::RunReply::decode(runs[w].wait(), requests[w]);
      out.stats.peak_stash.push_back(static_cast<int>(reply.peak_stash));
      for (const auto& t : reply.times.times) {
        out.stats.passes.push_back({t.pass, w, t.start_us, t.end_us});
      }
      for (const auto& a : reply.allreduces.times) {
        out.stats.allreduces.push_back({static_cast<int>(a.stage), w, a.launch_us, a.done_us});
      }
      if (w == last_worker) {
        out.losses = reply.losses;
        out.outputs = std::move(reply.outputs);
      }
    } catch (const rpc::DisconnectedError& e) {
      // A worker that is gone is the cause: the others' failures echo it.
      if (disconnected.empty()) disconnected = e.what();
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
  if (!disconnected.empty()) throw rpc::DisconnectedError(what + disconnected);
  if (!first_error.empty()) {
    throw std::runtime_error(what + first_error + (unanswered.empty() ? "" : "; " + unanswered));
  }
  if (!unanswered.empty()) throw rpc::TimeoutError(what + unanswered);
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
  // The averages' time before the last pass ended was hidden behind passes.
  double total = 0, hidden = 0;
  for (const auto& a : out.stats.allreduces) {
    total += a.done_us - a.launch_us;
    hidden += std::max(0.0, std::min(a.done_us, span) - a.launch_us);
  }
  out.stats.allreduce_hidden = total > 0 ? hidden / total : 0;
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
    for (int s = 0; s < plan.stages; ++s)
      plan.actions[s % workers_].push_back({Action::kForward, s, m});
  }
  Run r = run(plan, at::tensor_split(inputs, chunks), {}, std::vector<double>(chunks, 0),
              /*train=*/false);
  return at::cat(r.outputs);
}

void Pipe::write_trace(const std::string& path) const {
  pipeline::write_trace(last_, worker_names_, path);
}

}  // namespace tandem::pipeline
