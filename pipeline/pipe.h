#pragma once
// Pipe: a sequential model whose stages are RemoteModules on several
// workers, trained micro-batch by micro-batch in the order a schedule gives
// (pipeline/schedule.h).
//
//   std::vector<nn::RemoteModule> stages = {
//       nn::RemoteModule("worker1/cpu", "Linear", {512, 2048}), ...};
//   pipeline::PipeOptions o;
//   o.chunks = 8;
//   o.schedule = "1f1b";
//   pipeline::Pipe pipe(stages, o);
//   optim::DistributedOptimizer opt(optim::Kind::kSGD, pipe.parameters(), so);
//   {
//     autograd::Context ctx;
//     double loss = pipe.step(ctx.id(), x, y);   // forward and backward of every micro-batch
//     opt.step(ctx.id());
//   }
//
// How a step runs: the driver splits the batch into `chunks` micro-batches
// (as at::tensor_split does: the first ones a row larger when the batch does
// not divide evenly) and asks every worker holding stages to run its list of
// the schedule's passes. A forward takes its input from the driver (stage 0)
// or from the previous stage, which sends its output there directly; the
// last stage computes the micro-batch's loss (a named loss, mean over its
// rows, weighted by its share of the batch, so the gradients are those of
// the whole batch's mean loss). A backward takes its output's gradient from
// the next stage, computes its parameters' and input's gradients with
// LibTorch's autograd and sends the input's gradient back. Activations and
// gradients go from stage to stage, never through the driver. At the end
// each worker adds its stages' parameter gradients to the distributed
// autograd context, so DistributedOptimizer::step(ctx) steps them where
// they live. A failing pass fails the step on every worker at once, with
// the first error naming its stage and worker; some workers may have added
// their gradients to the context by then, so do not step with it. A worker
// that died fails the step with rpc::DisconnectedError naming it.
//
// Data parallelism over pipelines (pipeline x data parallelism): several
// replicas of one pipe, each over its own workers and its own share of the
// data, average each stage's gradients over that stage's replicas. Name the
// process group of each stage worker's data-parallel peers, registered on
// every stage worker (a Mesh does it: mesh.group_name("dp")):
//
//   tandem::Mesh mesh({{"pp", 2}, {"dp", 2}});      // on every rank
//   if (mesh.coordinate("pp") == 0) {               // each replica's driver: its first stage
//     o.data_parallel_group = mesh.group_name("dp");
//     std::vector<nn::RemoteModule> stages = {
//         {mesh.worker_at({{"pp", 0}}) + "/cpu", "Linear", {...}},
//         {mesh.worker_at({{"pp", 1}}) + "/cpu", "Linear", {...}}};
//     pipeline::Pipe pipe(stages, o);                 // this replica's pipe
//     ... pipe.step(ctx.id(), my_shard_x, my_shard_y); opt.step(ctx.id()); ...
//   }
//
// Each stage worker starts the average of a stage (bucketed as DDP's, one
// all_reduce a bucket, divided by the group's size) as soon as the stage's
// last gradient pass of the step has run, so it overlaps the passes still
// running on the other stages; step() returns once every stage's average is
// in the context. Replicas built alike and stepped alike (same schedule,
// chunks and optimizer) then keep equal parameters. Inside no_sync() steps
// only accumulate into their context (use one context for the steps that
// accumulate); the first step after it averages everything accumulated.
#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/pipeline/schedule.h"
#include "tandem/remote_module/remote_module.h"
#include "tandem/rpc/rref.h"

