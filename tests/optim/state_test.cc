// DistributedOptimizer beyond PyTorch's: learning rates and their schedules,
// global gradient clipping and checkpoints. A split model trained with them
// ends where the unsplit one trained by LibTorch (clip_grad_norm_, the same
// rates) does; a checkpointed run resumed in fresh optimizers ends
// bit-identical to an uninterrupted one; bad input is a clear error.
#include "test_util.h"

#include <ATen/ops/clamp.h>
#include <ATen/ops/max.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tanh.h>
#include <torch/csrc/autograd/generated/variable_factories.h>
// clip_grad.h calls torch::stack, torch::max, torch::clamp and includes
// none of them: torch/types.h would bring them (with all of ATen.h) by
// this one line.
namespace torch {
using namespace at;  // NOLINT
}  // namespace torch
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "optim/optim_support.h"
#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/optim/lr_scheduler.h"
#include "tandem/rpc/rref.h"

using namespace tandem;
using namespace tandem::test::optim_support;
using test::World;
namespace dist = tandem::autograd;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 6;

// The split model (optim_support.h): worker0 drives, so W[0] is the
// caller's own parameter (no RPC) and W[1], W[2] are remote.
std::vector<at::Tensor> fresh_params(int64_t seed) {
  at::manual_seed(seed);
  return {at::randn({4, 5}, kF64).requires_grad_(), at::randn({5, 3}, kF64).requires_grad_(),
          at::randn({3, 2}, kF64).requires_grad_()};
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& w) {
  std::vector<at::Tensor> out;
  for (const auto& t : w) out.push_back(t.detach().clone().requires_grad_());
  return out;
}

at::Tensor input(int step) {
  at::manual_seed(100 + step);
  return at::randn({6, 4}, kF64);
}

at::Tensor local_loss(const std::vector<at::Tensor>& w, const at::Tensor& x) {
  at::Tensor h = at::tanh(at::mm(x, w[0]));
  h = at::tanh(at::mm(h, w[1]));
  return at::tanh(at::mm(h, w[2])).pow(2).sum();
}

// RRefs to L().w: W[0] on worker0 itself, W[1] on worker1, W[2] on worker2.
std::vector<rpc::RRef<at::Tensor>> split_params(World& w) {
  return {rpc::RRef<at::Tensor>::make_local(w[0], L().w[0]),
          w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(1)),
          w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker2", "param", int64_t(2))};
}

// One step of the split model: forward, backward, clip, step. Returns the
// total norm clip_grad_norm reported; `after_clip` sees the context.
double dist_step(World& w, optim::DistributedOptimizer& opt, int step, double max_norm,
                 const std::function<void(uint64_t)>& after_clip = {}) {
  dist::Context ctx(w[0]);
  at::Tensor h = at::tanh(at::mm(input(step), L().w[0]));
  h = w[0].rpc_sync<at::Tensor>("worker1", "layer", int64_t(1), h);
  at::Tensor y = w[0].rpc_sync<at::Tensor>("worker2", "layer", int64_t(2), h);
  dist::backward(w[0], ctx.id(), {y.pow(2).sum()});
  const double norm = opt.clip_grad_norm(ctx.id(), max_norm);
  if (after_clip) after_clip(ctx.id());
  opt.step(ctx.id());
  return norm;
}

// SGD, AdamW and RMSprop get a StepLR, Adam and Adagrad a cosine schedule;
// their rates after `epoch` steps by PyTorch's closed forms. (LibTorch's own
// torch::optim::StepLR cannot be the reference: it decays one epoch later
// than PyTorch's, on the call after step_size calls.)
bool uses_step_lr(optim::Kind kind) { return static_cast<int>(kind) % 2 == 0; }
std::unique_ptr<optim::LRScheduler> schedule(const Case& c, optim::DistributedOptimizer& opt) {
  if (uses_step_lr(c.kind)) return std::make_unique<optim::StepLR>(opt, 2, 0.5);
  return std::make_unique<optim::CosineAnnealingLR>(opt, 5, c.o.lr / 10);
}
double expected_lr(const Case& c, int epoch) {
  if (uses_step_lr(c.kind)) return c.o.lr * std::pow(0.5, epoch / 2);
  const double eta_min = c.o.lr / 10;
  return eta_min + (c.o.lr - eta_min) * (1 + std::cos(M_PI * epoch / 5)) / 2;
}

