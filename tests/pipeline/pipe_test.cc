// Pipe: a model split into RemoteModule stages and trained by each schedule
// ends with the parameters (and losses) of the same model trained whole in
// one process; 1F1B and GPipe hold what they should; bad input is refused
// before work starts, and a failing stage fails the step everywhere, named.
#include "tandem/pipeline/pipe.h"
#include "tandem/pipeline/partition.h"

#include <ATen/ops/allclose.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/tanh.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <limits>
#include <map>
#include <thread>

#include "pipeline/stages_support.h"
#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "test_util.h"

using namespace tandem;
using test::World;
namespace dist = tandem::autograd;
using nn::RemoteModule;
using nn::spec;

namespace {

using test::dims;
using test::initial;
using test::kClasses;
using test::kHidden;
using test::kIn;
using test::Weights;

// Stage s on `worker_of(s)`, with the given weights.
std::vector<RemoteModule> make_stages(rpc::Agent& driver, const Weights& w,
                                      const std::function<int(int)>& worker_of,
                                      const std::string& device = "cpu") {
  const int stages = static_cast<int>(w.w.size());
  auto d = dims(stages);
  std::vector<RemoteModule> out;
  for (int s = 0; s < stages; ++s) {
    c10::IValue layers = s + 1 < stages ? nn::list({spec("Linear", {d[s], d[s + 1]}), spec("Tanh")})
                                        : nn::list({spec("Linear", {d[s], d[s + 1]})});
    out.emplace_back(driver, "worker" + std::to_string(worker_of(s)) + "/" + device, "Sequential",
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
std::pair<std::vector<double>, Weights> local_training(const Weights& init, int steps, int64_t rows,
                                                       double lr) {
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

using LocalStages = std::vector<std::map<std::string, at::Tensor>>;  // per stage, by name

// Each stage's parameters, copied here as leaves.
LocalStages local_copies(const std::vector<RemoteModule>& stages) {
  LocalStages local(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    for (auto& [name, t] : stages[s].state_dict()) local[s][name] = t.clone().requires_grad_();
  }
  return local;
}

// Three SGD steps of the pipe (schedule, chunks) on seeded batches of rows x
// in, beside the same steps of `forward` over `local` here: each step's loss
// and, at the end, every parameter agree. Returns the pipe's last step.
pipeline::StepStats train_beside_local(rpc::Agent& driver, const std::vector<RemoteModule>& stages,
                                       LocalStages& local,
                                       const std::function<at::Tensor(const at::Tensor&)>& forward,
                                       const std::string& schedule, int chunks, int64_t rows,
                                       int64_t in, double lr, uint64_t seed) {
  std::vector<at::Tensor> all;
  for (auto& stage : local) {
    for (auto& [_, t] : stage) all.push_back(t);
  }
  pipeline::PipeOptions o;
  o.chunks = chunks;
  o.schedule = schedule;
  pipeline::Pipe pipe(driver, stages, o);
  optim::Options so;
  so.lr = lr;
  optim::DistributedOptimizer opt(driver, optim::Kind::kSGD, pipe.parameters(), so);
  for (int step = 0; step < 3; ++step) {
    at::manual_seed(seed + step);
    at::Tensor x = at::randn({rows, in});
    at::Tensor y = at::randint(0, kClasses, {rows}, at::kLong);
    at::Tensor want = at::cross_entropy_loss(forward(x), y);
    auto grads = torch::autograd::grad({want}, all);
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < all.size(); ++i) all[i].sub_(grads[i] * lr);
    }
    dist::Context ctx(driver);
    CHECK(pipe.step(ctx.id(), x, y) == doctest::Approx(want.item<double>()).epsilon(1e-5));
    opt.step(ctx.id());
  }
  for (size_t s = 0; s < stages.size(); ++s) {
    for (auto& [name, t] : stages[s].state_dict()) {
      CAPTURE(s);
      CAPTURE(name);
      CHECK(at::allclose(t, local[s].at(name).detach(), 1e-5, 1e-6));
    }
  }
  return pipe.last_step();
}

// SGD steps of `pipe` on the seeded batches, one per loss the unsplit model
// had, each step's loss checked against it.
void step_as_local(rpc::Agent& driver, pipeline::Pipe& pipe, const std::vector<double>& want_losses,
                   int64_t rows, double lr) {
  optim::Options so;
  so.lr = lr;
  optim::DistributedOptimizer opt(driver, optim::Kind::kSGD, pipe.parameters(), so);
  for (size_t step = 0; step < want_losses.size(); ++step) {
    Batch b = batch(rows, static_cast<int>(step));
    dist::Context ctx(driver);
    const double loss = pipe.step(ctx.id(), b.x, b.y);
    CHECK(loss == doctest::Approx(want_losses[step]).epsilon(1e-5));
    opt.step(ctx.id());
  }
}

// Stages on GPUs (each worker's cuda:0, every worker mapping it to every
// other's): the same losses and weights as the unsplit model trained here,
// with the DistributedOptimizer stepping the parameters where they live.
void expect_gpu_stages_train_like_local(const std::string& schedule) {
  CAPTURE(schedule);
  const int stages = 2;
  const int64_t rows = 10;
  const int steps = 3;
  const double lr = 0.2;
  Weights init = initial(stages, 7);
  auto [want_losses, want] = local_training(init, steps, rows, lr);
  World w(stages + 1, {}, [&](rpc::AgentOptions& o) {
    for (int r = 0; r <= stages; ++r) {
      if (r != o.rank) o.set_device_map("worker" + std::to_string(r), {{0, 0}});
    }
  });
  {
    auto stage_modules = make_stages(
        *w.agents[0], init, [](int s) { return 1 + s; }, "cuda:0");
    pipeline::PipeOptions o;
    o.chunks = 2;
    o.schedule = schedule;
    pipeline::Pipe pipe(*w.agents[0], stage_modules, o);
    step_as_local(*w.agents[0], pipe, want_losses, rows, lr);
    for (int s = 0; s < stages; ++s) {
      CHECK(stage_modules[s].remote_parameters()[0].to_here().is_cuda());  // (they live there)
      auto state = stage_modules[s].state_dict();                          // (a copy on the CPU)
      CHECK(at::allclose(state.at("0.weight").cpu(), want.w[s].detach(), 1e-4, 1e-5));
      CHECK(at::allclose(state.at("0.bias").cpu(), want.b[s].detach(), 1e-4, 1e-5));
    }
  }
  w.shutdown();
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
    step_as_local(*w.agents[0], pipe, want_losses, rows, lr);
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
      if (schedule == "zero-bubble") CHECK(peak[k] <= std::min(workers - k, chunks));
    }
    const int per_chunk = schedule == "zero-bubble" ? 3 : 2;  // F and B, or F, I and W
    CHECK(pipe.last_step().passes.size() == static_cast<size_t>(per_chunk * stages * chunks));
  }
  w.shutdown();
}

}  // namespace

