// Distributed autograd across workers in one process: gradients equal local
// LibTorch's, shared subgraphs run once, unused sends never hang, contexts
// run side by side, bad input and failures are reported, and no context is
// left on any worker.
#include "test_util.h"

#include <ATen/Context.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/tanh.h>
#include <torch/csrc/autograd/autograd.h>

#include <atomic>
#include <random>

#include "tandem/autograd/autograd.h"
#include "tandem/autograd/engine.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rref.h"
#include "tests/rpc/frames.h"

using namespace tandem;
using namespace std::chrono_literals;
using test::World;
namespace dist = tandem::autograd;

namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

// The parameters of the test model; the same tensors serve every worker of
// the in-process world and the local reference.
struct Params {
  at::Tensor w0 = at::randn({8, 8}, kF64).requires_grad_();
  at::Tensor w1 = at::randn({8, 6}, kF64).requires_grad_();
  at::Tensor b1 = at::randn({6}, kF64).requires_grad_();
  at::Tensor w2 = at::randn({6, 3}, kF64).requires_grad_();
};
Params& P() {
  static Params p;
  return p;
}

// The model's pieces, called locally for the reference and remotely by name.
at::Tensor lin1(const at::Tensor& x) { return at::tanh(at::mm(x, P().w1) + P().b1); }
at::Tensor lin2(const at::Tensor& x) { return at::sigmoid(at::mm(x, P().w2)); }

at::Tensor mix(const at::Tensor& a, const at::Tensor& b) { return a * b + at::tanh(a) * 0.5; }

// A part the test holds in its backward until it says go.
struct Held {
  std::atomic<bool> entered{false}, released{false};
};
Held& held() {
  static Held h;
  return h;
}

void define(rpc::Registry& r) {
  r.def("lin1", [](at::Tensor x) { return lin1(x); });
  r.def("lin2", [](at::Tensor x) { return lin2(x); });
  r.def("pair", [](at::Tensor a, at::Tensor b) { return a * b + a; });
  r.def("twice", [](at::Tensor a, at::Tensor b) { return a + 2 * b; });
  r.def("scale_by", [](at::Tensor x, at::Tensor w) { return at::mm(x, w); });
  r.def("ignore", [](at::Tensor) { return at::mm(at::ones({2, 8}, kF64), P().w1); });
  // worker1 -> worker2 -> back, made from inside a handler: the context flows.
  r.def("relay", [](at::Tensor x) {
    auto h = lin1(x);
    auto y = rpc::rpc_sync<at::Tensor>("worker2", "lin2", h);
    return y * 2 + h.sum();
  });
  // Two results; callers may use only the first: the second's gradient is None.
  r.def("two_results", [](at::Tensor x) {
    return std::make_tuple(at::mm(at::ones({2, 8}, kF64), P().w1), x * 2);
  });
  r.def("mix", [](at::Tensor a, at::Tensor b) { return mix(a, b); });
  r.def("context_here", []() { return static_cast<int64_t>(dist::current_context_id()); });
  // relay, as a method of an RRef held by worker1 (self is added in).
  r.def("relay_in_method", [](at::Tensor self, at::Tensor x) {
    auto h = lin1(x);
    auto y = rpc::rpc_sync<at::Tensor>("worker2", "lin2", h);
    return y * 2 + h.sum() + self.sum() * 0;
  });
  r.def("context_in_method",
        [](at::Tensor) { return static_cast<int64_t>(dist::current_context_id()); });
  r.def("throw_in_backward", [](at::Tensor x) {
    auto y = x * 3;
    y.register_hook([](at::Tensor) -> at::Tensor { throw std::runtime_error("boom in backward"); });
    return y;
  });
  r.def("held_backward", [](at::Tensor x) {
    auto y = x * 3;
    y.register_hook([](at::Tensor g) {
      Held& h = held();
      h.entered = true;
      // Until the test has looked (bounded: a failing test must not hang).
      for (int i = 0; i < 1000 && !h.released; ++i) std::this_thread::sleep_for(10ms);
      return g;
    });
    return y;
  });
  r.def("slow_backward", [](at::Tensor x) {
    auto y = x * 3;
    y.register_hook([](at::Tensor g) {
      std::this_thread::sleep_for(1500ms);  // a slow part: the thing under test
      return g;
    });
    return y;
  });
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  INFO(what);
  REQUIRE(got.defined());
  REQUIRE(got.sizes() == want.sizes());
  double scale = std::max(1.0, want.abs().max().item<double>());
  CHECK((got - want).abs().max().item<double>() <= 1e-6 * scale);
}