using test::TempDir;  // a folder for checkpoint files, removed at the end

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void write_file(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

}  // namespace

TEST_CASE("optim: every kind with clip_grad_norm and a schedule equals local training") {
  World w(3, define);
  const double max_norm = 0.1;
  for (const auto& c : every_kind()) {
    CAPTURE(optim::kind_name(c.kind));
    L().w = fresh_params(7);
    std::vector<at::Tensor> ref = copies(L().w);
    auto local = local_optimizer(c.kind, ref, c.o);
    auto params = split_params(w);
    {
      optim::DistributedOptimizer opt(w[0], c.kind, params, c.o);
      CHECK(opt.owners() == std::vector<int>{0, 1, 2});
      auto sched = schedule(c, opt);
      for (int step = 0; step < kSteps; ++step) {
        CAPTURE(step);
        const double norm = dist_step(w, opt, step, max_norm, [&](uint64_t ctx) {
          // The owners' stored gradients are the clipped ones.
          double sq = 0;
          for (int r = 0; r < 3; ++r) {
            sq += dist::get_gradients(w[r], ctx).at(L().w[r]).pow(2).sum().item<double>();
          }
          CHECK(std::sqrt(sq) < max_norm * (1 + 1e-9));
        });
        local->zero_grad();
        local_loss(ref, input(step)).backward();
        const double local_norm = torch::nn::utils::clip_grad_norm_(ref, max_norm);
        local->step();
        CHECK(norm > max_norm);  // clipping really happened
        CHECK(norm == doctest::Approx(local_norm).epsilon(1e-12));
        sched->step();
        CHECK(sched->last_epoch() == step + 1);
        const double lr = expected_lr(c, step + 1);
        for (auto& g : local->param_groups()) g.options().set_lr(lr);
        CHECK(opt.lr() == doctest::Approx(lr).epsilon(1e-12));
      }
      CHECK(opt.lr() != c.o.lr);  // the schedule moved it
      CHECK_FALSE(L().w[1].grad().defined());
    }
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(at::allclose(L().w[i], ref[i], 1e-5, 1e-8));
    }
    params.clear();
    for (int r = 0; r < 3; ++r) CHECK(optim::live_optimizers(w[r]) == 0);
  }
  L().w.clear();
  w.shutdown();
}