TEST_CASE(
    "pipeline: GPipe, 1F1B and zero-bubble train as the unsplit model, uneven micro-batches too") {
  for (const char* schedule : {"gpipe", "1f1b", "zero-bubble"}) {
    for (int workers : {2, 3}) {
      for (int chunks : {1, 3, 4}) {  // 10 rows: 4+3+3, 3+3+2+2
        expect_trained_like_local(schedule, workers, 1, chunks);
      }
    }
  }
}

TEST_CASE("pipeline: stages on GPUs train as the unsplit model, stepped where they live") {
  if (!test::cuda_or_skip()) return;
  expect_gpu_stages_train_like_local("1f1b");
  expect_gpu_stages_train_like_local("zero-bubble");
}

TEST_CASE("pipeline: interleaved 1F1B (two stages per worker) trains as the unsplit model") {
  for (int chunks : {2, 4}) expect_trained_like_local("interleaved", 2, 2, chunks);
}

TEST_CASE("pipeline: bad input is refused before any work, naming what was wrong") {
  World w(3);
  {
    Weights init = initial(2, 1);
    auto stages = make_stages(*w.agents[0], init, [](int s) { return 1 + s; });
    auto error_making = [&](pipeline::PipeOptions o, std::vector<RemoteModule> st = {}) {
      if (st.empty()) st = stages;
      return test::error_of([&] { pipeline::Pipe(*w.agents[0], st, o); });
    };
    pipeline::PipeOptions o;
    o.schedule = "chimera";
    CHECK(error_making(o).find("unknown pipeline schedule 'chimera'") != std::string::npos);
    o = {};
    o.chunks = 0;
    CHECK(error_making(o).find("Pipe: chunks must be at least 1, got 0") != std::string::npos);
    // Interleaving two stages per worker: 2 stages make one worker, and the
    // second stage lives elsewhere than the first.
    o = {};
    o.schedule = "interleaved";
    CHECK(error_making(o).find("Pipe: stage 1 lives on worker2; schedule interleaved:2 wants it on "
                               "worker1 (the worker of stage 0)") != std::string::npos);
    // Plain schedules want a worker per stage.
    o = {};
    auto same = make_stages(*w.agents[0], init, [](int) { return 1; });
    CHECK(error_making(o, same).find("stages 0 and 1 both live on worker1") != std::string::npos);

    pipeline::PipeOptions four;
    four.chunks = 4;
    pipeline::Pipe pipe(*w.agents[0], stages, four);
    dist::Context ctx(*w.agents[0]);
    Batch b = batch(3, 0);
    CHECK(test::error_of([&] {
            pipe.step(ctx.id(), b.x, b.y);
          }).find("a batch of 3 cannot make 4 micro-batches") != std::string::npos);
    Batch c = batch(8, 0);
    CHECK(test::error_of([&] { pipe.step(ctx.id(), c.x, b.y); }).find("8 inputs but 3 targets") !=
          std::string::npos);
    CHECK(test::error_of([&] { pipe.step(0, c.x, c.y); }).find("no distributed autograd context") !=
          std::string::npos);
  }
  w.shutdown();
}

