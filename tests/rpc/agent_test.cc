// Agents in one process: calls, types, futures, errors, timeouts, shutdown.
#include "test_util.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <atomic>
#include <chrono>

#include "tandem/rpc/agent/testing.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rref.h"

using namespace tandem;
using namespace tandem::rpc;
using namespace std::chrono_literals;
using test::eventually;
using test::World;

namespace {

// sleep_ms handlers that have started and that have returned, in this
// process: a test waits on them for a call to be running, or for late work
// to be over.
std::atomic<int> g_sleeps_started{0};
std::atomic<int> g_sleeps_done{0};

void define_common(Registry& r) {
  r.def("caller", []() { return handler_caller(); });
  r.def("add", [](at::Tensor a, at::Tensor b) { return a + b; });
  r.def("scale", [](at::Tensor a, double s) { return a * s; });
  r.def("echo", [](c10::IValue v) { return v; });
  r.def("fail", [](std::string why) -> int64_t { throw std::runtime_error(why); });
  r.def("sleep_ms", [](int64_t ms) {
    ++g_sleeps_started;
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));  // the slow work under test
    ++g_sleeps_done;
    return ms;
  });
  r.def("nothing", []() {});
  r.def("sum_ints", [](std::vector<int> v) {
    int64_t s = 0;
    for (int x : v) s += x;
    return s;
  });
  r.def("describe", [](std::tuple<std::string, int64_t> t,
                       std::unordered_map<std::string, double> m, c10::optional<int64_t> maybe) {
    return std::get<0>(t) + ":" + std::to_string(std::get<1>(t)) + ":" + std::to_string(m.size()) +
           ":" + (maybe ? std::to_string(*maybe) : "none");
  });
  r.def("split", [](at::Tensor t) {
    return std::make_tuple(t.narrow(0, 0, 1), t.narrow(0, 1, t.size(0) - 1));
  });
  r.def("whoami", []() { return current_agent()->name(); });
  r.def("requires_grad", [](at::Tensor t) { return t.requires_grad() && t.is_leaf(); });
  // Trains the copy it received: a tensor that required grad arrives as a leaf that does.
  r.def("grad_of_square_sum", [](at::Tensor t) {
    (t * t).sum().backward();
    return t.grad();
  });
  // A nested call with a short timeout that it cannot meet.
  r.def("nested_timeout", []() {
    return current_agent()->rpc_sync<int64_t>(CallOptions{100ms}, "worker1", "sleep_ms", 600);
  });
  // Calls `fn` on `to` from inside a handler: nested RPC.
  r.def("relay", [](std::string to, std::string fn, int64_t arg) {
    return current_agent()->rpc_sync<int64_t>(to, fn, arg);
  });
  // Asynchronous: returns a future; the pool thread is released meanwhile.
  r.def("relay_async", [](std::string to, int64_t ms) {
    return current_agent()->rpc_async<int64_t>(to, "sleep_ms", ms).then([](Future<int64_t> f) {
      return f.wait() + 1;
    });
  });
}

}  // namespace

TEST_CASE("agent: typed calls between workers") {
  World w(2, define_common);
  at::Tensor x = at::randn({4, 4});
  at::Tensor y = w[0].rpc_sync<at::Tensor>("worker1", "add", x, x);
  CHECK(at::allclose(y, x + x));
  CHECK(at::allclose(w[1].rpc_sync<at::Tensor>("worker0", "scale", x, 0.5), x * 0.5));
  CHECK(w[0].rpc_sync<int64_t>("worker1", "sum_ints", std::vector<int>{1, 2, 3}) == 6);
  CHECK(w[0].rpc_sync<std::string>("worker1", "describe",
                                   std::make_tuple(std::string("a"), int64_t(3)),
                                   std::unordered_map<std::string, double>{{"k", 1.0}, {"j", 2.0}},
                                   c10::optional<int64_t>(7)) == "a:3:2:7");
  CHECK(w[0].rpc_sync<std::string>(
            "worker1", "describe", std::make_tuple(std::string("b"), int64_t(1)),
            std::unordered_map<std::string, double>{}, c10::optional<int64_t>()) == "b:1:0:none");
  auto [head, tail] =
      w[0].rpc_sync<std::tuple<at::Tensor, at::Tensor>>("worker1", "split", at::arange(5));
  CHECK(head.numel() == 1);
  CHECK(tail.numel() == 4);
  w[0].rpc_sync<void>("worker1", "nothing");
  CHECK(w[0].rpc_sync("worker1", "nothing").isNone());
  CHECK(w[1].rpc_sync<std::string>("worker1", "whoami") == "worker1");  // a call to oneself
  CHECK(w[0].rpc_sync<std::string>("worker1", "echo", "hi") == "hi");
  w.shutdown();
}

TEST_CASE("agent: large and empty tensors cross intact") {
  World w(2, define_common);
  at::Tensor big = at::randn({4 << 20});  // 16 MiB
  CHECK(at::equal(w[0].rpc_sync<at::Tensor>("worker1", "echo", big), big));
  at::Tensor empty = at::zeros({0, 8});
  at::Tensor back = w[0].rpc_sync<at::Tensor>("worker1", "echo", empty);
  CHECK((back.sizes() == empty.sizes()));
  w.shutdown();
}