// Local gradients of `loss` for `inputs`.
std::vector<at::Tensor> local_grads(const at::Tensor& loss, const std::vector<at::Tensor>& inputs) {
  return torch::autograd::grad({loss}, inputs, {}, false, false, true);
}

at::Tensor input(int64_t rows = 4) { return at::randn({rows, 8}, kF64).requires_grad_(); }

}  // namespace

TEST_CASE("autograd: a chain over 3 workers equals local autograd") {
  World w(3, define);
  auto x = input();
  {
    dist::Context ctx(w[0]);
    CHECK(dist::current_context_id() == ctx.id());
    CHECK((ctx.id() >> 48) == 0u);
    auto h = w[0].rpc_sync<at::Tensor>("worker1", "lin1", x);
    auto y = w[0].rpc_sync<at::Tensor>("worker2", "lin2", h);
    CHECK(h.requires_grad());
    auto loss = (y * y).sum();
    dist::backward(ctx.id(), {loss});
    auto g0 = dist::get_gradients(ctx.id());
    auto g1 = dist::get_gradients(w[1], ctx.id());
    auto g2 = dist::get_gradients(w[2], ctx.id());
    CHECK(g0.size() == 1);
    CHECK(g1.size() == 2);
    CHECK(g2.size() == 1);
    auto want = local_grads((lin2(lin1(x)).pow(2)).sum(), {x, P().w1, P().b1, P().w2});
    expect_close(g0.at(x), want[0], "x");
    expect_close(g1.at(P().w1), want[1], "w1");
    expect_close(g1.at(P().b1), want[2], "b1");
    expect_close(g2.at(P().w2), want[3], "w2");
    CHECK(!P().w1.grad().defined());  // .grad is never touched
  }
  CHECK(dist::current_context_id() == 0);
  w.shutdown();
}

TEST_CASE("autograd: nested calls carry the context (0 -> 1 -> 2 -> 1 -> 0)") {
  World w(3, define);
  auto x = input();
  {
    dist::Context ctx(w[0]);
    CHECK(w[0].rpc_sync<int64_t>("worker1", "context_here") == static_cast<int64_t>(ctx.id()));
    auto y = w[0].rpc_sync<at::Tensor>("worker1", "relay", x);
    auto loss = y.sum();
    dist::backward(ctx.id(), {loss});
    auto h = lin1(x);
    auto want = local_grads((lin2(h) * 2 + h.sum()).sum(), {x, P().w1, P().b1, P().w2});
    expect_close(dist::get_gradients(ctx.id()).at(x), want[0], "x");
    expect_close(dist::get_gradients(w[1], ctx.id()).at(P().w1), want[1], "w1");
    expect_close(dist::get_gradients(w[1], ctx.id()).at(P().b1), want[2], "b1");
    expect_close(dist::get_gradients(w[2], ctx.id()).at(P().w2), want[3], "w2");
  }
  CHECK(w[0].rpc_sync<int64_t>("worker1", "context_here") == 0);
  w.shutdown();
}

TEST_CASE("autograd: a method on an RRef chains its nested call inside the caller's context") {
  World w(3, define);
  auto x = input();
  auto held = rpc::remote<at::Tensor>(w[0], "worker1", "lin1", x.detach());
  held.to_here();  // ready: the method runs later, on a pool thread of worker1
  {
    dist::Context ctx(w[0]);
    auto y = held.rpc_sync<at::Tensor>("relay_in_method", x);
    dist::backward(ctx.id(), {y.sum()});
    auto h = lin1(x);
    auto want = local_grads((lin2(h) * 2 + h.sum()).sum(), {x, P().w1, P().w2});
    expect_close(dist::get_gradients(ctx.id()).at(x), want[0], "x");
    expect_close(dist::get_gradients(w[1], ctx.id()).at(P().w1), want[1], "w1");
    expect_close(dist::get_gradients(w[2], ctx.id()).at(P().w2), want[2], "w2 (the nested call's)");
  }
  held = rpc::RRef<at::Tensor>();
  w.shutdown();
}