TEST_CASE("pipeline: a failing stage fails the step on every worker, naming the stage") {
  World w(4);
  {
    // Stage 1 expects 5 features but stage 0 gives 8: its forward fails.
    std::vector<RemoteModule> stages;
    stages.emplace_back(*w.agents[0], "worker1/cpu", "Linear",
                        std::vector<c10::IValue>{kIn, kHidden});
    stages.emplace_back(*w.agents[0], "worker2/cpu", "Linear",
                        std::vector<c10::IValue>{5, kHidden});
    stages.emplace_back(*w.agents[0], "worker3/cpu", "Linear",
                        std::vector<c10::IValue>{kHidden, kClasses});
    for (const char* schedule : {"gpipe", "1f1b"}) {
      CAPTURE(schedule);
      pipeline::PipeOptions o;
      o.chunks = 2;
      o.schedule = schedule;
      pipeline::Pipe pipe(*w.agents[0], stages, o);
      dist::Context ctx(*w.agents[0]);
      Batch b = batch(6, 0);
      const auto started = std::chrono::steady_clock::now();
      const std::string error = test::error_of([&] { pipe.step(ctx.id(), b.x, b.y); });
      CHECK(error.find("forward of micro-batch 0 through stage 1 on worker2") != std::string::npos);
      CHECK(error.find("step aborted") == std::string::npos);  // the cause, not the echo
      // Nobody waited out a timeout (60 s).
      CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(10));
    }
    // An unknown loss fails on the last stage's worker, named there.
    pipeline::PipeOptions o;
    o.loss = "hinge";
    std::vector<RemoteModule> good;
    good.emplace_back(*w.agents[0], "worker1/cpu", "Linear",
                      std::vector<c10::IValue>{kIn, kClasses});
    pipeline::Pipe pipe(*w.agents[0], good, o);
    dist::Context ctx(*w.agents[0]);
    Batch b = batch(4, 0);
    const std::string error = test::error_of([&] { pipe.step(ctx.id(), b.x, b.y); });
    CHECK(error.find("no pipeline loss 'hinge' on worker1 (known: cross_entropy, mse") !=
          std::string::npos);
    // The stages still serve: a good step after the failures.
    pipeline::Pipe fine(*w.agents[0], good);
    CHECK(fine.step(ctx.id(), b.x, b.y) > 0);
  }
  w.shutdown();
}

TEST_CASE("pipeline: a user's loss, a user's schedule, and inference") {
  pipeline::register_loss("sum_squares", [](const at::Tensor& out, const at::Tensor& target) {
    return (out - target).pow(2).sum(1).mean();
  });
  CHECK(test::error_of([] {
          pipeline::register_loss("mse", {});
        }).find("pipeline loss 'mse' is registered already") != std::string::npos);
  // GPipe with the backwards in reverse order.
  struct Reverse final : pipeline::Schedule {
    std::string name() const override { return "reverse"; }
    pipeline::Plan plan(int workers, int chunks) const override {
      pipeline::Plan p = pipeline::GPipe().plan(workers, chunks);
      for (auto& list : p.actions) std::reverse(list.begin() + chunks, list.end());
      return p;
    }
  };
  World w(3);
  {
    std::vector<RemoteModule> stages;
    stages.emplace_back(*w.agents[0], "worker1/cpu", "Linear", std::vector<c10::IValue>{4, 4});
    stages.emplace_back(*w.agents[0], "worker2/cpu", "Linear", std::vector<c10::IValue>{4, 2});
    pipeline::PipeOptions o;
    o.chunks = 3;
    o.loss = "sum_squares";
    pipeline::Pipe pipe(*w.agents[0], stages, o, std::make_shared<Reverse>());
    at::manual_seed(3);
    at::Tensor x = at::randn({7, 4}), y = at::randn({7, 2});
    // The local twin: the same weights, the same loss on the whole batch.
    auto s0 = stages[0].state_dict(), s1 = stages[1].state_dict();
    at::Tensor w0 = s0.at("weight").requires_grad_(), b0 = s0.at("bias").requires_grad_();
    at::Tensor w1 = s1.at("weight").requires_grad_(), b1 = s1.at("bias").requires_grad_();
    at::Tensor out = at::addmm(b1, at::addmm(b0, x, w0.t()), w1.t());
    at::Tensor want = (out - y).pow(2).sum(1).mean();
    want.backward();
    // Inference: 3 micro-batches through both stages, no gradients.
    at::Tensor inferred = pipe.forward(x);
    CHECK(at::allclose(inferred, out.detach(), 1e-5, 1e-6));
    CHECK_FALSE(inferred.requires_grad());
    CHECK(pipe.last_step().passes.empty());  // forward() leaves the last step's record alone
    dist::Context ctx(*w.agents[0]);
    CHECK(pipe.step(ctx.id(), x, y) == doctest::Approx(want.item<double>()).epsilon(1e-5));
    CHECK(pipe.parameters().size() == 4);
    // The stages' gradients are in the context, on their owners, and equal
    // the whole batch's (every micro-batch's share added up).
    auto expect_grads = [&](int worker, const at::Tensor& weight, const at::Tensor& bias) {
      auto grads = dist::get_gradients(*w.agents[worker], ctx.id());
      CHECK(grads.size() == 2);
      for (const auto& g : grads) {
        const at::Tensor& want_grad = g.key().dim() == 2 ? weight.grad() : bias.grad();
        CHECK(at::allclose(g.value(), want_grad, 1e-5, 1e-6));
      }
    };
    expect_grads(1, w0, b0);
    expect_grads(2, w1, b1);
    // Every pass was recorded, on its worker, in the user's order.
    const auto& passes = pipe.last_step().passes;
    REQUIRE(passes.size() == 12);
    CHECK(pipeline::to_string(passes[3].action) == "B2@0");
    CHECK(passes[3].worker == 0);
    for (const auto& p : passes) CHECK(p.end_us >= p.start_us);
    REQUIRE(pipe.last_step().bubble.size() == 2);
    for (double b : pipe.last_step().bubble) CHECK((b >= 0 && b < 1));
    // The timeline: valid trace-event JSON with a slice per pass.
    const std::string path = "/tmp/tandem_pipe_trace_" + std::to_string(::getpid()) + ".json";
    pipe.write_trace(path);
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    std::remove(path.c_str());
    CHECK(text.rfind("{\"traceEvents\":[", 0) == 0);
    size_t slices = 0;
    for (size_t at = text.find("\"ph\":\"X\""); at != std::string::npos;
         at = text.find("\"ph\":\"X\"", at + 1)) {
      ++slices;
    }
    CHECK(slices == 12);
    CHECK(text.find("\"name\":\"B2\",\"cat\":\"backward\",\"pid\":0,\"tid\":0") !=
          std::string::npos);
    CHECK(text.find("\"args\":{\"name\":\"worker2\"}") != std::string::npos);
    CHECK(test::error_of([&] {
            pipe.write_trace("/nonexistent/dir/t.json");
          }).find("write_trace: cannot write '/nonexistent/dir/t.json'") != std::string::npos);
  }
  w.shutdown();
}