TEST_CASE("agent: worker infos come from the rendezvous") {
  World w(3, define_common, [](AgentOptions& o) { o.name = "node" + std::to_string(o.rank); });
  auto infos = w[1].get_worker_infos();
  REQUIRE(infos.size() == 3);
  for (int r = 0; r < 3; ++r) {
    CHECK(infos[r].rank == r);
    CHECK(infos[r].name == "node" + std::to_string(r));
    CHECK(infos[r].port > 0);
  }
  CHECK(w[2].get_worker_info("node0").rank == 0);
  CHECK(w[2].info().name == "node2");
  CHECK_THROWS_AS(w[0].get_worker_info("nobody"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(w[0].rpc_sync("nobody", "echo", 1), "unknown worker 'nobody'",
                       std::invalid_argument);
  w.shutdown();
}

TEST_CASE("agent: futures wait, chain with then, and propagate errors") {
  World w(2, define_common);
  auto f = w[0].rpc_async<int64_t>("worker1", "sleep_ms", 20);
  auto g = f.then([](Future<int64_t> done) { return done.wait() * 2; });
  auto h = g.then([](Future<int64_t> done) { return std::to_string(done.wait()); });
  CHECK(h.wait() == "40");
  CHECK(f.done());

  // A callback never runs inline inside then(), even on a finished future:
  // it runs on the agent's pool, not on the thread that called then().
  std::thread::id ran_on;
  auto k = f.then([&](Future<int64_t>) { ran_on = std::this_thread::get_id(); });
  k.wait();
  CHECK(ran_on != std::thread::id());
  CHECK(ran_on != std::this_thread::get_id());

  auto bad = w[0].rpc_async<int64_t>("worker1", "fail", std::string("boom"));
  auto after = bad.then([](Future<int64_t> done) { return done.wait() + 1; });
  CHECK_THROWS_AS(after.wait(), RemoteError);
  auto recovered = bad.then([](Future<int64_t> done) -> int64_t {
    try {
      return done.wait();
    } catch (const RemoteError&) {
      return -1;
    }
  });
  CHECK(recovered.wait() == -1);

  // then() returning a future flattens.
  auto chained = w[0].rpc_async<int64_t>("worker1", "sleep_ms", 1).then([&](Future<int64_t> d) {
    return w[0].rpc_async<int64_t>("worker1", "sleep_ms", d.wait() + 1);
  });
  CHECK(chained.wait() == 2);
  w.shutdown();
}

TEST_CASE("agent: errors arrive typed, naming the worker") {
  World w(2, define_common);
  try {
    w[0].rpc_sync("worker1", "fail", std::string("it broke"));
    FAIL("expected RemoteError");
  } catch (const RemoteError& e) {
    CHECK(e.worker() == "worker1");
    CHECK(e.remote_message() == "it broke");
    CHECK(std::string(e.what()).find("worker1") != std::string::npos);
  }
  CHECK_THROWS_AS(w[0].rpc_sync("worker1", "no_such_function"), UnknownFunctionError);
  try {
    w[0].rpc_sync("worker1", "scale", at::ones({2}), std::string("x"));
    FAIL("expected RemoteError");
  } catch (const RemoteError& e) {
    CHECK(e.remote_message() == "argument 2 of 'scale': expected float, got String");
  }
  try {
    w[0].rpc_sync("worker1", "scale", at::ones({2}));
    FAIL("expected RemoteError");
  } catch (const RemoteError& e) {
    CHECK(e.remote_message() == "'scale' takes 2 argument(s), got 1");
  }
  // A result of the wrong type is refused at the caller, naming it.
  CHECK_THROWS_WITH_AS(w[0].rpc_sync<at::Tensor>("worker1", "sleep_ms", 0),
                       "result: expected Tensor, got Int", std::invalid_argument);
  // ... and so is a result that is missing: never an undefined tensor.
  CHECK_THROWS_WITH_AS(w[0].rpc_sync<at::Tensor>("worker1", "nothing"),
                       "result: expected Tensor, got None", std::invalid_argument);
  CHECK_THROWS_WITH_AS(w[0].rpc_async<at::Tensor>("worker1", "nothing").wait(),
                       "result: expected Tensor, got None", std::invalid_argument);
  CHECK(!w[0].rpc_sync<c10::optional<at::Tensor>>("worker1", "nothing").has_value());
  // The unknown-function error names the function and the worker, once each.
  CHECK_THROWS_WITH_AS(w[0].rpc_sync("worker1", "no_such_function"),
                       "no function 'no_such_function' is registered (worker worker1)",
                       UnknownFunctionError);
  // A reply keeps the kind of the error: a handler whose own call timed out
  // fails its caller with TimeoutError, naming the handler's worker.
  try {
    w[0].rpc_sync("worker1", "nested_timeout");
    FAIL("expected TimeoutError");
  } catch (const TimeoutError& e) {
    CHECK(std::string(e.what()).find("timed out") != std::string::npos);
    CHECK(std::string(e.what()).find("(worker worker1)") != std::string::npos);
  }
  // Arguments that cannot travel fail at the call site.
  CHECK_THROWS_AS(w[0].rpc_sync("worker1", "echo", c10::IValue(c10::complex<double>(1, 1))),
                  std::invalid_argument);
  CHECK(rpc::testing::pending_calls(w[0]) == 0);
  w.shutdown();
}

TEST_CASE("agent: a tensor that requires grad arrives as a leaf that requires grad") {
  World w(2, define_common);
  auto x = at::arange(4, at::kDouble).requires_grad_();
  CHECK(w[0].rpc_sync<bool>("worker1", "requires_grad", x));
  CHECK_FALSE(w[0].rpc_sync<bool>("worker1", "requires_grad", x.detach()));
  // The receiver can train its copy; the sender's tensor is untouched.
  auto g = w[0].rpc_sync<at::Tensor>("worker1", "grad_of_square_sum", x);
  CHECK(at::equal(g, 2 * x.detach()));
  CHECK(!x.grad().defined());
  // Results too: computed from such a copy, they come back requiring grad.
  auto y = w[0].rpc_sync<at::Tensor>("worker1", "scale", x, 2.0);
  CHECK(y.requires_grad());
  CHECK(y.is_leaf());
  w.shutdown();
}

TEST_CASE("agent: when_all, when_any and wait(timeout)") {
  World w(2, define_common);
  std::vector<Future<int64_t>> fs;
  for (int64_t ms : {30, 1, 10}) fs.push_back(w[0].rpc_async<int64_t>("worker1", "sleep_ms", ms));
  CHECK(when_all(fs).wait() == std::vector<int64_t>{30, 1, 10});
  CHECK(when_all(std::vector<Future<int64_t>>{}).wait().empty());
  // The first error in order, once all have completed.
  std::vector<Future<int64_t>> mixed{
      w[0].rpc_async<int64_t>("worker1", "sleep_ms", 50),
      w[0].rpc_async<int64_t>("worker1", "fail", std::string("first-failure")),
      w[0].rpc_async<int64_t>("worker1", "fail", std::string("second-failure"))};
  auto all = when_all(mixed);
  CHECK_THROWS_WITH_AS(all.wait(), doctest::Contains("first-failure"), RemoteError);
  CHECK(mixed[0].done());
  std::vector<Future<void>> voids{w[0].rpc_async<void>("worker1", "nothing")};
  when_all(voids).wait();
  // when_any: the first to complete, value or error.
  std::vector<Future<int64_t>> race{w[0].rpc_async<int64_t>("worker1", "sleep_ms", 2000),
                                    w[0].rpc_async<int64_t>("worker1", "sleep_ms", 1)};
  CHECK(when_any(race).wait() == 1);
  CHECK_THROWS_AS(when_any(std::vector<Future<int64_t>>{}), std::invalid_argument);
  // wait(timeout): TimeoutError while it runs, the value once done.
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(race[0].wait(50ms), TimeoutError);
  CHECK(std::chrono::steady_clock::now() - t0 < 1500ms);
  CHECK(race[0].wait(10s) == 2000);
  CHECK(race[1].wait(1ms) == 1);
  w.shutdown();
}

TEST_CASE("agent: timeouts (default, per call, none) and late replies") {
  World w(2, define_common, [](AgentOptions& o) { o.rpc_timeout = 150ms; });
  const int sleeps = g_sleeps_done;
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(w[0].rpc_sync("worker1", "sleep_ms", 600), TimeoutError);
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 140ms);
  CHECK(took < 500ms);
  // Per-call override, shorter and longer than the default.
  CHECK_THROWS_AS(w[0].rpc_sync(CallOptions{30ms}, "worker1", "sleep_ms", 300), TimeoutError);
  CHECK(w[0].rpc_sync<int64_t>(CallOptions{2000ms}, "worker1", "sleep_ms", 300) == 300);
  // 0 means no timeout at all.
  CHECK(w[0].rpc_sync<int64_t>(CallOptions{kNoTimeout}, "worker1", "sleep_ms", 300) == 300);
  auto f = w[0].rpc_async(CallOptions{20ms}, "worker1", "sleep_ms", 200);
  CHECK_THROWS_AS(f.wait(), TimeoutError);
  // The late replies arrive and are dropped; the next call is unaffected.
  // Once worker1 has run all five, their replies are on the connection ahead
  // of the next call's.
  CHECK(eventually([&] { return g_sleeps_done == sleeps + 5; }));
  CHECK(w[0].rpc_sync<int64_t>("worker1", "sleep_ms", 1) == 1);
  CHECK(rpc::testing::pending_calls(w[0]) == 0);
  w.shutdown();
}

TEST_CASE("agent: a nested call inherits its caller's remaining deadline") {
  World w(3, define_common);
  auto t0 = std::chrono::steady_clock::now();
  // worker1 relays to worker2, which sleeps 3 s. The relay's own default is
  // 20 s, but it inherits the 200 ms left of worker0's call.
  try {
    w[0].rpc_sync(CallOptions{200ms}, "worker1", "relay", std::string("worker2"),
                  std::string("sleep_ms"), int64_t(3000));
    FAIL("expected a timeout");
  } catch (const TimeoutError&) {
  }
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took < 1000ms);
  // worker1's relay itself gave up too, at its own deadline (long before
  // worker2's 3 s are over): its failure reaches nobody, nothing is pending.
  CHECK(eventually([&] { return rpc::testing::pending_calls(w[1]) == 0; }, 1000ms));
  CHECK(w[0].rpc_sync<int64_t>("worker1", "relay", std::string("worker2"), std::string("sleep_ms"),
                               int64_t(5)) == 5);
  w.shutdown();
}