TEST_CASE("autograd: fan-out, fan-in, a tensor sent twice, a parameter on two workers") {
  World w(3, define);
  auto x = input();
  dist::Context ctx(w[0]);
  auto h = at::mm(x, P().w0);                                            // on worker0
  auto a = w[0].rpc_sync<at::Tensor>("worker1", "lin1", h);              // fan-out ...
  auto b = w[0].rpc_sync<at::Tensor>("worker2", "lin1", h);              // ... h sent twice
  auto c = w[0].rpc_sync<at::Tensor>("worker1", "pair", a, b);           // fan-in
  auto d = w[0].rpc_sync<at::Tensor>("worker2", "twice", h, h);          // one message, h twice
  auto e = w[0].rpc_sync<at::Tensor>("worker1", "scale_by", x, P().w0);  // w0 used remotely too
  auto loss = c.sum() + d.pow(2).sum() + (e * h).sum();
  dist::backward(ctx.id(), {loss});

  auto lh = at::mm(x, P().w0);
  auto la = lin1(lh), lb = lin1(lh);
  auto lloss = (la * lb + la).sum() + (lh + 2 * lh).pow(2).sum() + (at::mm(x, P().w0) * lh).sum();
  auto want = local_grads(lloss, {x, P().w0, P().w1, P().b1});
  auto g0 = dist::get_gradients(ctx.id());
  expect_close(g0.at(x), want[0], "x");
  expect_close(g0.at(P().w0), want[1], "w0: local use plus the copy sent to worker1");
  // lin1 ran on worker1 and worker2, both with w1: each holds its share.
  auto g1 = dist::get_gradients(w[1], ctx.id());
  auto g2 = dist::get_gradients(w[2], ctx.id());
  expect_close(g1.at(P().w1) + g2.at(P().w1), want[2], "w1 (summed over workers)");
  expect_close(g1.at(P().b1) + g2.at(P().b1), want[3], "b1 (summed over workers)");
}

TEST_CASE("autograd: A -> B -> A runs the shared subgraph once") {
  World w(2, define);
  auto x = input();
  dist::Context ctx(w[0]);
  std::atomic<int> runs{0};
  auto h = at::mm(x, P().w0);
  h.register_hook([&](at::Tensor g) {
    ++runs;
    return g;
  });
  auto y = w[0].rpc_sync<at::Tensor>("worker1", "lin1", h);
  auto loss = (y * h.narrow(1, 0, 6)).sum() + h.sum();
  dist::backward(ctx.id(), {loss});
  CHECK(runs == 1);  // PyTorch's fast mode runs it once per incoming gradient
  auto lh = at::mm(x, P().w0);
  auto want = local_grads((lin1(lh) * lh.narrow(1, 0, 6)).sum() + lh.sum(), {x, P().w0, P().w1});
  expect_close(dist::get_gradients(ctx.id()).at(x), want[0], "x");
  expect_close(dist::get_gradients(ctx.id()).at(P().w0), want[1], "w0");
  expect_close(dist::get_gradients(w[1], ctx.id()).at(P().w1), want[2], "w1");
}

TEST_CASE("autograd: a tensor sent and never used by the loss does not hang") {
  World w(2, define);
  auto x = input(2);
  dist::Context ctx(w[0]);
  auto h = at::mm(x, P().w0);
  auto unused = w[0].rpc_sync<at::Tensor>("worker1", "ignore", h);  // result ignores h
  auto dropped = w[0].rpc_sync<at::Tensor>("worker1", "lin1", h);   // result never used
  CHECK(unused.requires_grad());
  auto t0 = std::chrono::steady_clock::now();
  dist::backward(ctx.id(), {(h * 3).sum() + unused.sum()});
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  auto lh = at::mm(x, P().w0);
  auto lu = at::mm(at::ones({2, 8}, kF64), P().w1);
  auto want = local_grads((lh * 3).sum() + lu.sum(), {x, P().w1});
  expect_close(dist::get_gradients(ctx.id()).at(x), want[0], "x");
  auto g1 = dist::get_gradients(w[1], ctx.id());
  expect_close(g1.at(P().w1), want[1], "w1 through the unused-input function");
  CHECK(!g1.contains(P().b1));  // lin1's result was dropped: b1 got nothing
}