namespace {

// A stage without parameters whose output is not floating point: ids + 1.
struct NextIdImpl : torch::nn::Module {
  at::Tensor forward(at::Tensor ids) { return ids + 1; }
};

}  // namespace

TEST_CASE("pipeline: integer activations, a schedule of the wrong shape, a context not current") {
  static const bool registered = [] {
    nn::register_module("test_next_id", [] { return std::make_shared<NextIdImpl>(); });
    return true;
  }();
  (void)registered;
  World w(3);
  {
    // Stage 0 hands token ids on; stage 1 embeds them. Stage 0 still gets
    // its (empty) gradient answer, so nobody waits out a timeout.
    std::vector<RemoteModule> stages;
    stages.emplace_back(*w.agents[0], "worker1/cpu", "test_next_id");
    stages.emplace_back(*w.agents[0], "worker2/cpu", "Embedding", std::vector<c10::IValue>{10, 3});
    pipeline::PipeOptions o;
    o.chunks = 2;
    o.loss = "mse";
    o.timeout = std::chrono::seconds(5);
    pipeline::Pipe pipe(*w.agents[0], stages, o);
    at::Tensor ids = at::arange(6, at::kLong), target = at::zeros({6, 3});
    {
      dist::Context ctx(*w.agents[0]);
      const auto started = std::chrono::steady_clock::now();
      CHECK(pipe.step(ctx.id(), ids, target) > 0);
      CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(4));
      CHECK(dist::get_gradients(*w.agents[2], ctx.id()).size() == 1);  // the embedding's
      // A context id that is not the one current here is refused.
      CHECK(test::error_of([&] {
              pipe.step(ctx.id() + 1, ids, target);
            }).find("is not the one current on this thread") != std::string::npos);
    }

    // A user's schedule that plans another shape than the pipe's.
    struct Wrong final : pipeline::Schedule {
      std::string name() const override { return "wrong"; }
      pipeline::Plan plan(int, int chunks) const override {
        return pipeline::GPipe().plan(3, chunks);  // 3 workers, whatever is asked
      }
    };
    CHECK(
        test::error_of([&] { pipeline::Pipe(*w.agents[0], stages, o, std::make_shared<Wrong>()); })
            .find("schedule wrong planned 3 workers and 3 stages for a pipe of 2 workers and 2 "
                  "stages") != std::string::npos);
  }
  w.shutdown();
}