namespace tandem::pipeline {

// A loss from the last stage's output and the micro-batch's targets, mean
// over the rows. Built in: "cross_entropy" (targets: class indices) and
// "mse". register_loss adds one, on the process holding the last stage
// (std::invalid_argument if the name is taken).
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
void register_loss(const std::string& name, LossFn fn);

struct PipeOptions {
  int chunks = 1;                  // micro-batches per batch
  std::string schedule = "gpipe";  // make_schedule's names; see also Pipe's last constructor
  std::string loss = "cross_entropy";
  // How long a pass may wait for its input or gradient from another stage.
  std::chrono::milliseconds timeout{60000};
  // Data parallelism: the name of the process group (ddp::find_group) of
  // each stage worker's peers holding the same stage in the other replicas;
  // empty: one pipe, no averaging.
  std::string data_parallel_group;
  double bucket_cap_mb = 25;  // per all_reduce of a stage's gradients
};

// When one pass ran, on its worker's clock, in µs since that worker began the step.
struct PassRecord {
  Action action;
  int worker = 0;
  double start_us = 0, end_us = 0;
};

// When one stage's gradients were averaged over its data-parallel group
// (from the launch of its first bucket to the end of its last), on its
// worker's clock.
struct AllReduceRecord {
  int stage = 0;
  int worker = 0;
  double launch_us = 0, done_us = 0;
};

// What the last step did on each worker. The workers' clocks start when
// each began the step (the driver asks them all at once, so they agree to
// within a message's latency).
struct StepStats {
  std::vector<int> peak_stash;  // per worker: most micro-batches held between F and B
  std::vector<PassRecord> passes;
  // Per worker: the share of the step's span (first start to last end over
  // all workers) it spent waiting rather than running passes.
  std::vector<double> bubble;
  // Data parallelism: each stage's average, and the share of their time
  // spent while passes still ran (before the last pass of the step ended,
  // on any worker): the part hidden behind pipeline work. 0 without any.
  std::vector<AllReduceRecord> allreduces;
  double allreduce_hidden = 0;
};

// Writes the passes as Chrome trace-event JSON (chrome://tracing and
// Perfetto open it): one process per worker, one track per stage, a slice
// per pass ("F3" / "B3" / "I3" / "W3": micro-batch 3). Throws std::runtime_error naming
// the path when it cannot be written.
void write_trace(const StepStats& stats, const std::vector<std::string>& worker_names,
                 const std::string& path);

// Steps `agent` holds messages for: running ones, and ones whose run has not
// come. The latter (a driver that died, a run that was never sent) are
// dropped once the step's pass timeout has passed since their last message.
size_t pending_steps(rpc::Agent& agent);

class Pipe {
 public:
  // Stage s must live on the same worker as stage s % W, W being the
  // schedule's worker count (stages / stages per worker); plain schedules
  // want a worker per stage. Throws std::invalid_argument for bad options
  // or placement.
  // The driver is the current agent (rpc::init's), or `agent`; `schedule`
  // (one of the user's, say) replaces options.schedule.
  Pipe(std::vector<nn::RemoteModule> stages, PipeOptions options = {});
  Pipe(rpc::Agent& agent, std::vector<nn::RemoteModule> stages, PipeOptions options = {},
       std::shared_ptr<const Schedule> schedule = nullptr);

  // Inside distributed autograd context `context_id`: every micro-batch's
  // forward and backward; returns the batch's mean loss. Throws
  // std::invalid_argument for a batch smaller than chunks or inputs and
  // targets of different lengths, before any work starts.
  double step(uint64_t context_id, const at::Tensor& inputs, const at::Tensor& targets);
  // The batch through the stages in `chunks` micro-batches, no gradients
  // (stage to stage as in step; the last stage's outputs come back).
  at::Tensor forward(const at::Tensor& inputs);

  // Every stage's parameters, in stage order (for DistributedOptimizer).
  std::vector<rpc::RRef<at::Tensor>> parameters() const;
  const std::vector<nn::RemoteModule>& stages() const { return stages_; }
  const Schedule& schedule() const { return *schedule_; }
  int workers() const { return workers_; }
  const StepStats& last_step() const { return last_; }
  // write_trace of the last step.
  void write_trace(const std::string& path) const;

  // Data parallelism: whether steps average the stages' gradients (true
  // unless inside no_sync()). Without data_parallel_group there is nothing
  // to average, and steps accumulate into their context either way.
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }
  // Gradient accumulation, as DDP's no_sync: steps inside the scope only
  // add to their context's gradients; the first step after it averages
  // all of them.
  class NoSync {
   public:
    explicit NoSync(Pipe& p) : p_(&p), was_(p.sync()) { p.set_sync(false); }
    ~NoSync() {
      if (p_) p_->set_sync(was_);
    }
    NoSync(NoSync&& o) noexcept : p_(std::exchange(o.p_, nullptr)), was_(o.was_) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    Pipe* p_;
    bool was_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }
  // Who holds the stages, by schedule worker index (stage s: s % workers()).
  const std::vector<std::string>& worker_names() const { return worker_names_; }

 private:
  struct Run {
    at::Tensor losses;                // per micro-batch (train)
    std::vector<at::Tensor> outputs;  // per micro-batch (forward only)
    StepStats stats;
  };
  Run run(const Plan& plan, const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ys,
          const std::vector<double>& weights, bool train);

  std::weak_ptr<rpc::Agent> agent_;
  std::vector<nn::RemoteModule> stages_;
  PipeOptions options_;
  std::shared_ptr<const Schedule> schedule_;
  int workers_ = 0;
  Plan plan_;                              // the schedule's, checked once against this pipe
  std::vector<std::string> worker_names_;  // by schedule worker index
  StepStats last_;
  bool sync_ = true;
};

}  // namespace tandem::pipeline