TEST_CASE("agent: a function returning a future frees its pool thread") {
  // One pool thread on worker1: if relay_async blocked it, the 4 concurrent
  // calls below would take 4 x 200 ms at least; chained, they overlap.
  World w(3, define_common, [](AgentOptions& o) { o.num_worker_threads = o.rank == 1 ? 1 : 4; });
  auto t0 = std::chrono::steady_clock::now();
  std::vector<Future<int64_t>> fs;
  for (int i = 0; i < 4; ++i) {
    fs.push_back(w[0].rpc_async<int64_t>("worker1", "relay_async", std::string("worker2"), 200));
  }
  for (auto& f : fs) CHECK(f.wait() == 201);
  CHECK(std::chrono::steady_clock::now() - t0 < 700ms);
  w.shutdown();
}

TEST_CASE("agent: a handler may wait on a call it started, even with one pool thread") {
  // Replies complete futures without needing a pool thread, so this does not
  // wedge worker1 (it is still better to chain than to block).
  World w(
      3,
      [](Registry& r) {
        define_common(r);
        r.def("wait_inside", [](std::string to) {
          return current_agent()->rpc_async<int64_t>(to, "sleep_ms", 30).wait() + 1;
        });
      },
      [](AgentOptions& o) { o.num_worker_threads = o.rank == 1 ? 1 : 2; });
  CHECK(w[0].rpc_sync<int64_t>("worker1", "wait_inside", std::string("worker2")) == 31);
  w.shutdown();
}