TEST_CASE("pipeline: a sequential model's layers cut into stages, by counts or balanced") {
  CHECK(pipeline::balance({1, 1, 1, 1}, 2) == std::vector<int>{2, 2});
  CHECK(pipeline::balance({5, 1, 1, 1, 1, 1}, 2) == std::vector<int>{1, 5});
  CHECK(pipeline::balance({1, 2, 3, 4, 5}, 3) == std::vector<int>{3, 1, 1});  // 6, 4, 5
  CHECK(test::error_of([] {
          pipeline::balance({1, 2}, 3);
        }).find("balance: 3 stages for 2 layers") != std::string::npos);
  CHECK(test::error_of([] {
          pipeline::balance({1, -2}, 1);
        }).find("costs must be >= 0") != std::string::npos);

  // Parameters: 500, 0, 10100, 0, 404.
  const std::vector<c10::IValue> layers = {spec("Linear", {4, 100}), spec("ReLU"),
                                           spec("Linear", {100, 100}), spec("ReLU"),
                                           spec("Linear", {100, 4})};
  const std::vector<int> counts = pipeline::balance_by_parameters(layers, 2);
  CHECK(counts == std::vector<int>{1, 4});
  CHECK(test::error_of([] {
          pipeline::balance_by_parameters({c10::IValue(int64_t{3})}, 1);
        }).find("layer 0 is not an nn::spec(factory, args)") != std::string::npos);

  World w(3);
  {
    auto stages = pipeline::partition(*w.agents[0], layers, {"worker1/cpu", "worker2/cpu"}, counts);
    REQUIRE(stages.size() == 2);
    auto s0 = stages[0].state_dict(), s1 = stages[1].state_dict();
    CHECK(s0.size() == 2);  // 0.weight, 0.bias
    CHECK(s1.size() == 4);  // 1.* and 3.*: the Linear layers among ReLU, Linear, ReLU, Linear
    pipeline::PipeOptions o;
    o.chunks = 2;
    pipeline::Pipe pipe(*w.agents[0], stages, o);
    at::manual_seed(5);
    at::Tensor x = at::randn({5, 4});
    at::Tensor h = at::relu(at::addmm(s0.at("0.bias"), x, s0.at("0.weight").t()));
    h = at::relu(at::addmm(s1.at("1.bias"), h, s1.at("1.weight").t()));
    at::Tensor want = at::addmm(s1.at("3.bias"), h, s1.at("3.weight").t());
    CHECK(at::allclose(pipe.forward(x), want, 1e-5, 1e-6));

    // Counts measured rather than counted: a heavy Linear among cheap ReLUs
    // gets a stage of its own, and two heavy ones go to different stages.
    auto relu = spec("ReLU");
    auto heavy = spec("Linear", {512, 512});
    const at::Tensor sample = at::randn({128, 512});
    const std::vector<c10::IValue> one = {heavy, relu, relu, relu, relu, relu};
    auto times = pipeline::layer_times(one, sample);
    REQUIRE(times.size() == one.size());
    for (size_t i = 1; i < times.size(); ++i) CHECK(times[0] > 5 * times[i]);
    CHECK(pipeline::balance_by_time(one, 2, sample) == std::vector<int>{1, 5});
    const std::vector<c10::IValue> two = {relu, heavy, relu, heavy, relu};
    auto split = pipeline::balance_by_time(two, 3, sample);
    REQUIRE(split.size() == 3);
    CAPTURE(split);
    auto apart = [](int cut) { return cut == 2 || cut == 3; };  // a cut between layers 1 and 3
    CHECK((apart(split[0]) || apart(split[0] + split[1])));
    CHECK(test::error_of([&] {
            pipeline::layer_times({spec("Linear", {3, 4})}, sample);
          }).find("layer_times: layer 0 (Linear) failed on its input of shape [128, 512]") !=
          std::string::npos);
    CHECK(test::error_of([&] {
            pipeline::layer_times({relu, c10::IValue(int64_t{3})}, sample);
          }).find("layer_times: layer 1 is not an nn::spec(factory, args)") != std::string::npos);
    CHECK(test::error_of([&] {
            pipeline::layer_times(one, sample, 0);
          }).find("repeats must be >= 1, not 0") != std::string::npos);
    CHECK(test::error_of([&] {
            pipeline::balance_by_time(one, 7, sample);
          }).find("balance: 7 stages for 6 layers") != std::string::npos);

    CHECK(test::error_of([&] {
            pipeline::partition(*w.agents[0], layers, {"worker1/cpu"}, {5, 0});
          }).find("2 stage counts but 1 devices") != std::string::npos);
    CHECK(test::error_of([&] {
            pipeline::partition(*w.agents[0], layers, {"worker1/cpu", "worker2/cpu"}, {5, 0});
          }).find("stage 1 has 0 layers; each needs at least 1") != std::string::npos);
    CHECK(test::error_of([&] {
            pipeline::partition(*w.agents[0], layers, {"worker1/cpu", "worker2/cpu"}, {2, 2});
          }).find("the counts add up to 4 layers, the model has 5") != std::string::npos);
  }
  w.shutdown();
}

TEST_CASE("pipeline: a TorchScript stage trains beside a factory-built one as the unsplit model") {
  // Stage 0: Linear(5, 4) built by its factory on worker1; stage 1: the
  // TorchScript MLP of scripted_mlp.pt (fc1 4->8, tanh, fc2 8->3) on worker2.
  const std::string script = std::string(TANDEM_TEST_DATA) + "/scripted_mlp.pt";
  World w(3);
  {
    std::vector<RemoteModule> stages;
    stages.emplace_back(*w.agents[0], "worker1/cpu", "Linear",
                        std::vector<c10::IValue>{int64_t{5}, int64_t{4}});
    stages.push_back(RemoteModule::from_torchscript(*w.agents[0], "worker2/cpu", script));
    LocalStages local = local_copies(stages);
    REQUIRE(local[1].size() == 4);  // fc1.*, fc2.*
    auto forward = [&](const at::Tensor& x) {
      at::Tensor h = at::addmm(local[0].at("bias"), x, local[0].at("weight").t());
      h = at::tanh(at::addmm(local[1].at("fc1.bias"), h, local[1].at("fc1.weight").t()));
      return at::addmm(local[1].at("fc2.bias"), h, local[1].at("fc2.weight").t());
    };
    // 7 rows in 3 micro-batches: 3 + 2 + 2.
    train_beside_local(*w.agents[0], stages, local, forward, "1f1b", 3, 7, 5, 0.3, 40);
  }
  w.shutdown();
}

