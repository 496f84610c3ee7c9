#pragma once
// Pipeline schedules: in which order each worker runs the forward and
// backward passes of each micro-batch through the stages it holds.
//
// A pipeline of S stages runs on W workers; stage s lives on worker s % W.
// Plain schedules hold one stage per worker (S = W); interleaved ones hold
// several ("virtual stages"), which shrinks the bubble. A schedule is a
// plug-in: it only lists, per worker, the actions that worker runs, in
// order. Pipe runs whatever list it gets, and check() / simulate() test a
// list against the dependencies every pipeline has:
//   F(s, m) after F(s - 1, m)                  (its input)
//   B(s, m) after F(s, m) and after B(s + 1, m) (its output's gradient)
// A backward may also be split in two (zero-bubble schedules): I(s, m)
// computes only the input's gradient, which the previous stage waits for,
// and W(s, m), later on the same worker, the parameters' gradients:
//   I(s, m) as B(s, m);  W(s, m) after I(s, m);
//   B(s, m) or I(s, m) of stage s + 1 gives stage s its output's gradient.
// Each micro-batch has, per stage, one F and either one B or one I and one W.
//
//   pipeline::OneFOneB schedule;
//   auto plan = schedule.plan(/*workers=*/2, /*chunks=*/8);
//   pipeline::Simulation sim = pipeline::simulate(plan);   // bubble, stash
//
// A new schedule derives from Schedule and implements plan(); nothing else
// changes (ZeroBubble below is one).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tandem::pipeline {

struct Action {
  // kInputGrad and kWeightGrad split a kBackward in two.
  enum Kind : uint8_t { kForward, kBackward, kInputGrad, kWeightGrad };
  Kind kind = kForward;
  int stage = 0;  // the (virtual) stage, 0 .. stages - 1
  int chunk = 0;  // the micro-batch, 0 .. chunks - 1
  bool operator==(const Action& o) const {
    return kind == o.kind && stage == o.stage && chunk == o.chunk;
  }
};
// "F3@1": the forward of micro-batch 3 through stage 1 ("B" for backward,
// "I" and "W" for its input and weight halves).
std::string to_string(const Action& a);
// "forward", "backward", "input gradient" or "weight gradient".
const char* kind_name(Action::Kind kind);

// What a schedule produced: each worker's actions, in the order it runs them.
struct Plan {
  int workers = 0;
  int stages = 0;  // workers * stages per worker
  int chunks = 0;
  std::vector<std::vector<Action>> actions;  // [worker] -> in order
  int worker_of(int stage) const { return stage % workers; }
};

class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual std::string name() const = 0;
  // Stages each worker holds (1 for plain schedules).
  virtual int stages_per_worker() const { return 1; }
  // Throws std::invalid_argument for counts it cannot schedule.
  virtual Plan plan(int workers, int chunks) const = 0;
};

// All forwards, then all backwards: every worker stashes all `chunks`
// micro-batches' activations.
class GPipe final : public Schedule {
 public:
  std::string name() const override { return "gpipe"; }
  Plan plan(int workers, int chunks) const override;
};

// One forward, one backward: worker w runs (workers - w - 1) warm-up
// forwards, then alternates, so it stashes at most workers - w micro-batches.
// The same bubble as GPipe, far less memory.
class OneFOneB final : public Schedule {
 public:
  std::string name() const override { return "1f1b"; }
  Plan plan(int workers, int chunks) const override;
};

// 1F1B over `stages_per_worker` virtual stages per worker (Megatron-LM's
// interleaved schedule): the bubble shrinks by that factor. Needs chunks to
// be a multiple of the worker count.
class Interleaved1F1B final : public Schedule {
 public:
  explicit Interleaved1F1B(int stages_per_worker = 2);
  std::string name() const override;
  int stages_per_worker() const override { return v_; }
  Plan plan(int workers, int chunks) const override;

 private:
  int v_;
};

// Zero-bubble (after Qi et al.'s ZB-H1): 1F1B's memory (worker w holds at
// most workers - w micro-batches, counted until their W), with each
// backward split into I and W. The order comes from running the pipeline
// with unit costs, each worker taking, when free, the first ready of: an I
// (the previous stage waits for it), an F within its memory, a W (which
// waits for nobody, so it fills what would be bubble). Beats 1F1B when the
// weight gradients are a large share of the backward; runs I and W as two
// passes through the stage's graph (Pipe keeps it between them).
class ZeroBubble final : public Schedule {
 public:
  std::string name() const override { return "zero-bubble"; }
  Plan plan(int workers, int chunks) const override;
};

// "gpipe", "1f1b", "zero-bubble", "interleaved" (2 stages per worker) or
// "interleaved:N".
std::unique_ptr<Schedule> make_schedule(const std::string& name);

// Throws std::invalid_argument naming the first problem: an action on the
// wrong worker or outside the counts, a pass missing or run twice, or an
// order in which some worker would wait forever (naming its action).
void check(const Plan& plan);

// The plan run with these unit costs and free communication.
struct Simulation {
  double makespan = 0;
  std::vector<double> busy;     // per worker
  std::vector<double> bubble;   // per worker: 1 - busy / makespan
  std::vector<int> peak_stash;  // per worker: most micro-batches held from F to B (or W)
};
// check()s the plan first. A split backward costs backward_cost in all:
// weight_cost (half of it when not given) for its W, the rest for its I.
Simulation simulate(const Plan& plan, double forward_cost = 1, double backward_cost = 2,
                    double weight_cost = -1);

}  // namespace tandem::pipeline