TEST_CASE("agent: a handler answers with a promise's future once another call completes it") {
  auto ready = std::make_shared<Promise<int64_t>>();
  auto never = std::make_shared<Promise<void>>();
  World w(
      2,
      [&](Registry& r) {
        r.def("wait_ready", [ready] { return ready->future(); });
        r.def("set_ready", [ready](int64_t v) { ready->set_value(v); });
        r.def("fail_never", [never] {
          never->set_error(std::make_exception_ptr(std::runtime_error("the table is gone")));
        });
        r.def("wait_never", [never] { return never->future(); });
      },
      [](AgentOptions& o) { o.num_worker_threads = 1; });  // waiting holds no pool thread
  auto a = w[0].rpc_async<int64_t>("worker1", "wait_ready");
  auto b = w[0].rpc_async<int64_t>("worker1", "wait_ready");
  auto c = w[0].rpc_async<void>("worker1", "wait_never");
  CHECK_FALSE(a.done());
  w[0].rpc_sync<void>("worker1", "set_ready", int64_t(7));
  CHECK(a.wait() == 7);
  CHECK(b.wait() == 7);
  CHECK_THROWS_WITH_AS(w[0].rpc_sync<void>("worker1", "set_ready", int64_t(8)),
                       doctest::Contains("completed already"), RemoteError);
  w[0].rpc_sync<void>("worker1", "fail_never");
  CHECK_THROWS_WITH_AS(c.wait(), doctest::Contains("the table is gone"), RemoteError);
  w.shutdown();
}

TEST_CASE("agent: untyped functions see IValues") {
  // "later" completes its future from a thread of its own, joined below.
  std::mutex mu;
  std::vector<std::thread> helpers;
  World w(2, [&](Registry& r) {
    r.def_ivalue("count", [](std::vector<c10::IValue>& args) {
      return c10::IValue(static_cast<int64_t>(args.size()));
    });
    r.def_ivalue("later", [&](std::vector<c10::IValue>& args) {
      auto f = make_raw_future();
      int64_t v = args.at(0).toInt();
      std::lock_guard<std::mutex> lock(mu);
      helpers.emplace_back([f, v] {
        std::this_thread::sleep_for(20ms);  // slow work, finished later
        f->markCompleted(c10::IValue(v * 10));
      });
      return c10::IValue(f);
    });
  });
  CHECK(w[0].call("worker1", "count", {1, 2.0, "x"}).wait().toInt() == 3);
  CHECK(w[0].call("worker1", "later", {4}).wait().toInt() == 40);
  for (auto& t : helpers) t.join();
  w.shutdown();
}

TEST_CASE("agent: registry refuses duplicates and empty names") {
  Registry r;
  r.def("f", [](int64_t x) { return x; });
  CHECK_THROWS_AS(r.def("f", [](int64_t x) { return x; }), std::invalid_argument);
  CHECK_THROWS_AS(r.def("", [](int64_t x) { return x; }), std::invalid_argument);
  CHECK(r.contains("f"));
  CHECK_FALSE(r.contains("g"));
}

TEST_CASE("agent: many threads call concurrently") {
  World w(3, define_common, [](AgentOptions& o) { o.num_worker_threads = 4; });
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        int from = (t + i) % 3, to = (t + 2 * i + 1) % 3;
        at::Tensor x = at::full_like(at::zeros({8}), t * 100 + i);
        at::Tensor y = w[from].rpc_sync<at::Tensor>("worker" + std::to_string(to), "add", x, x);
        if (at::equal(y, x * 2)) ++ok;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(ok.load() == 300);
  w.shutdown();
}

TEST_CASE("agent: graceful shutdown waits for calls in flight everywhere") {
  World w(3, define_common);
  auto f = w[0].rpc_async<int64_t>("worker1", "sleep_ms", 300);
  auto g = w[2].rpc_async<int64_t>("worker0", "sleep_ms", 200);
  w.shutdown(true);  // all three at once
  CHECK(f.wait() == 300);
  CHECK(g.wait() == 200);
}

TEST_CASE("agent: shutdown(false) fails what is pending, then refuses new calls") {
  World w(2, define_common);
  const int started = g_sleeps_started;
  auto f = w[0].rpc_async<int64_t>("worker1", "sleep_ms", 2000);
  CHECK(eventually([&] { return g_sleeps_started == started + 1; }));  // running on worker1
  auto t0 = std::chrono::steady_clock::now();
  w[0].shutdown(false);
  CHECK_THROWS_AS(f.wait(), ShutdownError);
  CHECK(std::chrono::steady_clock::now() - t0 < 1000ms);
  CHECK_THROWS_AS(w[0].rpc_sync("worker1", "nothing"), ShutdownError);
  // The callback of a future that fails at shutdown still runs, exactly once.
  std::atomic<int> runs{0};
  f.then([&](Future<int64_t>) { ++runs; }).wait();
  CHECK(runs.load() == 1);
  w.shutdown(false);
}

TEST_CASE("agent: a peer that shuts down fails our calls with Disconnected at once") {
  World w(2, define_common);
  const int started = g_sleeps_started;
  auto f = w[0].rpc_async<int64_t>("worker1", "sleep_ms", 1500);
  CHECK(eventually([&] { return g_sleeps_started == started + 1; }));  // running on worker1
  auto t0 = std::chrono::steady_clock::now();
  std::thread stopper([&] { w[1].shutdown(false); });
  CHECK_THROWS_AS(f.wait(), DisconnectedError);
  CHECK(std::chrono::steady_clock::now() - t0 < 1000ms);
  stopper.join();
  // Calling the stopped worker again: refused at connect, not at the timeout.
  t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(w[0].rpc_sync("worker1", "nothing"), DisconnectedError);
  CHECK(std::chrono::steady_clock::now() - t0 < 1000ms);
  w[0].shutdown(false);
}

TEST_CASE("agent: a dropped connection is reopened by the next call") {
  World w(2, define_common);
  CHECK(w[0].rpc_sync<int64_t>("worker1", "sleep_ms", 1) == 1);
  rpc::testing::drop_connection(w[0], 1);
  CHECK(eventually([&] { return rpc::testing::live_connections(w[0]) == 0; }));
  CHECK(w[0].rpc_sync<int64_t>("worker1", "sleep_ms", 2) == 2);
  w.shutdown();
}

