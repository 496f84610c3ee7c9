// The seams between features, where an outside user found bugs: callbacks
// chained inside handlers and autograd contexts, the convenience API after
// shutdown began, gradients looked up for tensors that got none, leak
// reports, and LibTorch hooks on leaves.
#include "test_util.h"

#include <ATen/ops/sum.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <condition_variable>
#include <mutex>

#include "tandem/autograd/autograd.h"
#include "tandem/autograd/pass.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/transport/faulty/faulty_transport.h"

using namespace tandem;
using namespace std::chrono_literals;
using test::World;
namespace dist = tandem::autograd;

namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

// Set by a callback that ran on another thread: how long its nested call
// took to fail (-1: it did not fail).
struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool set = false;
  int64_t ms = 0;
  void put(int64_t v) {
    std::lock_guard<std::mutex> lock(mu);
    set = true;
    ms = v;
    cv.notify_all();
  }
  int64_t get(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, limit, [&] { return set; }));
    return ms;
  }
};
Outcome& deadline_outcome() {
  static Outcome o;
  return o;
}

void define(rpc::Registry& r) {
  r.def("scale", [](at::Tensor t, double s) { return t * s; });
  r.def("sleep_ms", [](int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));  // slow work
    return ms;
  });
  // Exactly the README's pattern: a handler that chains its second call in a
  // then() callback.
  r.def("chain", [](at::Tensor t) {
    auto agent = rpc::current_agent();
    return agent->rpc_async<at::Tensor>("worker2", "scale", t, 2)
        .then([agent](rpc::Future<at::Tensor> r) {
          return agent->rpc_async<at::Tensor>("worker2", "scale", r.wait(), 3);
        });
  });
  // The same with the convenience API inside the callback.
  r.def("chain_api", [](at::Tensor t) {
    return rpc::rpc_async<at::Tensor>("worker1", "scale", t, 2).then([](rpc::Future<at::Tensor> r) {
      return rpc::rpc_async<at::Tensor>("worker1", "scale", r.wait(), 3);
    });
  });
  // A callback's call inherits what is left of the handler's deadline.
  r.def("chain_slow", []() {
    return rpc::rpc_async<int64_t>("worker2", "sleep_ms", 1).then([](rpc::Future<int64_t>) {
      auto t0 = std::chrono::steady_clock::now();
      try {
        rpc::rpc_sync<int64_t>("worker2", "sleep_ms", 1500);
        deadline_outcome().put(-1);
      } catch (const rpc::TimeoutError&) {
        deadline_outcome().put(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now() - t0)
                                   .count());
        // The caller's own deadline is the same instant, give or take the
        // trip here: an answer sent now could beat its timeout (over a
        // shared-memory ring it takes microseconds), so answer late.
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
      }
      return int64_t(0);
    });
  });
}

// Counts the calls of a post-hook and keeps the last gradient it saw.
struct CountingPostHook : torch::autograd::FunctionPostHook {
  explicit CountingPostHook(std::shared_ptr<std::vector<at::Tensor>> seen)
      : seen(std::move(seen)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    seen->push_back(inputs.at(0).clone());
    return outputs;
  }
  std::shared_ptr<std::vector<at::Tensor>> seen;
};

}  // namespace

TEST_CASE("seams: a handler that chains with then() records both calls (README pattern)") {
  World w(3, define);
  auto x = at::arange(1, 5, kF64).requires_grad_();
  {
    dist::Context ctx(w[0]);
    auto y = w[0].rpc_sync<at::Tensor>("worker1", "chain", x);
    CHECK(at::allclose(y, x * 6));
    dist::backward(ctx.id(), {at::sum(y) + at::sum(x)});
    // Local autograd: d/dx (sum(3 * (2 * x)) + sum(x)) = 7.
    auto want = torch::autograd::grad({at::sum(x * 2 * 3) + at::sum(x)}, {x})[0];
    CHECK(at::allclose(want, at::full_like(x, 7)));
    CHECK(at::allclose(dist::get_gradients(ctx.id()).at(x), want));
  }
  w.shutdown();
}

TEST_CASE("seams: then() attached inside a Context runs its calls in that context") {
  World w(2, define);
  auto x = at::arange(1, 5, kF64).requires_grad_();
  {
    dist::Context ctx(w[0]);
    auto y = w[0].rpc_async<at::Tensor>("worker1", "scale", x, 2)
                 .then([&](rpc::Future<at::Tensor> r) {
                   CHECK(dist::current_context_id() == ctx.id());
                   return w[0].rpc_async<at::Tensor>("worker1", "scale", r.wait(), 3);
                 })
                 .wait();
    dist::backward(ctx.id(), {at::sum(y)});
    CHECK(at::allclose(dist::get_gradients(ctx.id()).at(x), at::full_like(x, 6)));
  }
  // Outside the context a callback has none.
  auto none = w[0].rpc_async<at::Tensor>("worker1", "scale", x, 2)
                  .then([](rpc::Future<at::Tensor>) { return int64_t(dist::current_context_id()); })
                  .wait();
  CHECK(none == 0);
  w.shutdown();
}