TEST_CASE("autograd: a result the loss ignores sends None back, not an error") {
  World w(2, define);
  auto x = input(2);
  dist::Context ctx(w[0]);
  auto [a, b] = w[0].rpc_sync<std::tuple<at::Tensor, at::Tensor>>("worker1", "two_results", x);
  CHECK(b.requires_grad());
  dist::backward(ctx.id(), {a.sum() + x.sum()});
  auto want = local_grads(at::mm(at::ones({2, 8}, kF64), P().w1).sum(), {P().w1});
  expect_close(dist::get_gradients(w[1], ctx.id()).at(P().w1), want[0], "w1");
  expect_close(dist::get_gradients(ctx.id()).at(x), at::ones_like(x), "x: only its local use");
}

TEST_CASE("autograd: random graphs over 3 workers equal local autograd") {
  // Each graph: a pool of tensors that grows by local ops on worker0 and by
  // remote ops on worker1/2 (some through a nested call), with tensors used
  // several times, sent twice, or never used by the loss. The same ops run
  // locally on copies; every worker's gradients must match.
  World w(3, define);
  for (int seed = 0; seed < 25; ++seed) {
    INFO("seed " << seed);
    std::mt19937 rng(seed);
    auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
    auto x = input(4).narrow(1, 0, 6).contiguous().detach().requires_grad_();
    std::vector<at::Tensor> dp = {x}, lp = {x};  // distributed, local
    dist::Context ctx(w[0]);
    for (int step = 0; step < 10; ++step) {
      size_t a = pick(dp.size()), b = pick(dp.size());
      switch (rng() % 4) {
        case 0:  // local, on worker0
          dp.push_back(mix(dp[a], dp[b]));
          lp.push_back(mix(lp[a], lp[b]));
          break;
        case 1:
        case 2: {  // remote
          std::string to = rng() % 2 ? "worker1" : "worker2";
          dp.push_back(w[0].rpc_sync<at::Tensor>(to, "mix", dp[a], dp[b]));
          lp.push_back(mix(lp[a], lp[b]));
          break;
        }
        default: {  // 0 -> 1 -> 2 -> 1 -> 0, through the same weights
          auto in = at::mm(dp[a], P().w1.t());
          auto lin = at::mm(lp[a], P().w1.t());
          auto out = w[0].rpc_sync<at::Tensor>("worker1", "relay", in);
          auto h = lin1(lin);
          auto lout = lin2(h) * 2 + h.sum();
          // back to the pool's shape
          dp.push_back(at::mm(out, P().w2.t()).mul(dp[b]));
          lp.push_back(at::mm(lout, P().w2.t()).mul(lp[b]));
          break;
        }
      }
    }
    // The loss uses some of the pool, always the newest tensor.
    at::Tensor loss = dp.back().sum(), lloss = lp.back().sum();
    for (size_t i = 0; i + 1 < dp.size(); ++i) {
      if (rng() % 3 == 0) {
        loss = loss + dp[i].pow(2).sum();
        lloss = lloss + lp[i].pow(2).sum();
      }
    }
    dist::backward(ctx.id(), {loss});
    auto want = local_grads(lloss, {x, P().w1, P().b1, P().w2});
    auto g0 = dist::get_gradients(ctx.id());
    auto g1 = dist::get_gradients(w[1], ctx.id());
    auto g2 = dist::get_gradients(w[2], ctx.id());
    auto sum_of = [&](const at::Tensor& p) {
      at::Tensor total = at::zeros_like(p);
      for (auto* g : {&g0, &g1, &g2}) {
        if (g->contains(p)) total = total + g->at(p);
      }
      return total;
    };
    expect_close(g0.at(x), want[0], "x");
    for (size_t i = 1; i < want.size(); ++i) {
      auto p = std::vector<at::Tensor>{P().w1, P().b1, P().w2}[i - 1];
      expect_close(sum_of(p), want[i].defined() ? want[i] : at::zeros_like(p), "a weight");
    }
  }
  w.shutdown();
}