TEST_CASE("optim: clip_grad_norm with norm types 1, 3, inf and 0 equals clip_grad_norm_") {
  World w(2, define);
  // W[0] on worker0 (the caller's), W[1] on worker1, and W[2] on worker1
  // that the loss never uses: it has no gradient and is skipped.
  at::manual_seed(5);
  L().w = {at::randn({3, 4}, kF64).requires_grad_(), at::randn({4, 2}, kF64).requires_grad_(),
           at::randn({2, 2}, kF64).requires_grad_()};
  std::vector<rpc::RRef<at::Tensor>> params = {
      rpc::RRef<at::Tensor>::make_local(w[0], L().w[0]),
      w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(1)),
      w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(2))};
  {
    optim::DistributedOptimizer opt(w[0], optim::Kind::kSGD, params);
    const at::Tensor x = at::randn({5, 3}, kF64);
    const double inf = std::numeric_limits<double>::infinity();
    for (double norm_type : {1.0, 3.0, inf, 0.0, 2.0}) {
      for (double max_norm : {0.01, 1e6}) {  // clipped, and left alone
        CAPTURE(norm_type);
        CAPTURE(max_norm);
        std::vector<at::Tensor> ref = copies(L().w);
        at::mm(at::tanh(at::mm(x, ref[0])), ref[1]).pow(2).sum().backward();
        const double want = torch::nn::utils::clip_grad_norm_(ref, max_norm, norm_type);
        dist::Context ctx(w[0]);
        at::Tensor h = at::tanh(at::mm(x, L().w[0]));
        at::Tensor y = w[0].rpc_sync<at::Tensor>("worker1", "linear", int64_t(1), h);
        dist::backward(w[0], ctx.id(), {y.pow(2).sum()});
        CHECK(opt.clip_grad_norm(ctx.id(), max_norm, norm_type) ==
              doctest::Approx(want).epsilon(1e-12));
        CHECK(at::allclose(dist::get_gradients(w[0], ctx.id()).at(L().w[0]), ref[0].grad(), 1e-10));
        auto on1 = dist::get_gradients(w[1], ctx.id());
        CHECK(at::allclose(on1.at(L().w[1]), ref[1].grad(), 1e-10));
        CHECK_FALSE(on1.contains(L().w[2]));
      }
    }
    // ClipOptions::counted: the norm over the counted parameters only (a
    // tensor-parallel rank's replicated copies left to another rank), every
    // gradient scaled by its coefficient; a list of another length refused.
    {
      std::vector<at::Tensor> ref = copies(L().w);
      at::mm(at::tanh(at::mm(x, ref[0])), ref[1]).pow(2).sum().backward();
      const double want = torch::nn::utils::clip_grad_norm_({ref[1]}, 0.01);
      const double coef = 0.01 / (want + 1e-6);
      dist::Context ctx(w[0]);
      at::Tensor h = at::tanh(at::mm(x, L().w[0]));
      at::Tensor y = w[0].rpc_sync<at::Tensor>("worker1", "linear", int64_t(1), h);
      dist::backward(w[0], ctx.id(), {y.pow(2).sum()});
      optim::DistributedOptimizer::ClipOptions o;
      o.counted = {false, true, true};
      CHECK(opt.clip_grad_norm(ctx.id(), 0.01, o) == doctest::Approx(want).epsilon(1e-12));
      CHECK(at::allclose(dist::get_gradients(w[0], ctx.id()).at(L().w[0]), ref[0].grad() * coef,
                         1e-10));
      CHECK(at::allclose(dist::get_gradients(w[1], ctx.id()).at(L().w[1]), ref[1].grad(), 1e-10));
      o.counted = {true, true};
      CHECK_THROWS_WITH_AS(opt.clip_grad_norm(ctx.id(), 0.01, o),
                           "DistributedOptimizer::clip_grad_norm: ClipOptions::counted has 2 "
                           "entries for 3 parameters",
                           std::invalid_argument);
    }
    // A context with no gradients at all for these parameters: 0, as clip_grad_norm_.
    dist::Context ctx(w[0]);
    w[0].rpc_sync<at::Tensor>("worker1", "layer", int64_t(2), at::ones({1, 2}, kF64));
    CHECK(opt.clip_grad_norm(ctx.id(), 1.0) == 0.0);
  }
  params.clear();
  L().w.clear();
  w.shutdown();
}