TEST_CASE("agent: bad options and worlds are refused clearly") {
  auto store = support::store_server(2s);
  auto reg = std::make_shared<Registry>();
  AgentOptions o;
  o.world_size = 2;
  o.rank = 5;
  CHECK_THROWS_WITH_AS(Agent::create(o, reg, store), doctest::Contains("rank 5"),
                       std::invalid_argument);
  o.rank = 0;
  o.num_worker_threads = 0;
  CHECK_THROWS_AS(Agent::create(o, reg, store), std::invalid_argument);
  CHECK_THROWS_WITH_AS(master_from_init_method("udp://x:1"), doctest::Contains("unsupported"),
                       std::invalid_argument);
  CHECK_THROWS_AS(master_from_init_method("tcp://host"), std::invalid_argument);
  auto hp = master_from_init_method("tcp://10.0.0.1:2345");
  CHECK(hp.first == "10.0.0.1");
  CHECK(hp.second == 2345);
  CHECK(master_from_init_method("tcp://[::1]:80").first == "::1");
}

TEST_CASE("agent: two workers with one name are refused") {
  CHECK_THROWS_WITH(World(2, define_common, [](AgentOptions& o) { o.name = "same"; }),
                    doctest::Contains("worker name 'same' is used by ranks 0 and 1"));
}

TEST_CASE("device maps: set_device_map refuses bad indices and a device mapped twice") {
  AgentOptions o;
  CHECK_THROWS_WITH_AS(o.set_device_map("worker1", {{-1, 0}}),
                       doctest::Contains("device -1 is not a CUDA device index"),
                       std::invalid_argument);
  o.set_device_map("worker1", {{0, 1}}).set_device_map("worker1", {{1, 0}, {0, 1}});
  CHECK(o.device_maps.at("worker1") == std::map<int, int>{{0, 1}, {1, 0}});
  CHECK_THROWS_WITH_AS(o.set_device_map("worker1", {{0, 0}}),
                       doctest::Contains("cuda:0 is already mapped to cuda:1"),
                       std::invalid_argument);
}

TEST_CASE("device maps: every worker checks every map at start-up against both ends' devices") {
  // Workers here have no GPU; what they say at the rendezvous is set, so
  // the checks run as on a GPU machine (rpc/agent/testing.h).
  struct Devices {
    explicit Devices(int n) { testing::set_cuda_devices(n); }
    ~Devices() { testing::set_cuda_devices(-1); }
  };
  auto refused = [](int devices, std::map<int, int> map, const std::string& to,
                    const std::string& why) {
    Devices fake(devices);
    CAPTURE(why);
    CHECK_THROWS_WITH(World(2, define_common,
                            [&](AgentOptions& o) {
                              if (o.rank == 0) o.set_device_map(to, map);
                            }),
                      doctest::Contains(why.c_str()));
  };
  refused(0, {{0, 0}}, "worker1",
          "worker0's device map to 'worker1' names cuda:0, but worker0 has 0 CUDA device(s)");
  refused(2, {{0, 2}}, "worker1",
          "worker0's device map to 'worker1' maps cuda:0 to cuda:2, but worker1 has 2 CUDA "
          "device(s)");
  refused(2, {{0, 1}, {1, 1}}, "worker1",
          "maps both cuda:0 and cuda:1 to cuda:1: answers could not find their way back");
  refused(2, {{0, 0}}, "worker7", "worker0's device map to 'worker7': there is no such worker");
  refused(2, {{0, 0}}, "worker0", "a map to itself");
  // A good map starts, and is known to both ends; CPU tensors are not
  // touched by it.
  Devices fake(2);
  World w(2, define_common, [](AgentOptions& o) {
    if (o.rank == 0) o.set_device_map("worker1", {{0, 1}, {1, 0}});
  });
  CHECK(w[1].get_worker_info("worker0").device_maps.at("worker1") ==
        std::map<int, int>{{0, 1}, {1, 0}});
  CHECK(w[1].get_worker_info("worker0").cuda_devices == 2);
  // Answers go back by the inverse of the caller's map; worker0 answers
  // worker1 by the same (its own map covers it).
  CHECK(w[1].answer_device_to("worker0", c10::Device("cuda:1")) == c10::Device("cuda:0"));
  CHECK(w[1].answer_device_to("worker0", c10::Device("cuda:0")) == c10::Device("cuda:1"));
  CHECK_FALSE(w[1].answer_device_to("worker0", c10::Device("cuda:2")).has_value());
  CHECK_FALSE(w[1].answer_device_to("worker0", c10::Device("cpu")).has_value());
  CHECK(w[0].answer_device_to("worker1", c10::Device("cuda:0")) == c10::Device("cuda:1"));
  CHECK_THROWS_AS(w[0].answer_device_to("worker9", c10::Device("cuda:0")), std::invalid_argument);
  // A handler knows whom it serves.
  CHECK(w[0].rpc_sync<std::string>("worker1", "caller") == "worker0");
  CHECK(w[1].rpc_sync<std::string>("worker0", "caller") == "worker1");
  CHECK(rpc::handler_caller().empty());
  auto t = at::arange(6, at::kFloat);
  CHECK(at::equal(w[0].rpc_sync<at::Tensor>("worker1", "echo", t), t));
  w.shutdown();
}

TEST_CASE("device maps: a tensor on a device that cannot travel is refused, naming it") {
  World w(2, [](Registry& r) {
    define_common(r);
    r.def("make_meta", []() { return at::empty({2}, at::TensorOptions().device(at::kMeta)); });
  });
  auto meta = at::empty({4}, at::TensorOptions().device(at::kMeta));
  CHECK_THROWS_WITH_AS(w[0].rpc_sync<at::Tensor>("worker1", "echo", meta),
                       doctest::Contains("cannot send a tensor on meta to worker1: only CPU and "
                                         "CUDA tensors travel"),
                       std::invalid_argument);
  // In an answer too: the caller hears of it, the callee keeps serving.
  CHECK_THROWS_WITH(w[0].rpc_sync<at::Tensor>("worker1", "make_meta"),
                    doctest::Contains("cannot send a tensor on meta to worker0"));
  CHECK(w[0].rpc_sync<int64_t>("worker1", "sleep_ms", 1) == 1);
  w.shutdown();
}