TEST_CASE("pipeline: messages for a step whose run never comes are dropped after its timeout") {
  World w(2);
  {
    auto& from = *w.agents[0];
    auto& to = *w.agents[1];
    auto pending_within = [&](size_t want, std::chrono::milliseconds limit) {
      const auto until = std::chrono::steady_clock::now() + limit;
      while (pipeline::pending_steps(to) != want && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      return pipeline::pending_steps(to);
    };
    CHECK(pipeline::pending_steps(to) == 0);
    auto put = [&](int64_t step, int64_t timeout_ms, int64_t chunk) {
      rpc::LayerAccess::notify(
          from, "worker1", "tandem.pipe.put",
          rpc::to_ivalues(step, timeout_ms, int64_t{0}, int64_t{1}, chunk, at::ones({2, 3})));
    };
    // An activation for step 77 (pass timeout 2 s) and an abort for step
    // 78: no run comes for either.
    const auto sent = std::chrono::steady_clock::now();
    put(77, 2000, 0);
    rpc::LayerAccess::notify(from, "worker1", "tandem.pipe.abort",
                             rpc::to_ivalues(int64_t{78}, int64_t{2000}, std::string("gone")));
    CHECK(pending_within(2, std::chrono::seconds(5)) == 2);
    if (std::chrono::steady_clock::now() - sent < std::chrono::milliseconds(1500)) {
      CHECK(pipeline::pending_steps(to) == 2);  // not yet
    }
    CHECK(pending_within(0, std::chrono::seconds(10)) == 0);
    // A late message for an expired step is dropped, not kept again: once a
    // later step's message (same connection, so after it) is there, only
    // that step is.
    put(77, 2000, 1);
    put(80, 60000, 0);
    CHECK(pending_within(1, std::chrono::seconds(5)) == 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(pipeline::pending_steps(to) == 1);
    // A timeout from the wire that would overflow the clock is clamped.
    rpc::LayerAccess::notify(from, "worker1", "tandem.pipe.put",
                             rpc::to_ivalues(int64_t{79}, std::numeric_limits<int64_t>::max(),
                                             int64_t{0}, int64_t{1}, int64_t{0}, at::ones({1})));
    CHECK(pending_within(2, std::chrono::seconds(5)) == 2);
  }
  w.shutdown();
}

namespace {

// One Linear applied twice: its weight gets two contributions, both on the
// way from the stage's output to its input.
struct TwiceImpl : torch::nn::Module {
  explicit TwiceImpl(int64_t d) { lin = register_module("lin", torch::nn::Linear(d, d)); }
  at::Tensor forward(const at::Tensor& x) { return lin(at::tanh(lin(x))); }
  torch::nn::Linear lin{nullptr};
};

}  // namespace

TEST_CASE(
    "pipeline: zero-bubble's split backward equals the whole one: several layers a stage, "
    "a weight used twice, a stage without parameters") {
  nn::register_module("test_twice", [](int64_t d) { return std::make_shared<TwiceImpl>(d); });
  World w(5);
  {
    std::vector<RemoteModule> stages;
    stages.emplace_back(*w.agents[0], "worker1/cpu", "Sequential",
                        std::vector<c10::IValue>{nn::list({spec("Linear", {6, 8}), spec("Tanh"),
                                                           spec("Linear", {8, 8}), spec("Tanh")})});
    stages.emplace_back(*w.agents[0], "worker2/cpu", "test_twice",
                        std::vector<c10::IValue>{int64_t{8}});
    stages.emplace_back(*w.agents[0], "worker3/cpu", "Tanh", std::vector<c10::IValue>{});
    stages.emplace_back(*w.agents[0], "worker4/cpu", "Sequential",
                        std::vector<c10::IValue>{nn::list(
                            {spec("Linear", {8, 8}), spec("ReLU"), spec("Linear", {8, 3})})});
    LocalStages local = local_copies(stages);
    auto linear = [](const std::map<std::string, at::Tensor>& m, const std::string& prefix,
                     const at::Tensor& x) {
      return at::addmm(m.at(prefix + "bias"), x, m.at(prefix + "weight").t());
    };
    auto forward = [&](const at::Tensor& x) {
      at::Tensor h = at::tanh(linear(local[0], "2.", at::tanh(linear(local[0], "0.", x))));
      h = linear(local[1], "lin.", at::tanh(linear(local[1], "lin.", h)));
      h = at::tanh(h);
      return linear(local[3], "2.", at::relu(linear(local[3], "0.", h)));
    };
    // 10 rows in 4 micro-batches: 3 + 3 + 2 + 2.
    auto last =
        train_beside_local(*w.agents[0], stages, local, forward, "zero-bubble", 4, 10, 6, 0.2, 60);
    size_t weight_passes = 0;
    for (const auto& p : last.passes)
      weight_passes += p.action.kind == pipeline::Action::kWeightGrad;
    CHECK(weight_passes == 4 * 4);
  }
  w.shutdown();
}

TEST_CASE("pipeline: two drivers step their own pipes at once over the same two workers") {
  // Workers 2 and 3 hold a stage of each pipe; drivers 0 and 1 step theirs
  // from two threads, each with its own DistributedOptimizer.
  const int steps = 3;
  const int64_t rows = 10;
  const double lr = 0.2;
  World w(4);
  {
    std::vector<Weights> init = {initial(2, 11), initial(2, 12)};
    std::vector<std::vector<RemoteModule>> stages;
    for (int d = 0; d < 2; ++d) {
      stages.push_back(make_stages(*w.agents[d], init[d], [](int s) { return 2 + s; }));
    }
    std::vector<std::vector<double>> losses(2);
    std::vector<std::string> errors(2);
    std::vector<Batch> batches;  // made here: the seeded generator is global
    for (int step = 0; step < steps; ++step) batches.push_back(batch(rows, step));
    auto drive = [&](int d) {
      try {
        pipeline::PipeOptions o;
        o.chunks = 4;
        o.schedule = d == 0 ? "1f1b" : "zero-bubble";
        pipeline::Pipe pipe(*w.agents[d], stages[d], o);
        optim::Options so;
        so.lr = lr;
        optim::DistributedOptimizer opt(*w.agents[d], optim::Kind::kSGD, pipe.parameters(), so);
        for (int step = 0; step < steps; ++step) {
          const Batch& b = batches[step];
          dist::Context ctx(*w.agents[d]);
          losses[d].push_back(pipe.step(ctx.id(), b.x, b.y));
          opt.step(ctx.id());
        }
      } catch (const std::exception& e) {
        errors[d] = e.what();
      }
    };
    std::thread other(drive, 1);
    drive(0);
    other.join();
    for (int d = 0; d < 2; ++d) {
      CAPTURE(d);
      CHECK(errors[d] == "");
      auto [want_losses, want] = local_training(init[d], steps, rows, lr);
      REQUIRE(losses[d].size() == static_cast<size_t>(steps));
      for (int step = 0; step < steps; ++step) {
        CHECK(losses[d][step] == doctest::Approx(want_losses[step]).epsilon(1e-5));
      }
      for (int s = 0; s < 2; ++s) {
        auto state = stages[d][s].state_dict();
        CHECK(at::allclose(state.at("0.weight"), want.w[s].detach(), 1e-5, 1e-6));
        CHECK(at::allclose(state.at("0.bias"), want.b[s].detach(), 1e-5, 1e-6));
      }
    }
    for (int a = 0; a < 4; ++a) CHECK(pipeline::pending_steps(*w.agents[a]) == 0);
  }
  w.shutdown();
}

TEST_CASE(
    "pipeline: a pipe's step and a RemoteModule's backward share one context and one "
    "optimizer step") {
  // The pipe trains on (x, y); in the same context a RemoteModule on worker3
  // gets its own loss's backward. One DistributedOptimizer steps both.
  const double lr = 0.2;
  World w(4);
  {
    Weights init = initial(2, 21);
    auto stages = make_stages(*w.agents[0], init, [](int s) { return 1 + s; });
    RemoteModule side(*w.agents[0], "worker3/cpu", "Linear",
                      std::vector<c10::IValue>{kIn, int64_t{1}});
    auto side_state = side.state_dict();
    at::Tensor sw = side_state.at("weight").clone().requires_grad_(),
               sb = side_state.at("bias").clone().requires_grad_();
    pipeline::PipeOptions o;
    o.chunks = 3;
    o.schedule = "zero-bubble";
    pipeline::Pipe pipe(*w.agents[0], stages, o);
    auto params = pipe.parameters();
    for (auto& p : side.remote_parameters()) params.push_back(p);
    optim::Options so;
    so.lr = lr;
    optim::DistributedOptimizer opt(*w.agents[0], optim::Kind::kSGD, params, so);
    auto [want_losses, want] = local_training(init, 1, 10, lr);
    Batch b = batch(10, 0);
    {
      dist::Context ctx(*w.agents[0]);
      CHECK(pipe.step(ctx.id(), b.x, b.y) == doctest::Approx(want_losses[0]).epsilon(1e-5));
      at::Tensor out = side.forward(b.x);
      dist::backward(*w.agents[0], ctx.id(), {at::sum(out * out)});
      opt.step(ctx.id());
    }
    for (int s = 0; s < 2; ++s) {
      auto state = stages[s].state_dict();
      CHECK(at::allclose(state.at("0.weight"), want.w[s].detach(), 1e-5, 1e-6));
    }
    at::Tensor side_loss = at::sum(at::pow(at::addmm(sb, b.x, sw.t()), 2));
    auto g = torch::autograd::grad({side_loss}, {sw, sb});
    auto after = side.state_dict();
    CHECK(at::allclose(after.at("weight"), sw.detach() - lr * g[0], 1e-5, 1e-6));
    CHECK(at::allclose(after.at("bias"), sb.detach() - lr * g[1], 1e-5, 1e-6));
  }
  w.shutdown();
}

namespace {

struct IdentityImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x; }
};

// Linear whose output's gradient is halved by a tensor hook.
struct HalvedImpl : torch::nn::Module {
  HalvedImpl(int64_t in, int64_t out) { lin = register_module("lin", torch::nn::Linear(in, out)); }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = lin(x);
    if (y.requires_grad()) y.register_hook([](at::Tensor g) { return g * 0.5; });
    return y;
  }
  torch::nn::Linear lin{nullptr};
};

}  // namespace