TEST_CASE("optim: set_lr reaches every owner, the caller's own part included") {
  World w(2, define);
  L().w = {at::zeros({2, 1}, kF64).requires_grad_(), at::zeros({2, 1}, kF64).requires_grad_()};
  std::vector<rpc::RRef<at::Tensor>> params = {
      rpc::RRef<at::Tensor>::make_local(w[0], L().w[0]),
      w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(1))};
  {
    optim::Options o;
    o.lr = 1.0;
    optim::DistributedOptimizer opt(w[0], optim::Kind::kSGD, params, o);
    CHECK(opt.lr() == 1.0);
    opt.set_lr(0.25);
    CHECK(opt.lr() == 0.25);
    {
      // The gradient of sum(x @ W) is x^T: 1 everywhere, on both owners.
      dist::Context ctx(w[0]);
      at::Tensor x = at::ones({1, 2}, kF64);
      at::Tensor a = at::mm(x, L().w[0]).sum();
      at::Tensor b = w[0].rpc_sync<at::Tensor>("worker1", "linear", int64_t(1), x).sum();
      dist::backward(w[0], ctx.id(), {a + b});
      opt.step(ctx.id());
    }
    CHECK(at::allclose(L().w[0], at::full({2, 1}, -0.25, kF64)));
    CHECK(at::allclose(L().w[1], at::full({2, 1}, -0.25, kF64)));
  }
  params.clear();
  L().w.clear();
  w.shutdown();
}