TEST_CASE("device maps: CUDA tensors arrive on the mapped device, in calls, answers and RRefs") {
  if (!test::cuda_or_skip()) return;
  const c10::Device gpu(c10::kCUDA, 0);
  World w(
      2,
      [](Registry& r) {
        define_common(r);
        r.def("where", [](at::Tensor t) { return t.device().str(); });
        r.def("make_on_gpu", [](int64_t n) { return at::arange(n, at::kFloat).to(at::kCUDA); });
      },
      [](AgentOptions& o) {
        if (o.rank == 0) o.set_device_map("worker1", {{0, 0}});
      });
  // Small (through the ring, into pinned memory) and 64 MiB (a segment,
  // pageable: copied synchronously); the handler's work on the default
  // stream follows the copy.
  for (int64_t n : {int64_t(16), int64_t(16) << 20}) {
    CAPTURE(n);
    auto x = at::randn({n}, at::TensorOptions().device(gpu));
    auto y = w[0].rpc_sync<at::Tensor>("worker1", "scale", x, 2.0);
    CHECK(y.device() == gpu);
    CHECK(at::equal(y.cpu(), (x * 2).cpu()));
  }
  CHECK(w[0].rpc_sync<std::string>("worker1", "where", at::ones({2}, gpu)) == "cuda:0");
  CHECK(w[0].rpc_sync<std::string>("worker1", "where", at::ones({2})) == "cpu");
  // Answers come back by the inverse of worker0's map.
  auto made = w[0].rpc_sync<at::Tensor>("worker1", "make_on_gpu", int64_t(5));
  CHECK(made.device() == gpu);
  CHECK(at::equal(made.cpu(), at::arange(5, at::kFloat)));
  // worker1 calls worker0 with it too, having no map of its own.
  auto back = w[1].rpc_sync<at::Tensor>("worker0", "scale", at::ones({3}, gpu), 3.0);
  CHECK(back.device() == gpu);
  CHECK(at::equal(back.cpu(), at::full({3}, 3.0f)));
  {
    RRef<at::Tensor> r = remote<at::Tensor>(w[0], "worker1", "make_on_gpu", int64_t(7));
    auto v = r.to_here();
    CHECK(v.device() == gpu);
    CHECK(at::equal(v.cpu(), at::arange(7, at::kFloat)));
  }
  w.shutdown();
}

TEST_CASE("api: init from the environment, rpc to oneself, shutdown") {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  support::set_master_env(support::free_port());  // init() hosts the store there
  auto reg = std::make_shared<Registry>();
  define_common(*reg);
  CHECK_THROWS_AS(current_agent(), std::logic_error);
  init(reg);
  CHECK(is_initialized());
  CHECK(get_worker_info().name == "worker0");
  CHECK(rpc::rpc_sync<int64_t>("worker0", "sum_ints", std::vector<int64_t>{4, 5}) == 9);
  CHECK(rpc::rpc_async<std::string>("worker0", "whoami").wait() == "worker0");
  CHECK_THROWS_AS(init(reg), std::logic_error);
  {
    RRef<int64_t> mine(int64_t(5));  // a local owner reference on the current agent
    CHECK(mine.local_value() == 5);
    CHECK(mine.to_here() == 5);
    auto made = rpc::remote<int64_t>("worker0", "sum_ints", std::vector<int64_t>{1, 2});
    CHECK(made.to_here() == 3);
  }
  rpc::shutdown();
  CHECK_FALSE(is_initialized());
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
}

TEST_CASE("agent: two workers that dial each other at once call on one connection") {
  // Both call at the same moment, so that each dials before it hears from
  // the other; both then call on the connection the lower rank dialed.
  uint64_t crossings = 0;
  for (int trial = 0; trial < 40 && crossings == 0; ++trial) {
    test::World w(2, [](rpc::Registry& r) { r.def("echo", [](int64_t x) { return x; }); });
    std::atomic<int> ready{0};
    auto call = [&](int from) {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      std::vector<rpc::Future<int64_t>> fs;
      for (int i = 0; i < 8; ++i) {
        fs.push_back(w[from].rpc_async<int64_t>(from == 0 ? "worker1" : "worker0", "echo", i));
      }
      for (int i = 0; i < 8; ++i) CHECK(fs[i].wait() == i);
    };
    std::thread t(call, 1);
    call(0);
    t.join();
    crossings = rpc::testing::crossed_connections(w[1]);
    CHECK(rpc::testing::crossed_connections(w[0]) == 0);  // never the lower rank
    if (crossings > 0) {
      // worker1's own dial is retired by both sides and closes once nothing
      // is owed on it; calls in both directions go on the other.
      CHECK(eventually([&] { return rpc::testing::live_connections(w[1]) == 1; }));
      CHECK(eventually([&] { return rpc::testing::live_connections(w[0]) == 1; }));
      for (int i = 0; i < 20; ++i) {
        CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", i) == i);
        CHECK(w[1].rpc_sync<int64_t>("worker0", "echo", i) == i);
      }
      CHECK(rpc::testing::live_connections(w[0]) == 1);  // no other one was opened
      CHECK(rpc::testing::live_connections(w[1]) == 1);
    }
    w.shutdown();
  }
  MESSAGE("crossed dials seen: " << crossings);
  CHECK(crossings > 0);
}