TEST_CASE("autograd: RRefs: remote() and to_here() inside a context") {
  World w(2, define);
  auto x = input();
  {
    dist::Context ctx(w[0]);
    auto r = rpc::remote<at::Tensor>(w[0], "worker1", "lin1", x);
    auto y = r.to_here();
    auto z = r.rpc_sync<at::Tensor>("pair", y);
    // A method on the RRef runs in the caller's context, as a handler does
    // (it runs on a pool thread once the value is ready).
    CHECK(r.rpc_sync<int64_t>("context_in_method") == static_cast<int64_t>(ctx.id()));
    dist::backward(ctx.id(), {(y.sum() + z.sum())});
    auto ly = lin1(x);
    auto want = local_grads(ly.sum() + (ly * ly + ly).sum(), {x, P().w1});
    expect_close(dist::get_gradients(ctx.id()).at(x), want[0], "x");
    expect_close(dist::get_gradients(w[1], ctx.id()).at(P().w1), want[1], "w1");
  }
  w.shutdown();
}

TEST_CASE("autograd: gradients accumulate per context and retain_graph keeps the graph") {
  World w(2, define);
  auto x = input();
  dist::Context ctx(w[0]);
  auto y = w[0].rpc_sync<at::Tensor>("worker1", "lin1", x);
  auto loss = y.sum();
  dist::backward(ctx.id(), {loss}, /*retain_graph=*/true);
  auto first = dist::get_gradients(ctx.id()).at(x).clone();
  dist::backward(ctx.id(), {loss});
  expect_close(dist::get_gradients(ctx.id()).at(x), first * 2, "accumulated twice");
  // The graph is freed now: a third pass fails with LibTorch's own words.
  CHECK_THROWS_WITH(dist::backward(ctx.id(), {loss}), doctest::Contains("second time"));
}

TEST_CASE("autograd: get_gradients hands out the context's own tensors (in-place changes stay)") {
  // DistributedOptimizer::clip_grad_norm scales the gradients in place and
  // relies on the next get_gradients (and the optimizer's step) seeing it.
  World w(2, define);
  auto x = input();
  dist::Context ctx(w[0]);
  dist::backward(ctx.id(), {w[0].rpc_sync<at::Tensor>("worker1", "lin1", x).sum()});
  auto on1 = dist::get_gradients(w[1], ctx.id());
  REQUIRE(on1.contains(P().w1));
  const at::Tensor before = on1.at(P().w1).clone();
  on1.at(P().w1).mul_(0.5);
  CHECK(at::equal(dist::get_gradients(w[1], ctx.id()).at(P().w1), before * 0.5));
  // The root's leaf too.
  const at::Tensor gx = dist::get_gradients(ctx.id()).at(x).clone();
  dist::get_gradients(ctx.id()).at(x).zero_();
  CHECK(at::equal(dist::get_gradients(ctx.id()).at(x), at::zeros_like(gx)));
}