TEST_CASE("seams: a callback's calls inherit the handler's remaining deadline") {
  World w(3, define);
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(w[0].rpc_sync(rpc::CallOptions{400ms}, "worker1", "chain_slow"),
                  rpc::TimeoutError);
  // The callback's own call (1500 ms of work; the agents' default timeout is
  // 20 s) gave up when the caller's 400 ms were spent.
  int64_t ms = deadline_outcome().get(5s);
  CHECK(ms >= 0);  // it timed out: without the inherited deadline it succeeds after 1500 ms
  CHECK(ms < 1400);
  CHECK(std::chrono::steady_clock::now() - t0 < 1500ms);
  w.shutdown();
}

TEST_CASE("seams: the convenience API inside a callback after rpc::shutdown() began") {
  const int port = support::free_port();  // worker0's init() hosts the store there
  auto reg = std::make_shared<rpc::Registry>();
  define(*reg);
  rpc::AgentOptions o;
  o.world_size = 2;
  o.num_worker_threads = 2;
  o.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  o.rpc_timeout = 20s;
  // worker0 is this process's init() agent; worker1 another agent beside it.
  std::shared_ptr<rpc::Agent> w1;
  std::thread second([&] {
    rpc::AgentOptions o1 = o;
    o1.rank = 1;
    w1 = rpc::Agent::create(o1, reg);
  });
  rpc::AgentOptions o0 = o;
  o0.rank = 0;
  rpc::init(reg, o0);
  second.join();
  REQUIRE(w1);
  // worker0 enters a graceful shutdown: the global agent is cleared, and it
  // serves until worker1 leaves too.
  std::exception_ptr shutdown_error;
  std::thread closing([&] {
    try {
      rpc::shutdown();
    } catch (...) {
      shutdown_error = std::current_exception();
    }
  });
  REQUIRE(test::eventually([] { return !rpc::is_initialized(); }));
  // Its handler chains with rpc::rpc_async in a callback: that acts on worker0.
  auto t = at::arange(1, 4, kF64);
  CHECK(at::allclose(w1->rpc_sync<at::Tensor>("worker0", "chain_api", t), t * 6));
  w1->shutdown();
  closing.join();
  CHECK(!shutdown_error);
  w1.reset();
}

TEST_CASE("seams: a tensor with no gradient in a context is named in the error") {
  World w(2, define);
  auto x = at::arange(1, 4, kF64).requires_grad_();
  auto unused = at::ones({3}, kF64).requires_grad_();
  {
    dist::Context ctx(w[0]);
    auto y = w[0].rpc_sync<at::Tensor>("worker1", "scale", x, 2);
    dist::backward(ctx.id(), {at::sum(y)});
    auto grads = dist::get_gradients(ctx.id());
    CHECK(grads.size() == 1);
    CHECK(grads.contains(x));
    CHECK_FALSE(grads.contains(unused));
    const std::string want =
        "get_gradients(" + std::to_string(ctx.id()) + ") on worker0: this tensor got no gradient";
    CHECK_THROWS_WITH_AS(grads.at(unused), doctest::Contains(want.c_str()), std::out_of_range);
    CHECK(at::allclose(grads.at(x), at::full_like(x, 2)));
  }
  w.shutdown();
}

TEST_CASE("seams: AccumulateGrad post-hooks run with the leaf's gradient") {
  World w(2, define);
  auto x = at::arange(1, 4, kF64).requires_grad_();
  auto seen = std::make_shared<std::vector<at::Tensor>>();
  auto acc = torch::autograd::impl::grad_accumulator(x);
  acc->add_post_hook(std::make_unique<CountingPostHook>(seen));
  {
    dist::Context ctx(w[0]);
    auto y = w[0].rpc_sync<at::Tensor>("worker1", "scale", x, 5);
    dist::backward(ctx.id(), {at::sum(y) + at::sum(x)});
    REQUIRE(seen->size() == 1);
    CHECK(at::allclose(seen->at(0), at::full_like(x, 6)));
    CHECK(at::allclose(dist::get_gradients(ctx.id()).at(x), at::full_like(x, 6)));
  }
  CHECK(!x.grad().defined());
  w.shutdown();
}