TEST_CASE("agent: workers on one host call over shared memory unless told otherwise") {
  auto big = at::arange(1 << 18, at::kFloat);  // 1 MiB: through a segment on shm
  SUBCASE("auto, the default") {
    World w(2, define_common);
    CHECK(w[0].transport_to("worker1").empty());  // nothing dialed yet
    CHECK(at::equal(w[0].rpc_sync<at::Tensor>("worker1", "echo", big), big));
    CHECK(w[0].transport_to("worker1") == "shm");
    CHECK(w[0].transport_stats().shared_tensors == 1);  // the request
    CHECK(w[1].transport_stats().shared_tensors == 1);  // the reply
    w.shutdown();
  }
  SUBCASE("tcp, from the environment") {
    setenv("TANDEM_TRANSPORT", "tcp", 1);
    World w(2, define_common);
    unsetenv("TANDEM_TRANSPORT");
    CHECK(w[0].get_worker_info("worker1").local.empty());  // nothing published
    CHECK(at::equal(w[0].rpc_sync<at::Tensor>("worker1", "echo", big), big));
    CHECK(w[0].transport_to("worker1") == "tcp");
    CHECK(w[0].transport_stats().shared_tensors == 0);
    w.shutdown();
  }
  SUBCASE("shm forced, towards a peer that offers none") {
    World w(2, define_common,
            [](AgentOptions& o) { o.transport_mode = o.rank == 0 ? "shm" : "tcp"; });
    CHECK_THROWS_WITH_AS(w[0].rpc_sync<at::Tensor>("worker1", "echo", big),
                         doctest::Contains("worker worker1 cannot be reached over shared memory "
                                           "(transport 'shm'): it offers no shared-memory "
                                           "endpoint"),
                         DisconnectedError);
    // What worker1 dials is its own choice: TCP.
    CHECK(at::equal(w[1].rpc_sync<at::Tensor>("worker0", "echo", big), big));
    CHECK(w[1].transport_to("worker0") == "tcp");
    w.shutdown();
  }
  SUBCASE("a transport that does not exist") {
    CHECK_THROWS_WITH_AS(World(1, {}, [](AgentOptions& o) { o.transport_mode = "udp"; }),
                         doctest::Contains("transport 'udp' is none of auto, shm, tcp"),
                         std::invalid_argument);
  }
}

TEST_CASE("agent: over shm, a waiting caller and an idle pool thread read their connection") {
  // rpc/transport.h, 8.: worker0's rpc_sync reads its own answers from the
  // connection it dialed (through the handshake gate), worker1's pool
  // threads the requests after the first; with polling off, neither does.
  // Who reads first is a race with the loop thread, which a busy machine
  // (other tests beside this one) can win for a while: calls go on until
  // both sides have read some (at most 10 s).
  for (bool poll : {true, false}) {
    CAPTURE(poll);
    World w(2, define_common, [&](AgentOptions& o) {
      o.limits.poll_while_spinning = poll;
      o.sync_spin = o.pool_spin = std::chrono::milliseconds(20);
    });
    int64_t next = 0;
    auto some_calls = [&] {
      for (int i = 0; i < 50; ++i, ++next) {
        CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", next) == next);
      }
    };
    auto both_polled = [&] {
      return w[0].transport_stats().polled_messages > 0 &&
             w[1].transport_stats().polled_messages > 0;
    };
    if (poll) {
      // Answers on the caller's thread, requests on a pool thread.
      CHECK(
          test::eventually([&] { return some_calls(), both_polled(); }, std::chrono::seconds(10)));
      CHECK(w[0].metrics().to_string().find("messages read by waiting threads") !=
            std::string::npos);
    } else {
      for (int round = 0; round < 4; ++round) some_calls();
      CHECK(w[0].transport_stats().polled_messages == 0);
      CHECK(w[1].transport_stats().polled_messages == 0);
    }
    REQUIRE(w[0].transport_to("worker1") == "shm");
    w.shutdown();
  }
}

namespace {
// rpc/transport.h, 10.: past their spins (1 us here) worker0's rpc_sync
// and worker1's idle pool thread sleep on the connection (`mode`'s kind of
// it), and each side's write wakes the other's sleeper instead of its loop
// thread.
void sleepers_on_connections(const std::string& mode) {
  World w(2, define_common, [&](AgentOptions& o) {
    o.sync_spin = o.pool_spin = 1us;
    o.transport_mode = mode;
  });
  REQUIRE(w[0].rpc_sync<int64_t>("worker1", "echo", int64_t(0)) == 0);
  REQUIRE(w[0].transport_to("worker1") == mode);
  int64_t next = 1;
  auto both_rang = [&] {
    for (int i = 0; i < 10; ++i, ++next) {
      std::this_thread::sleep_for(2ms);  // (both sides asleep when the call comes)
      CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", next) == next);
      CHECK(w[0].rpc_sync<int64_t>("worker1", "sleep_ms", int64_t(3)) == 3);
      // A handler that throws: its error wakes the sleeping caller as an answer does.
      std::this_thread::sleep_for(2ms);
      CHECK_THROWS_WITH_AS(w[0].rpc_sync("worker1", "fail", std::string("no")),
                           doctest::Contains("no"), RemoteError);
    }
    // (a ring counts its bells; a socket's sleeper is woken by the kernel)
    return mode != "shm" ||
           (w[0].transport_stats().ring_bells > 0 && w[1].transport_stats().ring_bells > 0);
  };
  CHECK(eventually(both_rang, std::chrono::seconds(10)));

  SUBCASE("a caller asleep on its connection: its deadline and its peer's end wake it") {
    auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(w[0].rpc_sync(CallOptions{50ms}, "worker1", "sleep_ms", int64_t(700)),
                    TimeoutError);
    // (its sleep's backstop is a second: only the bell ends it sooner)
    CHECK(std::chrono::steady_clock::now() - t0 < 600ms);
    CHECK(eventually([&] { return rpc::testing::pending_calls(w[0]) == 0; }));
    const int started = g_sleeps_started;
    std::thread stopper([&] {
      CHECK(eventually([&] { return g_sleeps_started == started + 1; }));
      w[1].shutdown(false);
    });
    t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(w[0].rpc_sync("worker1", "sleep_ms", int64_t(2000)), DisconnectedError);
    CHECK(std::chrono::steady_clock::now() - t0 < 1500ms);
    stopper.join();
    w[0].shutdown(false);
  }
  SUBCASE("a handler's nested call sleeps on its own connection, its answer still arrives") {
    // (worker1's handler calls back to worker0 and sleeps on that connection)
    for (int64_t i = 1; i <= 5; ++i) {
      std::this_thread::sleep_for(2ms);
      CHECK(w[0].rpc_sync<int64_t>("worker1", "relay", std::string("worker0"), "sleep_ms", i) == i);
    }
    w.shutdown();
  }
}
}  // namespace