TEST_CASE(
    "pipeline: zero-bubble passes back a stage that returns its input, and runs a "
    "tensor hook once") {
  nn::register_module("test_identity", [] { return std::make_shared<IdentityImpl>(); });
  nn::register_module(
      "test_halved", [](int64_t in, int64_t out) { return std::make_shared<HalvedImpl>(in, out); });
  World w(4);
  {
    std::vector<RemoteModule> stages;
    stages.emplace_back(*w.agents[0], "worker1/cpu", "Linear",
                        std::vector<c10::IValue>{kIn, kHidden});
    stages.emplace_back(*w.agents[0], "worker2/cpu", "test_identity", std::vector<c10::IValue>{});
    stages.emplace_back(*w.agents[0], "worker3/cpu", "test_halved",
                        std::vector<c10::IValue>{kHidden, kClasses});
    auto s0 = stages[0].state_dict(), s2 = stages[2].state_dict();
    at::Tensor w0 = s0.at("weight").clone().requires_grad_(),
               b0 = s0.at("bias").clone().requires_grad_();
    at::Tensor w2 = s2.at("lin.weight").clone().requires_grad_(),
               b2 = s2.at("lin.bias").clone().requires_grad_();
    Batch b = batch(6, 0);
    at::Tensor y = at::addmm(b2, at::addmm(b0, b.x, w0.t()), w2.t());
    y.register_hook([](at::Tensor g) { return g * 0.5; });
    at::Tensor want = at::cross_entropy_loss(y, b.y);
    auto g = torch::autograd::grad({want}, {w0, b0, w2, b2});
    pipeline::PipeOptions o;
    o.chunks = 2;
    o.schedule = "zero-bubble";
    pipeline::Pipe pipe(*w.agents[0], stages, o);
    optim::Options so;
    so.lr = 1.0;
    optim::DistributedOptimizer opt(*w.agents[0], optim::Kind::kSGD, pipe.parameters(), so);
    {
      dist::Context ctx(*w.agents[0]);
      CHECK(pipe.step(ctx.id(), b.x, b.y) == doctest::Approx(want.item<double>()).epsilon(1e-5));
      opt.step(ctx.id());
    }
    auto a0 = stages[0].state_dict(), a2 = stages[2].state_dict();
    // Stage 0's gradient came back through the identity stage (not zeros),
    // and the hook halved stage 2's once (not a quarter).
    CHECK(at::allclose(a0.at("weight"), w0.detach() - g[0], 1e-5, 1e-6));
    CHECK(at::allclose(a0.at("bias"), b0.detach() - g[1], 1e-5, 1e-6));
    CHECK(at::allclose(a2.at("lin.weight"), w2.detach() - g[2], 1e-5, 1e-6));
    CHECK(at::allclose(a2.at("lin.bias"), b2.detach() - g[3], 1e-5, 1e-6));
  }
  w.shutdown();
}

