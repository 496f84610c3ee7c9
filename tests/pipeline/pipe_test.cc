// Pipe: a model split into RemoteModule stages and trained by each schedule
// ends with the parameters (and losses) of the same model trained whole in
// one process; 1F1B and GPipe hold what they should; bad input is refused
// before work starts, and a failing stage fails the step everywhere, named.
#include "tandem/pipeline/pipe.h"

#include <ATen/ops/allclose.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "test_util.h"

using namespace tandem;
using test::World;
namespace dist = tandem::autograd;
using nn::RemoteModule;
using nn::spec;

namespace {

constexpr int64_t kIn = 6, kHidden = 8, kClasses = 3;

struct Weights {
  std::vector<at::Tensor> w, b;  // per stage
};

// Stage s: Linear(dims[s], dims[s + 1]), then Tanh but on the last stage.
std::vector<int64_t> dims(int stages) {
  std::vector<int64_t> d(stages + 1, kHidden);
  d.front() = kIn;
  d.back() = kClasses;
  return d;
}

Weights initial(int stages, uint64_t seed) {
  at::manual_seed(seed);
  auto d = dims(stages);
  Weights w;
  for (int s = 0; s < stages; ++s) {
    w.w.push_back(at::randn({d[s + 1], d[s]}) * 0.5);
    w.b.push_back(at::randn({d[s + 1]}) * 0.1);
  }
  return w;
}

// Stage s on `worker_of(s)`, with the given weights.
std::vector<RemoteModule> make_stages(rpc::Agent& driver, const Weights& w,
                                      const std::function<int(int)>& worker_of) {
  const int stages = static_cast<int>(w.w.size());
  auto d = dims(stages);
  std::vector<RemoteModule> out;
  for (int s = 0; s < stages; ++s) {
    c10::IValue layers = s + 1 < stages
                             ? nn::list({spec("Linear", {d[s], d[s + 1]}), spec("Tanh")})
                             : nn::list({spec("Linear", {d[s], d[s + 1]})});
    out.emplace_back(driver, "worker" + std::to_string(worker_of(s)) + "/cpu", "Sequential",
                     std::vector<c10::IValue>{layers});
    out.back().load_state_dict({{"0.weight", w.w[s]}, {"0.bias", w.b[s]}});
  }
  return out;
}

struct Batch {
  at::Tensor x, y;
};
Batch batch(int64_t rows, int step) {
  at::manual_seed(100 + step);
  return {at::randn({rows, kIn}), at::randint(0, kClasses, {rows}, at::kLong)};
}

// The same model trained whole here with torch::optim::SGD: losses, final weights.
std::pair<std::vector<double>, Weights> local_training(const Weights& init, int steps,
                                                       int64_t rows, double lr) {
  const int stages = static_cast<int>(init.w.size());
  std::vector<at::Tensor> params;
  Weights w;
  for (int s = 0; s < stages; ++s) {
    w.w.push_back(init.w[s].clone().requires_grad_());
    w.b.push_back(init.b[s].clone().requires_grad_());
    params.push_back(w.w[s]);
    params.push_back(w.b[s]);
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(lr));
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    Batch b = batch(rows, step);
    at::Tensor h = b.x;
    for (int s = 0; s < stages; ++s) {
      h = at::addmm(w.b[s], h, w.w[s].t());
      if (s + 1 < stages) h = at::tanh(h);
    }
    at::Tensor loss = at::cross_entropy_loss(h, b.y);
    opt.zero_grad();
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return {losses, w};
}

void expect_trained_like_local(const std::string& schedule, int workers, int per_worker,
                               int chunks) {
  const int stages = workers * per_worker;
  const int64_t rows = 10;
  const int steps = 3;
  const double lr = 0.2;
  CAPTURE(schedule);
  CAPTURE(stages);
  CAPTURE(chunks);
  Weights init = initial(stages, 7);
  auto [want_losses, want] = local_training(init, steps, rows, lr);
  World w(workers + 1);
  {
    auto stage_modules = make_stages(*w.agents[0], init, [&](int s) { return 1 + s % workers; });
    pipeline::PipeOptions o;
    o.chunks = chunks;
    o.schedule = schedule;
    pipeline::Pipe pipe(*w.agents[0], stage_modules, o);
    optim::Options so;
    so.lr = lr;
    optim::DistributedOptimizer opt(*w.agents[0], optim::Kind::kSGD, pipe.parameters(), so);
    for (int step = 0; step < steps; ++step) {
      Batch b = batch(rows, step);
      dist::Context ctx(*w.agents[0]);
      const double loss = pipe.step(ctx.id(), b.x, b.y);
      CHECK(loss == doctest::Approx(want_losses[step]).epsilon(1e-5));
      opt.step(ctx.id());
    }
    for (int s = 0; s < stages; ++s) {
      auto state = stage_modules[s].state_dict();
      CHECK(at::allclose(state.at("0.weight"), want.w[s].detach(), 1e-5, 1e-6));
      CHECK(at::allclose(state.at("0.bias"), want.b[s].detach(), 1e-5, 1e-6));
    }
    // What each worker held between a forward and its backward.
    const auto& peak = pipe.last_step().peak_stash;
    REQUIRE(peak.size() == static_cast<size_t>(workers));
    for (int k = 0; k < workers; ++k) {
      if (schedule == "gpipe") CHECK(peak[k] == chunks);
      if (schedule == "1f1b") CHECK(peak[k] == std::min(workers - k, chunks));
    }
    CHECK(pipe.last_step().passes.size() == static_cast<size_t>(2 * stages * chunks));
  }
  w.shutdown();
}

}  // namespace

TEST_CASE("pipeline: GPipe and 1F1B train as the unsplit model, uneven micro-batches too") {
  for (const char* schedule : {"gpipe", "1f1b"}) {
    for (int workers : {2, 3}) {
      for (int chunks : {1, 3, 4}) {  // 10 rows: 4+3+3, 3+3+2+2
        expect_trained_like_local(schedule, workers, 1, chunks);
      }
    }
  }
}

TEST_CASE("pipeline: interleaved 1F1B (two stages per worker) trains as the unsplit model") {
  for (int chunks : {2, 4}) expect_trained_like_local("interleaved", 2, 2, chunks);
}