TEST_CASE("autograd: several contexts at once from several threads and workers") {
  World w(3, define);
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      rpc::Agent& me = w[t % 2];  // threads on worker0 and worker1
      const std::string other = t % 2 == 0 ? "worker1" : "worker2";
      for (int iter = 0; iter < 5; ++iter) {
        auto x = input(1 + t);
        dist::Context ctx(me);
        auto h = me.rpc_sync<at::Tensor>(other, "lin1", x);
        auto y = me.rpc_sync<at::Tensor>(t % 2 == 0 ? "worker2" : "worker0", "lin2", h);
        dist::backward(ctx.id(), {y.sum() * (t + 1)});
        auto want = local_grads(lin2(lin1(x)).sum() * (t + 1), {x});
        auto got = dist::get_gradients(me, ctx.id()).at(x);
        if ((got - want[0]).abs().max().item<double>() < 1e-9) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(ok == 30);
  w.shutdown();
}

TEST_CASE("autograd: a context's release reaches every worker without the caller waiting") {
  World w(3, define);
  {
    dist::Context ctx(w[0]);
    auto h = w[0].rpc_sync<at::Tensor>("worker1", "lin1", input());
    auto y = w[0].rpc_sync<at::Tensor>("worker2", "lin2", h);
    dist::backward(ctx.id(), {y.sum()});
    CHECK(dist::live_contexts(w[1]) == 1);
    CHECK(dist::live_contexts(w[2]) == 1);
  }
  CHECK(dist::live_contexts(w[0]) == 0);  // here at once
  auto gone = [&] { return dist::live_contexts(w[1]) == 0 && dist::live_contexts(w[2]) == 0; };
  for (int i = 0; i < 500 && !gone(); ++i) std::this_thread::sleep_for(10ms);
  CHECK(gone());
  w.shutdown();  // graceful: nothing reported leaked
}

TEST_CASE("autograd: outside a context nothing is recorded") {
  World w(2, define);
  auto x = input();
  auto y = w[0].rpc_sync<at::Tensor>("worker1", "lin1", x);
  // As in PyTorch: the result requires grad, as a new leaf with no history.
  CHECK(y.requires_grad());
  CHECK(y.is_leaf());
  CHECK(!y.grad_fn());
  CHECK(w[0].rpc_sync<int64_t>("worker1", "context_here") == 0);
  CHECK(dist::live_contexts(w[0]) == 0);
  CHECK(dist::live_contexts(w[1]) == 0);
}

TEST_CASE("autograd: bad arguments are refused with clear errors") {
  World w(2, define);
  dist::Context ctx(w[0]);
  CHECK_THROWS_WITH_AS([&] { dist::Context inner(w[0]); }(), doctest::Contains("do not nest"),
                       std::logic_error);
  auto x = input();
  auto y = w[0].rpc_sync<at::Tensor>("worker1", "lin1", x);
  CHECK_THROWS_WITH_AS(dist::backward(ctx.id(), {y}), doctest::Contains("roots must be scalars"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(dist::backward(ctx.id(), {at::ones({1})}),
                       doctest::Contains("does not require grad"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(dist::backward(ctx.id(), {}), doctest::Contains("at least one root"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(dist::backward(w[0], ctx.id() + 999, {y.sum()}),
                       doctest::Contains("no distributed autograd context"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(dist::get_gradients(w[1], 12345), doctest::Contains("12345"),
                       std::invalid_argument);
  // LibTorch's own backward through a received tensor says what to use instead.
  CHECK_THROWS_WITH(y.sum().backward(), doctest::Contains("tandem::autograd::backward"));
  // The failed attempts left the context usable.
  dist::backward(ctx.id(), {y.sum()});
  CHECK(dist::get_gradients(ctx.id()).contains(x));
}

TEST_CASE("autograd: an exception in a worker's part reaches the caller, naming it") {
  World w(3, define);
  auto x = input();
  {
    dist::Context ctx(w[0]);
    auto a = w[0].rpc_sync<at::Tensor>("worker1", "throw_in_backward", x);
    auto b = w[0].rpc_sync<at::Tensor>("worker2", "lin1", x);
    try {
      dist::backward(ctx.id(), {a.sum() + b.sum()});
      FAIL("backward did not throw");
    } catch (const rpc::RemoteError& e) {
      CHECK(e.worker() == "worker1");
      CHECK(std::string(e.what()).find("boom in backward") != std::string::npos);
    }
  }
  w.shutdown();
}

TEST_CASE("autograd: a part slower than the timeout fails backward with TimeoutError") {
  World w(2, define);
  auto x = input();
  {
    dist::Context ctx(w[0]);
    auto a = w[0].rpc_sync<at::Tensor>("worker1", "slow_backward", x);
    auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(dist::backward(w[0], ctx.id(), {a.sum()}, false, 300ms), rpc::TimeoutError);
    CHECK(std::chrono::steady_clock::now() - t0 < 1200ms);
  }
  w.shutdown();
}

TEST_CASE("autograd: engine requests from a peer are checked") {
  World w(2, define);
  auto run = [&](int64_t ctx, int64_t root, std::vector<int64_t> sends) {
    return w[0]
        .call("worker1", "tandem.autograd.run",
              {ctx, int64_t(1), root, false, int64_t(1000), c10::List<int64_t>(sends)})
        .wait();
  };
  CHECK_THROWS_WITH_AS(run(424242, 0, {1}), doctest::Contains("no distributed autograd context"),
                       rpc::RemoteError);
  CHECK_THROWS_WITH_AS(run(424242, 7, {1}), doctest::Contains("unknown root rank 7"),
                       rpc::RemoteError);
  {
    dist::Context ctx(w[0]);
    auto y = w[0].rpc_sync<at::Tensor>("worker1", "lin1", input());
    // worker1 has this context now, but no send 99 in it.
    CHECK_THROWS_WITH_AS(run(static_cast<int64_t>(ctx.id()), 0, {(int64_t(1) << 48) | 99}),
                         doctest::Contains("is not recorded on worker1"), rpc::RemoteError);
    // A malformed gradient (one way, so nobody answers) is dropped; worker1 goes on.
    rpc::layer::notify(w[0], "worker1", "tandem.autograd.grad", {std::string("not a context")});
    rpc::layer::notify(w[0], "worker1", "tandem.autograd.grad",
                       {int64_t(ctx.id()), int64_t(5), int64_t(6), std::string("not a tuple")});
    rpc::layer::notify(w[0], "worker1", "tandem.autograd.grad",
                       {int64_t(ctx.id()), int64_t(5), int64_t(6), c10::ivalue::Tuple::create({}),
                        std::string("half a pair")});
    rpc::layer::notify(w[0], "worker1", "tandem.autograd.grad",
                       {int64_t(ctx.id()), int64_t(5), int64_t((int64_t(1) << 48) | 98),
                        c10::ivalue::Tuple::create({at::ones({2})})});
    dist::backward(ctx.id(), {y.sum()});
    CHECK(dist::get_gradients(w[1], ctx.id()).contains(P().w1));
  }
  w.shutdown();
}

TEST_CASE("autograd: a context that outlives its agent is released without harm") {
  auto w = std::make_unique<World>(2, define);
  auto ctx = std::make_unique<dist::Context>((*w)[0]);
  auto y = (*w)[0].rpc_sync<at::Tensor>("worker1", "lin1", input());
  const uint64_t id = ctx->id();
  w->shutdown(false);
  w.reset();  // the agents are gone
  CHECK_THROWS_AS(dist::backward(id, {y.sum()}), rpc::ShutdownError);
  ctx.reset();  // nothing to release, nothing touched
  CHECK(dist::current_context_id() == 0);
}

TEST_CASE("autograd: malformed autograd metadata is a protocol error") {
  rpc::Message m;
  m.kind = rpc::MessageKind::kRequest;
  m.callee = "f";
  m.autograd_message = 7;  // a recorded message outside any context
  rpc::FrameDecoder d(rpc::Limits{});
  std::string bytes = test::frame_bytes(rpc::encode(m));
  CHECK_THROWS_WITH_AS(d.feed(bytes.data(), bytes.size()), doctest::Contains("outside any context"),
                       rpc::ProtocolError);
  // An integer tensor flagged as requiring grad.
  std::string raw = test::raw_frame(
      [](rpc::schema::Envelope::Builder env) {
        env.setAutogradContext(1);
        env.setAutogradMessage(1);
        auto t = env.initTensors(1)[0];
        t.setDtype(static_cast<int16_t>(at::kLong));
        t.initSizes(1).set(0, 1);
        t.initStrides(1).set(0, 1);
        t.setByteLength(8);
        t.setRequiresGrad(true);
      },
      8, std::string(8, '\0'));
  rpc::FrameDecoder d2(rpc::Limits{});
  CHECK_THROWS_WITH_AS(d2.feed(raw.data(), raw.size()), doctest::Contains("not differentiable"),
                       rpc::ProtocolError);
}

TEST_CASE("autograd: CUDA tensors: gradients come back to the device") {
  if (!test::cuda_or_skip()) return;
  World w(2, define);
  auto x = at::randn({4, 8}, kF64.device(at::kCUDA)).requires_grad_();
  dist::Context ctx(w[0]);
  auto h = x * 2;  // on the GPU
  // Sent through host memory, asked for (a CUDA tensor without a device
  // map is refused), and computed on worker1's CPU.
  auto y = w[0].rpc_sync<at::Tensor>("worker1", "lin1", h.cpu());
  auto loss = (y.to(at::kCUDA) * 3).sum() + h.sum();
  dist::backward(ctx.id(), {loss});
  auto g = dist::get_gradients(ctx.id()).at(x);
  CHECK(g.device().is_cuda());
  auto xl = x.detach().cpu().requires_grad_();
  auto want = local_grads((lin1(xl * 2) * 3).sum() + (xl * 2).sum(), {xl});
  expect_close(g.cpu(), want[0], "x on the GPU");
}

TEST_CASE("autograd: CUDA tensors through a device map: the gradients come back on the GPU") {
  if (!test::cuda_or_skip()) return;
  World w(2, define, [](rpc::AgentOptions& o) {
    if (o.rank == 0) o.set_device_map("worker1", {{0, 0}});
  });
  auto a = at::randn({4, 8}, kF64.device(at::kCUDA)).requires_grad_();
  auto b = at::randn({4, 8}, kF64.device(at::kCUDA)).requires_grad_();
  dist::Context ctx(w[0]);
  // a * b + a, computed on worker1's GPU; its gradients travel back by the
  // inverse of worker0's map.
  auto y = w[0].rpc_sync<at::Tensor>("worker1", "pair", a, b);
  CHECK(y.is_cuda());
  dist::backward(ctx.id(), {(y * 3).sum()});
  auto grads = dist::get_gradients(ctx.id());
  CHECK(grads.at(a).is_cuda());
  CHECK(grads.at(b).is_cuda());
  auto al = a.detach().cpu().requires_grad_(), bl = b.detach().cpu().requires_grad_();
  auto want = local_grads(((al * bl + al) * 3).sum(), {al, bl});
  expect_close(grads.at(a).cpu(), want[0], "a on the GPU");
  expect_close(grads.at(b).cpu(), want[1], "b on the GPU");
}

TEST_CASE("autograd: debug_info says where a backward waits") {
  World w(3, define);
  auto x = input();
  {
    dist::Context ctx(w[0]);
    const std::string id = std::to_string(ctx.id());
    auto a = w[0].rpc_sync<at::Tensor>("worker1", "held_backward", x);
    auto b = w[0].rpc_sync<at::Tensor>("worker2", "lin1", x);
    std::thread backward([&] { dist::backward(w[0], ctx.id(), {a.sum() + b.sum()}); });
    REQUIRE(test::eventually([] { return held().entered.load(); }));
    // The root waits for worker1's gradient and part; worker2's come back.
    const std::string waiting = "waiting for gradients from worker1 (message(s) ";
    CHECK(test::eventually([&] {
      const std::string root = w[0].debug_info();
      return root.find("waiting for gradients from worker2") == std::string::npos &&
             root.find("parts not done on worker1\n") != std::string::npos;
    }));
    const std::string root = w[0].debug_info(), part = w[1].debug_info();
    INFO(root);
    INFO(part);
    CHECK(root.find("backward of context " + id + " (task ") != std::string::npos);
    CHECK(root.find(", root worker0), ") != std::string::npos);
    CHECK(root.find(waiting) != std::string::npos);
    // worker1 is running its nodes (the held hook) and has its input's left.
    CHECK(part.find("backward of context " + id) != std::string::npos);
    CHECK(part.find("0 ready, running") != std::string::npos);
    CHECK(w[2].debug_info().find("backward of context") == std::string::npos);  // done there
    held().released = true;
    backward.join();
    CHECK(w[0].debug_info().find("backward of context") == std::string::npos);
    CHECK(w[1].debug_info().find("backward of context") == std::string::npos);
  }
  w.shutdown();
}

TEST_CASE("autograd: metrics count contexts, backward passes, parts and gradients") {
  World w(3, define);
  auto x = input();
  auto layer = [&](int r, const std::string& name) {
    auto m = w[r].metrics().layers;
    return m.count(name) ? m.at(name) : int64_t(-1);
  };
  {
    dist::Context ctx(w[0]);
    auto y = w[0].rpc_sync<at::Tensor>("worker1", "lin1", x);
    CHECK(layer(0, "autograd.contexts") == 1);
    CHECK(layer(1, "autograd.contexts") == 1);
    dist::backward(w[0], ctx.id(), {y.sum()});
    dist::backward(w[0], ctx.id(), {(x * 2).sum()});  // a pass with no other part
    CHECK(layer(0, "autograd.backward_passes") == 2);
    CHECK(layer(0, "autograd.backward_parts") == 2);
    CHECK(layer(1, "autograd.backward_passes") == 0);
    CHECK(layer(1, "autograd.backward_parts") == 1);
    CHECK(layer(2, "autograd.backward_parts") == 0);
    // y's gradient went to worker1, x's came back.
    CHECK(layer(1, "autograd.gradients_received") == 1);
    CHECK(layer(0, "autograd.gradients_received") == 1);
  }
  CHECK(test::eventually(
      [&] { return layer(0, "autograd.contexts") == 0 && layer(1, "autograd.contexts") == 0; }));
  w.shutdown();
}