TEST_CASE("trace: one timeline holds the pipeline's passes, backward parts and optimizer steps") {
  test::TempDir dir;
  uint64_t engine_context = 0;
  {
    World w(3, {}, [&](rpc::AgentOptions& o) { o.trace_dir = dir.path; });
    {
      auto stages = make_stages(*w.agents[0], initial(2, 5), [](int s) { return s + 1; });
      pipeline::PipeOptions o;
      o.chunks = 2;
      pipeline::Pipe pipe(*w.agents[0], stages, o);
      optim::DistributedOptimizer opt(*w.agents[0], optim::Kind::kSGD, pipe.parameters(), {});
      Batch b = batch(6, 0);
      {
        dist::Context ctx(*w.agents[0]);
        pipe.step(ctx.id(), b.x, b.y);
        opt.step(ctx.id());
      }
      {
        // The distributed engine: both stages called from here, each a part.
        dist::Context ctx(*w.agents[0]);
        engine_context = ctx.id();
        at::Tensor h = stages[0].forward(b.x.requires_grad_());
        at::Tensor out = stages[1].forward(h);
        dist::backward(*w.agents[0], ctx.id(), {at::cross_entropy_loss(out, b.y)});
        opt.step(ctx.id());
      }
    }
    w.shutdown();
  }
  // Every worker wrote its file when it shut down.
  std::vector<test::Trace> t;
  for (int r = 0; r < 3; ++r) {
    const std::string path = dir.file("tandem-trace-rank" + std::to_string(r) + ".json");
    t.push_back(test::read_trace(path));
    REQUIRE(t.back().ok);
    CHECK(test::valid_json(path));
  }
  // Pipeline: each pass on its stage's worker (gpipe, 2 micro-batches).
  for (int stage = 0; stage < 2; ++stage) {
    for (int chunk = 0; chunk < 2; ++chunk) {
      for (const char* kind : {"F", "B"}) {
        const std::string name = kind + std::to_string(chunk) + "@" + std::to_string(stage);
        CAPTURE(name);
        auto passes = t[stage + 1].find("X", name, stage + 1);
        REQUIRE(passes.size() == 1);
        CHECK(passes[0].cat == "pipeline");
        CHECK(passes[0].dur >= 0);
      }
    }
  }
  // Stage 1 runs micro-batch 0's forward after stage 0 did (one clock: one host).
  CHECK(t[2].find("X", "F0@1")[0].ts >= t[1].find("X", "F0@0")[0].end());
  // Backward: the root's slice holds each worker's part and the nodes it ran.
  auto root = t[0].find("X", "backward", 0);
  REQUIRE(root.size() == 1);
  CHECK(root[0].line.find("\"context\":" + std::to_string(engine_context)) != std::string::npos);
  CHECK(!t[0].find("X", "backward nodes", 0).empty());
  for (int r = 1; r < 3; ++r) {
    CAPTURE(r);
    auto parts = t[r].spans("backward part", r);
    REQUIRE(parts.size() == 1);
    CHECK(parts[0].line.find("\"ok\":true") != std::string::npos);
    CHECK(parts[0].ts >= root[0].ts);
    CHECK(parts[0].end() <= root[0].end());
    auto nodes = t[r].find("X", "backward nodes", r);
    REQUIRE(!nodes.empty());
    for (const auto& n : nodes) {
      CHECK(n.ts >= parts[0].ts);
      CHECK(n.end() <= parts[0].end());
    }
  }
  // Optimizer: two steps on the caller, each holding both owners' local steps.
  auto steps = t[0].find("X", "DistributedOptimizer::step", 0);
  REQUIRE(steps.size() == 2);
  CHECK(steps[1].ts >= root[0].end());  // after the backward it steps with
  for (int r = 1; r < 3; ++r) {
    auto local = t[r].find("X", "optimizer step", r);
    REQUIRE(local.size() == 2);
    for (int i = 0; i < 2; ++i) {
      CHECK(local[i].ts >= steps[i].ts);
      CHECK(local[i].end() <= steps[i].end());
    }
  }
  CHECK(t[0].find("X", "optimizer step").empty());  // no parameter lives on the driver
}