TEST_CASE("optim: schedules follow their closed forms, and their state round-trips") {
  World w(1, define);
  L().w = {at::zeros({2, 1}, kF64).requires_grad_()};
  std::vector<rpc::RRef<at::Tensor>> params = {rpc::RRef<at::Tensor>::make_local(w[0], L().w[0])};
  {
    optim::Options o;
    o.lr = 0.8;
    optim::DistributedOptimizer opt(w[0], optim::Kind::kSGD, params, o);
    {
      optim::StepLR sched(opt, 3, 0.5);
      CHECK(sched.base_lr() == 0.8);
      CHECK(opt.lr() == 0.8);
      for (int e = 1; e <= 7; ++e) {
        sched.step();
        CHECK(opt.lr() == doctest::Approx(0.8 * std::pow(0.5, e / 3)).epsilon(1e-15));
      }
      CHECK(sched.last_epoch() == 7);
      CHECK(sched.get_lr() == opt.lr());
    }
    opt.set_lr(0.8);
    {
      optim::CosineAnnealingLR sched(opt, 4, 0.1);
      std::vector<double> lrs;
      for (int e = 1; e <= 4; ++e) {
        sched.step();
        lrs.push_back(opt.lr());
      }
      CHECK(lrs[1] == doctest::Approx(0.45).epsilon(1e-15));  // halfway
      CHECK(lrs[3] == doctest::Approx(0.1).epsilon(1e-15));   // T_max: eta_min
    }
    opt.set_lr(0.8);
    {
      // As in PyTorch, the constructor sets epoch 0's rate.
      optim::LambdaLR sched(opt, [](int64_t e) { return 1.0 / double(e + 2); });
      CHECK(opt.lr() == 0.4);
      sched.step();
      sched.step();
      CHECK(opt.lr() == doctest::Approx(0.2).epsilon(1e-15));
      auto state = sched.state();
      CHECK(state.last_epoch == 2);
      CHECK(state.base_lr == 0.8);
      sched.step();
      // Back to epoch 2 in a schedule made afresh.
      optim::LambdaLR again(opt, [](int64_t e) { return 1.0 / double(e + 2); });
      again.load_state(state);
      CHECK(again.last_epoch() == 2);
      CHECK(opt.lr() == sched.lr_at(2));
      again.step();
      CHECK(opt.lr() == sched.lr_at(3));
    }
    // Bad arguments name the value; nothing changes.
    const double before = opt.lr();
    CHECK_THROWS_WITH_AS(optim::StepLR(opt, 0), doctest::Contains("step_size must be > 0, got 0"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(optim::StepLR(opt, 2, -1), doctest::Contains("gamma"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(optim::CosineAnnealingLR(opt, 0), doctest::Contains("T_max"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(optim::LambdaLR(opt, {}), doctest::Contains("no factor"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(optim::LambdaLR(opt, [](int64_t) { return -1.0; }),
                         doctest::Contains("got -"), std::invalid_argument);
    optim::StepLR sched(opt, 2);
    CHECK_THROWS_WITH_AS(sched.load_state({-1, 0.1}), doctest::Contains("last_epoch"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(sched.load_state({1, std::nan("")}), doctest::Contains("base_lr"),
                         std::invalid_argument);
    CHECK(sched.last_epoch() == 0);
    CHECK(opt.lr() == before);
  }
  params.clear();
  L().w.clear();
  w.shutdown();
}

TEST_CASE("optim: a run checkpointed and resumed in fresh optimizers ends bit-identical") {
  World w(3, define);
  TempDir dir;
  const double max_norm = 0.1;
  constexpr int kAt = 3;  // checkpoint after this many steps
  for (const auto& c : every_kind()) {
    CAPTURE(optim::kind_name(c.kind));
    // Uninterrupted.
    L().w = fresh_params(11);
    std::vector<double> want_lrs;
    {
      auto params = split_params(w);
      optim::DistributedOptimizer opt(w[0], c.kind, params, c.o);
      auto sched = schedule(c, opt);
      for (int step = 0; step < kSteps; ++step) {
        dist_step(w, opt, step, max_norm);
        sched->step();
        want_lrs.push_back(opt.lr());
      }
    }
    std::vector<at::Tensor> want;
    for (auto& t : L().w) want.push_back(t.detach().clone());

    // The same run, checkpointed after kAt steps...
    const std::string path = dir.file(optim::kind_name(c.kind) + ".ckpt");
    L().w = fresh_params(11);
    optim::LRScheduler::State sched_state;
    {
      auto params = split_params(w);
      optim::DistributedOptimizer opt(w[0], c.kind, params, c.o);
      auto sched = schedule(c, opt);
      for (int step = 0; step < kAt; ++step) {
        dist_step(w, opt, step, max_norm);
        sched->step();
      }
      optim::OptimizerState state = opt.state_dict();
      CHECK(state.kind == c.kind);
      CHECK(state.lr == want_lrs[kAt - 1]);
      REQUIRE(state.parts.size() == 3);
      for (int r = 0; r < 3; ++r) {
        CHECK(state.parts[r].rank == r);
        CHECK(state.parts[r].worker == "worker" + std::to_string(r));
        CHECK(state.parts[r].num_params == 1);
        CHECK_FALSE(state.parts[r].bytes.empty());
      }
      opt.save(path);
      sched_state = sched->state();
    }
    // ...and resumed: fresh parameter tensors holding the checkpointed
    // values, a fresh optimizer (its lr the Options' again) and schedule.
    L().w = copies(L().w);
    {
      auto params = split_params(w);
      optim::DistributedOptimizer opt(w[0], c.kind, params, c.o);
      CHECK(opt.lr() == c.o.lr);
      opt.load(path);
      CHECK(opt.lr() == want_lrs[kAt - 1]);
      auto sched = schedule(c, opt);
      sched->load_state(sched_state);
      CHECK(sched->last_epoch() == kAt);
      CHECK(opt.lr() == want_lrs[kAt - 1]);
      for (int step = kAt; step < kSteps; ++step) {
        dist_step(w, opt, step, max_norm);
        sched->step();
        CHECK(opt.lr() == want_lrs[step]);
      }
    }
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(at::equal(L().w[i], want[i]));
    }
    for (int r = 0; r < 3; ++r) CHECK(optim::live_optimizers(w[r]) == 0);
  }
  L().w.clear();
  w.shutdown();
}

TEST_CASE(
    "optim: bad rates, clipping and checkpoints are refused clearly, and the owners still serve") {
  World w(3, define);
  TempDir dir;
  at::manual_seed(3);
  L().w = {at::randn({2, 2}, kF64).requires_grad_(), at::randn({2, 2}, kF64).requires_grad_(),
           at::randn({2, 2}, kF64).requires_grad_(), at::randn({2, 3}, kF64).requires_grad_()};
  auto p1 = w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(1));
  auto p1_2x3 = w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(3));
  auto p1b = w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(0));
  auto p2 = w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker2", "param", int64_t(2));
  {
    optim::Options o;
    o.lr = 0.1;
    optim::DistributedOptimizer adam(w[0], optim::Kind::kAdam, {p1}, o);
    optim::DistributedOptimizer sgd(w[0], optim::Kind::kSGD, {p1}, o);
    optim::DistributedOptimizer adam_on2(w[0], optim::Kind::kAdam, {p2}, o);
    optim::DistributedOptimizer adam_on12(w[0], optim::Kind::kAdam, {p1, p2}, o);
    optim::DistributedOptimizer adam_two(w[0], optim::Kind::kAdam, {p1, p1b}, o);

    // Rates.
    CHECK_THROWS_WITH_AS(adam.set_lr(-1), doctest::Contains("got -1"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(adam.set_lr(std::nan("")), doctest::Contains("got nan"),
                         std::invalid_argument);
    CHECK_THROWS_AS(adam.set_lr(std::numeric_limits<double>::infinity()), std::invalid_argument);
    CHECK(adam.lr() == 0.1);

    // Clipping.
    {
      dist::Context ctx(w[0]);
      w[0].rpc_sync<at::Tensor>("worker1", "linear", int64_t(1), at::ones({1, 2}, kF64));
      CHECK_THROWS_WITH_AS(adam.clip_grad_norm(ctx.id(), 0),
                           doctest::Contains("max_norm must be > 0, got 0"), std::invalid_argument);
      CHECK_THROWS_WITH_AS(adam.clip_grad_norm(ctx.id(), std::nan("")),
                           doctest::Contains("max_norm"), std::invalid_argument);
      CHECK_THROWS_WITH_AS(adam.clip_grad_norm(ctx.id(), 1.0, -2),
                           doctest::Contains("norm_type must be >= 0 (or infinity), got -2"),
                           std::invalid_argument);
      CHECK_THROWS_AS(adam.clip_grad_norm(ctx.id(), 1.0, std::nan("")), std::invalid_argument);
      CHECK_THROWS_AS(adam.clip_grad_norm(0, 1.0), std::invalid_argument);
    }
    {
      // A context worker1 never saw: its error names it.
      dist::Context ctx(w[0]);
      CHECK_THROWS_WITH_AS(adam.clip_grad_norm(ctx.id(), 1.0), doctest::Contains("worker1"),
                           rpc::RemoteError);
    }

    // States that do not fit, refused before any owner is touched.
    CHECK_THROWS_WITH_AS(adam.load_state_dict(sgd.state_dict()),
                         doctest::Contains("the state is of a SGD optimizer, this one is Adam"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        adam.load_state_dict(adam_on2.state_dict()),
        doctest::Contains("the state is of owners [worker2], this optimizer's are [worker1]"),
        std::invalid_argument);
    CHECK_THROWS_WITH_AS(adam.load_state_dict(adam_on12.state_dict()),
                         doctest::Contains("[worker1, worker2]"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        adam.load_state_dict(adam_two.state_dict()),
        doctest::Contains("the state has 2 parameter(s) on worker1, this optimizer 1"),
        std::invalid_argument);
    {
      // The same counts, but another model's state: seen by the owner.
      optim::DistributedOptimizer adam_2x3(w[0], optim::Kind::kAdam, {p1_2x3}, o);
      dist::Context ctx(w[0]);
      at::Tensor y =
          w[0].rpc_sync<at::Tensor>("worker1", "linear", int64_t(3), at::ones({1, 2}, kF64));
      dist::backward(w[0], ctx.id(), {y.sum()});
      adam_2x3.step(ctx.id());
      CHECK_THROWS_WITH_AS(
          adam.load_state_dict(adam_2x3.state_dict()),
          doctest::Contains("the optimizer state for worker1 does not fit its parameter 0: the "
                            "state is of shape [2, 3], the parameter [2, 2]"),
          rpc::RemoteError);
    }
    {
      auto bad = adam.state_dict();
      bad.lr = -3;
      CHECK_THROWS_WITH_AS(adam.load_state_dict(bad), doctest::Contains("learning rate is -3"),
                           std::invalid_argument);
      bad.lr = 0.5;
      bad.parts[0].bytes = "not an archive";
      CHECK_THROWS_WITH_AS(adam.load_state_dict(bad),
                           doctest::Contains("the optimizer state for worker1 cannot be read"),
                           rpc::RemoteError);
      CHECK(adam.lr() == 0.1);
    }

    // Bytes, for a checkpoint of one's own: the same state back, and a
    // flipped byte refused.
    {
      const std::string bytes = optim::state_to_bytes(adam.state_dict());
      adam.load_state_dict(optim::state_from_bytes(bytes));
      std::string flipped = bytes;
      flipped[flipped.size() / 2] ^= 1;
      CHECK_THROWS_WITH_AS(optim::state_from_bytes(flipped, "my checkpoint's optimizer"),
                           doctest::Contains("my checkpoint's optimizer is corrupt"),
                           std::invalid_argument);
    }

    // Files.
    const std::string missing = dir.file("missing.ckpt");
    CHECK_THROWS_WITH_AS(adam.load(missing), doctest::Contains(("'" + missing + "'").c_str()),
                         std::runtime_error);
    const std::string other = dir.file("other.ckpt");
    write_file(other, "hello, not a checkpoint");
    CHECK_THROWS_WITH_AS(
        adam.load(other),
        doctest::Contains(("'" + other + "' is not an optimizer checkpoint").c_str()),
        std::invalid_argument);
    const std::string good = dir.file("good.ckpt");
    adam.save(good);
    const std::string data = read_file(good);
    const std::string flipped = dir.file("flipped.ckpt");
    std::string altered = data;
    altered[data.size() / 2] = static_cast<char>(altered[data.size() / 2] ^ 0x10);
    write_file(flipped, altered);
    CHECK_THROWS_WITH_AS(
        adam.load(flipped),
        doctest::Contains(("'" + flipped + "' is corrupt: its hash does not match").c_str()),
        std::invalid_argument);
    const std::string cut = dir.file("cut.ckpt");
    write_file(cut, data.substr(0, data.size() - 20));
    CHECK_THROWS_WITH_AS(adam.load(cut), doctest::Contains(("'" + cut + "' is corrupt").c_str()),
                         std::invalid_argument);
    write_file(cut, data.substr(0, 22));
    CHECK_THROWS_WITH_AS(adam.load(cut), doctest::Contains(("'" + cut + "' is corrupt").c_str()),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(adam.save(dir.file("no/such/folder/x.ckpt")),
                         doctest::Contains("no/such/folder/x.ckpt"), std::runtime_error);
    // A checkpoint of another kind, from a file.
    const std::string of_sgd = dir.file("sgd.ckpt");
    sgd.save(of_sgd);
    CHECK_THROWS_WITH_AS(adam.load(of_sgd), doctest::Contains("SGD"), std::invalid_argument);
    adam.load(good);  // the good one still loads
    CHECK(adam.lr() == 0.1);

    // The owners still serve: a step moves the parameter.
    const at::Tensor before = L().w[1].detach().clone();
    {
      dist::Context ctx(w[0]);
      at::Tensor y =
          w[0].rpc_sync<at::Tensor>("worker1", "linear", int64_t(1), at::ones({1, 2}, kF64));
      dist::backward(w[0], ctx.id(), {y.sum()});
      CHECK(adam.clip_grad_norm(ctx.id(), 0.5) > 0);
      adam.step(ctx.id());
    }
    CHECK_FALSE(at::equal(L().w[1], before));
  }
  for (int r = 0; r < 3; ++r) CHECK(optim::live_optimizers(w[r]) == 0);
  p1 = p1b = p2 = p1_2x3 = rpc::RRef<at::Tensor>();
  L().w.clear();
  w.shutdown();
}
