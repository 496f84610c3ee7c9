// DistributedOptimizer: a model split over workers and trained with it ends
// with the parameters the unsplit model gets from the same LibTorch
// optimizer; bad input and failures are clear; nothing is left behind.
#include "test_util.h"

#include "optim/optim_support.h"
#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/rpc/rref.h"

using namespace tandem;
using namespace tandem::test::optim_support;
using test::World;
namespace dist = tandem::autograd;

namespace {

std::vector<at::Tensor> fresh_params(int64_t seed) {
  at::manual_seed(seed);
  return {at::randn({4, 5}, kF64).requires_grad_(), at::randn({5, 3}, kF64).requires_grad_()};
}

at::Tensor local_loss(const std::vector<at::Tensor>& w, const at::Tensor& x) {
  return at::tanh(at::mm(at::tanh(at::mm(x, w[0])), w[1])).pow(2).sum();
}

}  // namespace

TEST_CASE("optim: a split model trained with DistributedOptimizer equals local training") {
  World w(3, define);
  for (const auto& c : every_kind()) {
    CAPTURE(optim::kind_name(c.kind));
    // Worker 1 owns W[0], worker 2 owns W[1]; worker 0 drives.
    L().w = fresh_params(7);
    std::vector<at::Tensor> ref;
    for (auto& t : fresh_params(7)) ref.push_back(t.detach().clone().requires_grad_());
    auto local = local_optimizer(c.kind, ref, c.o);
    std::vector<rpc::RRef<at::Tensor>> params = {
        w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(0)),
        w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker2", "param", int64_t(1))};
    {
      optim::DistributedOptimizer opt(w[0], c.kind, params, c.o);
      CHECK(opt.owners() == std::vector<int>{1, 2});
      for (int step = 0; step < 5; ++step) {
        at::manual_seed(100 + step);
        at::Tensor x = at::randn({6, 4}, kF64);
        {
          dist::Context ctx(w[0]);
          at::Tensor h = w[0].rpc_sync<at::Tensor>("worker1", "layer", int64_t(0), x);
          at::Tensor y = w[0].rpc_sync<at::Tensor>("worker2", "layer", int64_t(1), h);
          dist::backward(w[0], ctx.id(), {y.pow(2).sum()});
          opt.step(ctx.id());
        }
        local->zero_grad();
        local_loss(ref, x).backward();
        local->step();
      }
      // .grad is never touched: gradients live in the contexts.
      CHECK_FALSE(L().w[0].grad().defined());
    }
    CHECK(at::allclose(L().w[0], ref[0], 1e-5, 1e-8));
    CHECK(at::allclose(L().w[1], ref[1], 1e-5, 1e-8));
    params.clear();
    for (int r = 0; r < 3; ++r) CHECK(optim::live_optimizers(w[r]) == 0);
  }
  L().w.clear();
  w.shutdown();
}

TEST_CASE("optim: the caller's own parameters step without RPC, and unused ones are left alone") {
  World w(2, define);
  L().w = fresh_params(3);
  at::Tensor before1 = L().w[1].detach().clone();
  std::vector<rpc::RRef<at::Tensor>> params = {
      rpc::RRef<at::Tensor>::make_local(w[0], L().w[0]),
      w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(1))};
  {
    optim::Options o;
    o.lr = 0.5;
    optim::DistributedOptimizer opt(w[0], optim::Kind::kSGD, params, o);
    at::Tensor before0 = L().w[0].detach().clone();
    {
      dist::Context ctx(w[0]);
      // Only W[0] (on worker0) is used; worker1 took part in the context
      // (a call in it), but its W[1] got no gradient.
      at::Tensor x = at::ones({2, 4}, kF64);
      at::Tensor y = at::mm(x, L().w[0]).sum();
      w[0].rpc_sync<at::Tensor>("worker1", "layer", int64_t(1), at::ones({1, 5}, kF64));
      dist::backward(w[0], ctx.id(), {y});
      opt.step(ctx.id());
      at::Tensor g = dist::get_gradients(w[0], ctx.id()).at(L().w[0]);
      CHECK(at::allclose(L().w[0], before0 - 0.5 * g));
    }
    CHECK(at::equal(L().w[1], before1));
    CHECK(optim::live_optimizers(w[0]) == 1);
    CHECK(optim::live_optimizers(w[1]) == 1);
  }
  CHECK(optim::live_optimizers(w[0]) == 0);
  CHECK(optim::live_optimizers(w[1]) == 0);
  params.clear();
  L().w.clear();
  w.shutdown();
}