TEST_CASE("agent: over shm, a caller and an idle pool thread sleep on their connection") {
  sleepers_on_connections("shm");
}

TEST_CASE("agent: over tcp, a caller and an idle pool thread sleep on their connection") {
  sleepers_on_connections("tcp");
}

TEST_CASE("agent: a task for a pool whose only thread sleeps on a connection runs at once") {
  // worker1's one pool thread sleeps on the connection it last served; a
  // request that comes on another connection (read by the loop thread)
  // rings its bell through post(). Without that ring it would wait out the
  // sleep's one-second backstop each time.
  for (const std::string mode : {"shm", "tcp"}) {
    CAPTURE(mode);
    World w(3, define_common, [&](AgentOptions& o) {
      o.num_worker_threads = 1;
      o.sync_spin = o.pool_spin = 1us;
      o.transport_mode = mode;
    });
    for (int from : {0, 2}) w[from].rpc_sync("worker1", "nothing");
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) {
      const int from = i % 2 == 0 ? 0 : 2;
      std::this_thread::sleep_for(3ms);
      CHECK(w[from].rpc_sync<int64_t>("worker1", "echo", int64_t(i)) == i);
    }
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
    w.shutdown();
  }
}

TEST_CASE("agent: crossed dials under load lose no call, and end with one connection") {
  for (const char* mode : {"tcp", "shm"}) {
    CAPTURE(mode);
    uint64_t crossings = 0;
    for (int trial = 0; trial < 12; ++trial) {
      test::World w(
          2, [](rpc::Registry& r) { r.def("echo", [](c10::IValue v) { return v; }); },
          [&](AgentOptions& o) { o.transport_mode = mode; });
      std::atomic<int> ready{0};
      std::atomic<int> wrong{0};
      auto load = [&](int from, int thread) {
        ready.fetch_add(1);
        while (ready.load() < 6) {
        }
        const std::string to = from == 0 ? "worker1" : "worker0";
        std::vector<rpc::Future<at::Tensor>> fs;
        std::vector<at::Tensor> sent;
        for (int i = 0; i < 30; ++i) {
          // Small and shared-memory-sized tensors, every one distinct.
          sent.push_back(at::full({i % 2 ? 16384 : 16}, float(from * 10000 + thread * 100 + i)));
          fs.push_back(w[from].rpc_async<at::Tensor>(to, "echo", sent.back()));
        }
        for (int i = 0; i < 30; ++i) {
          if (!at::equal(fs[i].wait(), sent[i])) ++wrong;
        }
      };
      std::vector<std::thread> threads;
      for (int from = 0; from < 2; ++from) {
        for (int t = 0; t < 3; ++t) threads.emplace_back(load, from, t);
      }
      for (auto& t : threads) t.join();
      CHECK(wrong.load() == 0);
      crossings += rpc::testing::crossed_connections(w[1]);
      CHECK(eventually([&] { return rpc::testing::live_connections(w[0]) == 1; }));
      CHECK(eventually([&] { return rpc::testing::live_connections(w[1]) == 1; }));
      w.shutdown();
    }
    MESSAGE(std::string(mode) << ": crossed dials seen in 12 trials: " << crossings);
  }
}

TEST_CASE("agent: metrics count what a scripted job did") {
  World w(2, define_common);
  // worker0: 5 answered calls, 2 that throw remotely, 1 to an unknown
  // function, 1 that times out; worker1 serves all 9.
  for (int i = 0; i < 5; ++i) {
    CHECK(at::equal(w[0].rpc_sync<at::Tensor>("worker1", "add", at::ones({4}), at::ones({4})),
                    at::full({4}, 2.0)));
  }
  for (int i = 0; i < 2; ++i) {
    CHECK_THROWS_AS(w[0].rpc_sync<int64_t>("worker1", "fail", std::string("no")), RemoteError);
  }
  CHECK_THROWS_AS(w[0].rpc_sync<int64_t>("worker1", "no_such_function"), UnknownFunctionError);
  CallOptions quick;
  quick.timeout = 50ms;
  const int done_before = g_sleeps_done.load();
  CHECK_THROWS_AS(w[0].rpc_async<int64_t>(quick, "worker1", "sleep_ms", int64_t(300)).wait(),
                  TimeoutError);
  // The late answer comes and is dropped: then both sides have every byte.
  CHECK(eventually([&] { return g_sleeps_done.load() > done_before; }));
  CHECK(eventually([&] {
    return w[0].metrics().bytes_received == w[1].metrics().bytes_sent &&
           w[1].metrics().bytes_received == w[0].metrics().bytes_sent;
  }));
  Metrics a = w[0].metrics(), b = w[1].metrics();
  INFO(a.to_string() << "---\n" << b.to_string());
  CHECK(a.calls_sent == 9);
  CHECK(a.calls_failed == 4);
  CHECK(a.failures == std::map<std::string, uint64_t>{
                          {"RemoteError", 2}, {"UnknownFunction", 1}, {"Timeout", 1}});
  CHECK(a.calls_in_flight == 0);
  CHECK(a.functions.at("add").calls == 5);
  CHECK(a.functions.at("add").failed == 0);
  CHECK(a.functions.at("add").p50_us > 0);
  CHECK(a.functions.at("add").p99_us >= a.functions.at("add").p50_us);
  CHECK(a.functions.at("fail").failed == 2);
  CHECK(a.functions.at("sleep_ms").failed == 1);
  CHECK(b.requests_served == 9);
  CHECK(b.requests_failed == 3);
  CHECK(b.calls_sent == 0);
  CHECK(a.requests_served == 0);
  CHECK(a.connections == 1);
  CHECK(a.bytes_sent > 0);
  // Exactly what one side wrote, the other read (the handshake included).
  CHECK(a.bytes_sent == b.bytes_received);
  CHECK(b.bytes_sent == a.bytes_received);
  w.shutdown();
}