// A post-hook that does what DDP's hybrid mode does with the pass: replaces
// the context's gradient and queues a part-end callback.
struct PassHook : torch::autograd::FunctionPostHook {
  struct Seen {
    bool active = false;
    uint64_t context = 0, context_at_end = 0;
    at::Tensor gradient;
    int ends = 0;
    bool throw_at_end = false;
  };
  PassHook(at::Tensor leaf, std::shared_ptr<Seen> seen)
      : leaf(std::move(leaf)), seen(std::move(seen)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    seen->active = dist::pass::active();
    seen->context = dist::pass::context_id();
    seen->gradient = dist::pass::gradient(leaf).clone();
    auto s = seen;
    auto l = leaf;
    dist::pass::on_part_done([s, l] {
      ++s->ends;
      s->context_at_end = dist::pass::context_id();
      dist::pass::set_gradient(l, dist::pass::gradient(l) * 10);
      if (s->throw_at_end) throw std::runtime_error("part-end callback failed");
    });
    return outputs;
  }
  at::Tensor leaf;
  std::shared_ptr<Seen> seen;
};

TEST_CASE(
    "seams: a leaf hook reads and replaces the context's gradient and runs at the part's end") {
  World w(2, define);
  auto x = at::arange(1, 4, kF64).requires_grad_();
  auto seen = std::make_shared<PassHook::Seen>();
  auto acc = torch::autograd::impl::grad_accumulator(x);
  auto key = acc->add_post_hook(std::make_unique<PassHook>(x, seen));
  CHECK_FALSE(dist::pass::active());
  CHECK_THROWS_AS(dist::pass::context_id(), std::logic_error);
  CHECK_THROWS_AS(dist::pass::on_part_done([] {}), std::logic_error);
  {
    dist::Context ctx(w[0]);
    auto y = w[0].rpc_sync<at::Tensor>("worker1", "scale", x, 5);
    dist::backward(ctx.id(), {at::sum(y)});
    CHECK(seen->active);
    CHECK(seen->context == ctx.id());
    CHECK(at::allclose(seen->gradient, at::full_like(x, 5)));
    CHECK(seen->ends == 1);
    CHECK(seen->context_at_end == ctx.id());
    // Replaced before backward() returned.
    CHECK(at::allclose(dist::get_gradients(ctx.id()).at(x), at::full_like(x, 50)));
  }
  {
    seen->throw_at_end = true;
    dist::Context ctx(w[0]);
    auto y = w[0].rpc_sync<at::Tensor>("worker1", "scale", x, 5);
    std::string err;
    try {
      dist::backward(ctx.id(), {at::sum(y)});
    } catch (const std::exception& e) {
      err = e.what();
    }
    CHECK(err.find("part-end callback failed") != std::string::npos);
  }
  acc->del_post_hook(key);
  w.shutdown();
}

TEST_CASE("seams: graceful shutdown reports live autograd contexts as leaks, on every worker") {
  auto w = std::make_unique<World>(2, define);
  auto x = at::arange(1, 4, kF64).requires_grad_();
  auto ctx = std::make_unique<dist::Context>((*w)[0]);
  const std::string id = std::to_string(ctx->id());
  (*w)[0].rpc_sync<at::Tensor>("worker1", "scale", x, 2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        w->agents[r]->shutdown(true);
      } catch (const rpc::ShutdownError& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO("worker" << r << ": " << errors[r]);
    CHECK(errors[r].find("leaks") != std::string::npos);
    CHECK(errors[r].find("distributed autograd context " + id) != std::string::npos);
  }
  w->agents.clear();
  w.reset();
  ctx.reset();  // its agent is gone: nothing to release
}

TEST_CASE("seams: a gradient lost on the wire fails backward at its timeout, never hangs") {
  auto plan = std::make_shared<rpc::FaultPlan>();
  plan->add({rpc::Fault::kDrop, rpc::MessageKind::kRequest, "tandem.autograd.grad"});
  World w(2, define, [plan](rpc::AgentOptions& o) { o.transport = rpc::faulty_transport(plan); });
  auto x = at::arange(1, 4, kF64).requires_grad_();
  {
    dist::Context ctx(w[0]);
    // Two hops there and back: the gradients of the first and the last ride
    // in worker1's `run` request and reply, the two between go on their own.
    auto y = w[0].rpc_sync<at::Tensor>(
        "worker1", "scale", w[0].rpc_sync<at::Tensor>("worker1", "scale", x, 2) * 1, 1);
    auto t0 = std::chrono::steady_clock::now();
    // The root's own deadline or its `run` call's, whichever fires first.
    CHECK_THROWS_AS(dist::backward(w[0], ctx.id(), {at::sum(y)}, false, 500ms), rpc::TimeoutError);
    CHECK(std::chrono::steady_clock::now() - t0 < 2000ms);
    CHECK(plan->hits(0) == 1);
    // The next backward in the same context gets its gradient through.
    auto z = w[0].rpc_sync<at::Tensor>("worker1", "scale", x, 3);
    dist::backward(w[0], ctx.id(), {at::sum(z)}, false, 5000ms);
    CHECK(at::allclose(dist::get_gradients(ctx.id()).at(x), at::full_like(x, 3)));
  }
  w.shutdown();
}