TEST_CASE("optim: bad input is refused, naming what was wrong") {
  World w(2, define);
  L().w = {at::randn({2, 2}, kF64).requires_grad_(), at::randn({2, 2}, kF64)};  // [1]: no grad
  CHECK_THROWS_AS(optim::DistributedOptimizer(w[0], optim::Kind::kSGD, {}), std::invalid_argument);
  auto good = w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(0));
  auto frozen = w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(1));
  CHECK_THROWS_WITH_AS(optim::DistributedOptimizer(w[0], optim::Kind::kAdam, {good, frozen}),
                       doctest::Contains("not a leaf that requires grad"), rpc::RemoteError);
  CHECK(optim::live_optimizers(w[1]) == 0);
  {
    // Refused on the caller after an owner's creation started: that one is
    // dropped too. (worker1 drives; worker0's part goes first.)
    auto on0 = w[1].rpc_sync<rpc::RRef<at::Tensor>>("worker0", "param", int64_t(0));
    auto frozen_here = rpc::RRef<at::Tensor>::make_local(w[1], L().w[1]);
    CHECK_THROWS_WITH_AS(optim::DistributedOptimizer(w[1], optim::Kind::kSGD, {on0, frozen_here}),
                         doctest::Contains("not a leaf that requires grad"), std::invalid_argument);
    CHECK(optim::live_optimizers(w[0]) == 0);
    CHECK(optim::live_optimizers(w[1]) == 0);
  }
  {
    optim::DistributedOptimizer opt(w[0], optim::Kind::kAdam, {good});
    CHECK_THROWS_AS(opt.step(0), std::invalid_argument);
    // A context the owner never saw: its error reaches the caller, naming the owner.
    dist::Context ctx(w[0]);
    CHECK_THROWS_WITH_AS(opt.step(ctx.id()), doctest::Contains("worker1"), rpc::RemoteError);
  }
  CHECK(optim::live_optimizers(w[1]) == 0);
  {
    // A shard group the owner has no process group of.
    optim::DistributedOptions sharded;
    sharded.shard_group = "nope";
    CHECK_THROWS_WITH_AS(optim::DistributedOptimizer(w[0], optim::Kind::kSGD, {good}, {}, sharded),
                         doctest::Contains("no process group 'nope' on worker1"), rpc::RemoteError);
  }
  CHECK(optim::live_optimizers(w[1]) == 0);
  // The owner keeps serving.
  CHECK(w[0].rpc_sync<at::Tensor>("worker1", "layer", int64_t(0), at::ones({1, 2}, kF64)).numel() ==
        2);
  good = frozen = rpc::RRef<at::Tensor>();
  L().w.clear();
  w.shutdown();
}

TEST_CASE("optim: an optimizer alive at graceful shutdown is reported as a leak") {
  World w(2, define);
  L().w = fresh_params(1);
  auto p = w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(0));
  auto opt = std::make_unique<optim::DistributedOptimizer>(w[0], optim::Kind::kSGD,
                                                           std::vector<rpc::RRef<at::Tensor>>{p});
  p = rpc::RRef<at::Tensor>();
  CHECK_THROWS_WITH_AS(w.shutdown_unchecked(true), doctest::Contains("distributed optimizer"),
                       rpc::ShutdownError);
  opt.reset();  // its agent is gone: dropping it does nothing
  L().w.clear();
}

TEST_CASE("optim: concurrent steps on one owner are serialized, each with its own gradients") {
  // Over one optimizer, and over one optimizer per thread sharing the
  // parameter (trainers stepping a parameter server's table).
  for (bool shared : {true, false}) {
    CAPTURE(shared);
    World w(2, define);
    // Big enough that steps take a while, and would overlap if let.
    L().w = {at::zeros({512, 64}, kF64).requires_grad_()};
    auto p = w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(0));
    optim::Options o;
    o.lr = 1.0;
    constexpr int kThreads = 4, kSteps = 30;
    std::vector<std::unique_ptr<optim::DistributedOptimizer>> opts;
    for (int t = 0; t < (shared ? 1 : kThreads); ++t) {
      opts.push_back(std::make_unique<optim::DistributedOptimizer>(
          w[0], optim::Kind::kSGD, std::vector<rpc::RRef<at::Tensor>>{p}, o));
    }
    // Thread t's loss is sum(x_t @ W) with x_t = (t + 1) everywhere, so its
    // gradient is (t + 1) in every entry whatever W is; plain SGD adds the
    // steps up in any order, but only if no step sees another's gradient.
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        try {
          auto& opt = *opts[shared ? 0 : t];
          for (int s = 0; s < kSteps; ++s) {
            dist::Context ctx(w[0]);
            at::Tensor x = at::full({1, 512}, double(t + 1), kF64);
            auto y = w[0].rpc_sync<at::Tensor>("worker1", "linear", int64_t(0), x);
            dist::backward(w[0], ctx.id(), {y.sum()});
            opt.step(ctx.id());
          }
        } catch (const std::exception& e) {
          ++failures;
          MESSAGE("thread " << t << ": " << e.what());
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(failures == 0);
    // Every step moved W by -(t + 1): -kSteps * (1 + 2 + 3 + 4) in all.
    CHECK(at::equal(L().w[0], at::full({512, 64}, -double(kSteps * 10), kF64)));
    CHECK_FALSE(L().w[0].grad().defined());
    opts.clear();
    p = rpc::RRef<at::Tensor>();
    L().w.clear();
    w.shutdown();
  }
}
