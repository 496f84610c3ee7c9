// Remote references across three workers in one process: creation, use,
// forks, reference counting, failures, and nothing left behind.
#include "test_util.h"

#include <ATen/ops/from_blob.h>

#include <atomic>
#include <map>

#include "tandem/rpc/rref.h"

using namespace tandem;
using namespace tandem::rpc;
using namespace std::chrono_literals;
using test::eventually;
using test::World;

namespace {

// Counts frees of tensors made by "make_counted".
std::atomic<int> g_freed{0};
// Counts the "sleep_then_ones" calls that have returned.
std::atomic<int> g_slept{0};

// RRefs a worker was handed and keeps until told to drop them, by worker name.
struct Stash {
  std::mutex mu;
  std::map<std::string, std::vector<RRef<at::Tensor>>> held;
};

void define(Registry& r, std::shared_ptr<Stash> stash) {
  r.def("ones", [](int64_t n) { return at::ones({n}); });
  r.def("full", [](int64_t n, double v) { return at::full_like(at::zeros({n}), v); });
  r.def("fail", [](int64_t) -> at::Tensor { throw std::runtime_error("no value today"); });
  r.def("sleep_then_ones", [](int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));  // a slow creation
    ++g_slept;
    return at::ones({1});
  });
  r.def("make_counted", [](int64_t n) {
    auto* data = new float[n]();
    return at::from_blob(data, {n}, [](void* p) {
      delete[] static_cast<float*>(p);
      ++g_freed;
    });
  });
  r.def("scale", [](at::Tensor self, double s) { return self * s; });
  r.def("numel", [](at::Tensor self) { return self.numel(); });
  r.def("called_by", [](at::Tensor) { return handler_caller(); });
  auto counter_mu = std::make_shared<std::mutex>();
  r.def("increment", [counter_mu](at::Tensor self) {
    std::lock_guard<std::mutex> lock(*counter_mu);
    self.add_(1);
    return self.sum().item<double>();
  });
  // Receives RRefs (nested in a list) and sums their values, fetched from their owners.
  r.def("sum_all", [](std::vector<RRef<at::Tensor>> refs) {
    at::Tensor total = refs.at(0).to_here();
    for (size_t i = 1; i < refs.size(); ++i) total = total + refs[i].to_here();
    return total;
  });
  r.def("sum_dict", [](std::unordered_map<std::string, RRef<at::Tensor>> refs) {
    double s = 0;
    for (auto& [k, ref] : refs) s += ref.to_here().sum().item<double>();
    return s;
  });
  r.def("sum_pair", [](std::tuple<int64_t, RRef<at::Tensor>> p) {
    return static_cast<double>(std::get<0>(p)) + std::get<1>(p).to_here().sum().item<double>();
  });
  // Returns an RRef that this worker owns.
  r.def("own", [](double v) {
    return RRef<at::Tensor>::make_local(*current_agent(), at::full_like(at::zeros({2}), v));
  });
  r.def("stash", [stash](RRef<at::Tensor> ref) {
    std::lock_guard<std::mutex> lock(stash->mu);
    stash->held[current_agent()->name()].push_back(ref);
  });
  r.def("unstash", [stash]() {
    std::lock_guard<std::mutex> lock(stash->mu);
    stash->held.erase(current_agent()->name());
  });
  r.def("use_stash", [stash]() {
    std::vector<RRef<at::Tensor>> refs;
    {
      std::lock_guard<std::mutex> lock(stash->mu);
      refs = stash->held[current_agent()->name()];
    }
    double s = 0;
    for (auto& ref : refs) s += ref.to_here().sum().item<double>();
    return s;
  });
  // Passes the stashed RRefs on to `to` (a fork of a fork), then forgets them.
  r.def("forward_stash", [stash](std::string to) {
    std::vector<RRef<at::Tensor>> refs;
    {
      std::lock_guard<std::mutex> lock(stash->mu);
      refs = std::move(stash->held[current_agent()->name()]);
      stash->held.erase(current_agent()->name());
    }
    for (auto& ref : refs) current_agent()->rpc_sync(to, "stash", ref);
  });
}

World make_world(std::shared_ptr<Stash> stash = std::make_shared<Stash>()) {
  return World(
      3, [stash](Registry& r) { define(r, stash); },
      [](AgentOptions& o) { o.num_worker_threads = 4; });
}

// Reference counting is asynchronous: waits until no worker has an RRef
// message (fork, accept, delete, ...) unanswered. After it, what the
// protocol was going to do has been done, and nothing more will happen.
void settle(World& w) {
  for (auto& a : w.agents) {
    INFO(a->name());
    REQUIRE(a->rrefs().wait_idle(5000ms));
  }
}

}  // namespace

TEST_CASE("rref: remote() returns at once, to_here, owner and confirmation") {
  World w = make_world();
  auto t0 = std::chrono::steady_clock::now();
  RRef<at::Tensor> r = remote<at::Tensor>(w[0], "worker1", "sleep_then_ones", 300);
  CHECK(std::chrono::steady_clock::now() - t0 < 200ms);  // did not wait for the value
  CHECK(r.owner().rank == 1);
  CHECK(r.owner().name == "worker1");
  CHECK(r.owner_rank() == 1);
  CHECK(r.owner_name() == "worker1");
  CHECK_FALSE(r.is_owner());
  CHECK(at::equal(r.to_here(), at::ones({1})));
  r.confirmation().wait();
  CHECK(r.confirmed_by_owner());
  CHECK_THROWS_AS(r.local_value(), std::logic_error);
  // 0 B and 1 MiB values
  auto big = remote<at::Tensor>(w[0], "worker2", "ones", 1 << 18);
  CHECK(big.to_here().numel() == (1 << 18));
  r = RRef<at::Tensor>();
  big = RRef<at::Tensor>();
  w.shutdown();
}

TEST_CASE("rref: a local owner reference") {
  World w = make_world();
  auto mine = RRef<at::Tensor>::make_local(w[1], at::arange(4));
  CHECK(mine.is_owner());
  CHECK(mine.confirmed_by_owner());
  CHECK(at::equal(mine.local_value(), at::arange(4)));
  // Handed to another worker, it works there as a user reference.
  at::Tensor back =
      w[1].rpc_sync<at::Tensor>("worker0", "sum_all", std::vector<RRef<at::Tensor>>{mine});
  CHECK(at::equal(back, at::arange(4)));
  mine = RRef<at::Tensor>();
  w.shutdown();
}

TEST_CASE("rref: method proxies run on the owner with the value first") {
  World w = make_world();
  auto r = remote<at::Tensor>(w[0], "worker1", "full", 4, 2.0);
  CHECK(at::allclose(r.rpc_sync<at::Tensor>("scale", 3.0), at::full_like(at::zeros({4}), 6.0)));
  CHECK(r.rpc_async<int64_t>("numel").wait() == 4);
  // A method knows whose request it serves, as any handler does.
  CHECK(r.rpc_sync<std::string>("called_by") == "worker0");
  RRef<at::Tensor> scaled = r.remote<at::Tensor>("scale", 0.5);
  CHECK(scaled.owner_name() == "worker1");
  CHECK(at::allclose(scaled.to_here(), at::ones({4})));
  r = RRef<at::Tensor>();
  scaled = RRef<at::Tensor>();
  w.shutdown();
}

TEST_CASE("rref: RRefs travel as arguments and results, nested in lists, dicts and tuples") {
  World w = make_world();
  auto a = remote<at::Tensor>(w[0], "worker1", "full", 3, 1.0);
  auto b = remote<at::Tensor>(w[0], "worker2", "full", 3, 2.0);
  auto c = RRef<at::Tensor>::make_local(w[0], at::full_like(at::zeros({3}), 4.0));
  // worker2 receives three references: to its own value, to worker1's, to worker0's.
  at::Tensor s =
      w[0].rpc_sync<at::Tensor>("worker2", "sum_all", std::vector<RRef<at::Tensor>>{a, b, c});
  CHECK(at::allclose(s, at::full_like(at::zeros({3}), 7.0)));
  // ... and in a dict.
  std::unordered_map<std::string, RRef<at::Tensor>> named{{"a", a}, {"b", b}};
  CHECK(w[0].rpc_sync<double>("worker1", "sum_dict", named) == 9.0);
  named.clear();
  // ... and in a tuple.
  CHECK(w[0].rpc_sync<double>("worker1", "sum_pair", std::make_tuple(int64_t(1), b)) == 7.0);
  // A result that is an RRef owned by the callee.
  auto owned = w[0].rpc_sync<RRef<at::Tensor>>("worker2", "own", 5.0);
  CHECK(owned.owner_name() == "worker2");
  CHECK(at::allclose(owned.to_here(), at::full_like(at::zeros({2}), 5.0)));
  a = b = c = owned = RRef<at::Tensor>();
  w.shutdown();
}

TEST_CASE("rref: a failed creation raises at first use and never hangs") {
  World w = make_world();
  auto bad = remote<at::Tensor>(w[0], "worker1", "fail", 1);
  CHECK_THROWS_WITH_AS(bad.to_here(), doctest::Contains("no value today"), RemoteError);
  CHECK_THROWS_AS(bad.rpc_sync("numel"), RemoteError);
  CHECK_THROWS_AS(w[0].rpc_sync("worker2", "stash", bad), RemoteError);  // passing it on
  CHECK_FALSE(bad.confirmed_by_owner());
  auto unknown = remote<at::Tensor>(w[0], "worker1", "no_such_function", 1);
  CHECK_THROWS_AS(unknown.to_here(), UnknownFunctionError);
  const int slept = g_slept;
  auto t0 = std::chrono::steady_clock::now();
  auto slow = remote<at::Tensor>(w[0], CallOptions{50ms}, "worker1", "sleep_then_ones", 2000);
  CHECK_THROWS_AS(slow.to_here(), TimeoutError);
  CHECK(std::chrono::steady_clock::now() - t0 < 1500ms);
  bad = unknown = slow = RRef<at::Tensor>();
  // The slow creation finishes on worker1 after its user has let go: then
  // (not before) worker1 drops the value.
  CHECK(eventually([&] { return g_slept == slept + 1; }, 5000ms));
  CHECK(eventually([&] { return w[1].rrefs().owned_values() == 0; }));
  w.shutdown();
}

TEST_CASE("rref: a fork chain survives its root dropping out first") {
  auto stash = std::make_shared<Stash>();
  World w = make_world(stash);
  // worker0 creates the value on worker2 and hands it to worker1 ...
  auto r = remote<at::Tensor>(w[0], "worker2", "full", 2, 3.0);
  w[0].rpc_sync("worker1", "stash", r);
  // ... drops its own reference before anyone used the value ...
  r = RRef<at::Tensor>();
  // ... worker1 forwards its fork back to worker0 and forgets it (a fork of a fork) ...
  w[0].rpc_sync("worker1", "forward_stash", std::string("worker0"));
  settle(w);  // every delete, fork and accept of the above has been answered
  CHECK(w[2].rrefs().owned_values() == 1);
  // ... and the value is still there for the last holder.
  CHECK(w[1].rpc_sync<double>("worker0", "use_stash") == 6.0);
  w[1].rpc_sync("worker0", "unstash");
  w.shutdown();
}

TEST_CASE("rref: many references created and dropped leave the owner's table empty") {
  World w = make_world();
  for (int round = 0; round < 3; ++round) {
    std::vector<RRef<at::Tensor>> refs;
    for (int i = 0; i < 40; ++i) {
      refs.push_back(remote<at::Tensor>(w[i % 2 == 0 ? 0 : 2], "worker1", "ones", 8));
    }
    CHECK(refs.back().to_here().numel() == 8);
    refs.clear();
  }
  w.shutdown();
}

TEST_CASE("rref: concurrent proxies on one RRef from several workers") {
  World w = make_world();
  auto counter = remote<at::Tensor>(w[0], "worker1", "full", 1, 0.0);
  w[0].rpc_sync("worker2", "stash", counter);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        if (t % 2 == 0) {
          counter.rpc_sync<double>("increment");
        } else {
          w[2].rpc_sync("worker2", "use_stash");  // worker2 reads while others write
          counter.rpc_async<double>("increment").wait();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(counter.to_here().item<float>() == 100.0f);
  w[0].rpc_sync("worker2", "unstash");
  counter = RRef<at::Tensor>();
  w.shutdown();
}

TEST_CASE("rref: the owner frees the value exactly when the last reference goes") {
  auto stash = std::make_shared<Stash>();
  World w = make_world(stash);
  g_freed = 0;
  auto r = remote<at::Tensor>(w[0], "worker1", "make_counted", 16);
  r.confirmation().wait();
  w[0].rpc_sync("worker2", "stash", r);  // a second holder
  r = RRef<at::Tensor>();                // the creator lets go
  settle(w);                             // ... and its delete has been answered
  CHECK(g_freed.load() == 0);            // worker2 still holds it
  CHECK(w[1].rrefs().owned_values() == 1);
  w[0].rpc_sync("worker2", "unstash");  // the last reference goes
  CHECK(eventually([] { return g_freed.load() == 1; }));
  CHECK(w[1].rrefs().owned_values() == 0);
  settle(w);
  CHECK(g_freed.load() == 1);  // and exactly once
  w.shutdown();
}

TEST_CASE("rref: a reference whose owner died fails with Disconnected") {
  World w = make_world();
  auto r = remote<at::Tensor>(w[0], "worker1", "ones", 2);
  CHECK(r.to_here().numel() == 2);
  w[1].shutdown(false);
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(r.to_here(), DisconnectedError);
  CHECK_THROWS_AS(r.rpc_sync("numel"), DisconnectedError);
  CHECK(std::chrono::steady_clock::now() - t0 < 1000ms);
  r = RRef<at::Tensor>();  // its delete cannot reach the owner; it gives up
  w.shutdown(false);       // the value stays on the dead worker1: nothing more to check
}

TEST_CASE("rref: graceful shutdown reports user references still alive") {
  World w = make_world();
  auto r = remote<at::Tensor>(w[0], "worker1", "ones", 2);
  r.confirmation().wait();
  try {
    w.shutdown_unchecked(true);  // (shutdown() would first fail the case for the leak)
    FAIL("expected the leak to be reported");
  } catch (const ShutdownError& e) {
    std::string what = e.what();
    CHECK(what.find("worker0") != std::string::npos);
    CHECK(what.find("RRef 0:") != std::string::npos);
    CHECK(what.find("owner worker1") != std::string::npos);
  }
}

TEST_CASE("rref: a message that was never sent leaves no fork behind") {
  World w = make_world();
  auto r = remote<at::Tensor>(w[0], "worker1", "ones", 2);
  r.wait_confirmed();
  // A value that cannot travel after the RRef: the fork made for it is undone.
  CHECK_THROWS_AS(
      w[0].rpc_sync("worker2", "stash",
                    c10::ivalue::Tuple::create(
                        {r.to_ivalue_checked(), c10::IValue(at::ones({2}).to_sparse())})),
      std::invalid_argument);
  // A worker that is gone: the request never leaves.
  w[2].shutdown(false);
  CHECK_THROWS_AS(w[0].rpc_sync("worker2", "stash", r), DisconnectedError);
  // The owner can also fail to send its own RRef.
  auto mine = RRef<at::Tensor>::make_local(w[1], at::ones({1}));
  CHECK_THROWS_AS(w[1].rpc_sync("worker2", "stash", mine), DisconnectedError);
  mine = RRef<at::Tensor>();
  r = RRef<at::Tensor>();
  CHECK(eventually([&] { return w[1].rrefs().owned_values() == 0; }));
  CHECK(eventually([&] { return w[0].rrefs().live_user_refs().empty(); }));
  w[0].shutdown(false);
  w[1].shutdown(false);
}

TEST_CASE("rref: a handle dropped right after an asynchronous use still gets its answer") {
  World w = make_world();
  for (int i = 0; i < 20; ++i) {
    auto r = remote<at::Tensor>(w[0], "worker1", "full", 2, 1.5);
    auto value = r.to_here_async();
    auto scaled = r.rpc_async<at::Tensor>("scale", 2.0);
    auto derived = r.remote<at::Tensor>("scale", 4.0);
    r = RRef<at::Tensor>();
    CHECK(at::allclose(value.wait(), at::full_like(at::zeros({2}), 1.5)));
    CHECK(at::allclose(scaled.wait(), at::full_like(at::zeros({2}), 3.0)));
    CHECK(at::allclose(derived.to_here(), at::full_like(at::zeros({2}), 6.0)));
  }
  w.shutdown();
}

TEST_CASE("rref: everyone shutting down together after passing references on frees the value") {
  for (int round = 0; round < 8; ++round) {
    CAPTURE(round);
    auto stash = std::make_shared<Stash>();
    World w = make_world(stash);
    {
      auto r = remote<at::Tensor>(w[0], "worker2", "ones", 2);
      w[0].rpc_sync("worker1", "stash", r);
    }  // worker0 lets go at once; worker1's fork is still being registered
    w[0].rpc_sync("worker1", "unstash");
    // At once, while the deletes are still on their way: graceful shutdown
    // waits for them, so the owner has let the value go when it returns.
    std::vector<std::thread> threads;
    std::vector<std::string> errors(3);
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back([&, r] {
        try {
          w[r].shutdown(true);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 3; ++r) {
      CHECK_MESSAGE(errors[r].empty(), errors[r]);
      CHECK(w[r].rrefs().live_user_refs().empty());
      CHECK(w[r].rrefs().owned_values() == 0);
    }
    w.agents.clear();
  }
}

TEST_CASE("rref: a delete that overtakes its fork or create does not resurrect it") {
  // Drive the owner's protocol directly, in the order a busy pool may run it.
  World w = make_world();
  // Control messages carry ids as (worker, local) tuples.
  auto id = [](int64_t local) { return to_ivalue(std::make_tuple(int64_t(0), local)); };
  auto del = [&](int64_t rref, int64_t fork) {
    w[0].call("worker1", "tandem.rref.delete", {to_ivalue(std::vector<int64_t>{0, rref, 0, fork})})
        .wait();
  };
  del(1000, 1001);
  w[0].call("worker1", "tandem.rref.fork", {id(1000), id(1001)}).wait();
  CHECK(w[1].rrefs().owned_values() == 0);
  del(2000, 2000);
  c10::impl::GenericList no_args(c10::AnyType::get());
  std::vector<c10::IValue> create{id(2000), id(2000), std::string("ones"), c10::IValue(),
                                  c10::IValue(no_args)};
  CHECK_THROWS_WITH_AS(w[0].call("worker1", "tandem.rref.create", create).wait(),
                       doctest::Contains("deleted before its creation"), RemoteError);
  // Malformed control messages are refused, naming what was wrong.
  CHECK_THROWS_WITH_AS(w[0].call("worker1", "tandem.rref.fork", {id(1), int64_t(5)}).wait(),
                       doctest::Contains("argument 2 of 'tandem.rref.fork'"), RemoteError);
  CHECK_THROWS_WITH_AS(w[0].call("worker1", "tandem.rref.fetch",
                                 {to_ivalue(std::make_tuple(int64_t(9), int64_t(1)))})
                           .wait(),
                       doctest::Contains("worker 9 is outside the world"), RemoteError);
  CHECK_THROWS_WITH_AS(
      w[0].call("worker1", "tandem.rref.delete", {to_ivalue(std::vector<int64_t>{0, 1, 0})}).wait(),
      doctest::Contains("not a multiple of 4"), RemoteError);
  CHECK(w[1].rrefs().owned_values() == 0);
  w.shutdown();
}

TEST_CASE("rref: a request for a value its owner never had is dropped, not kept") {
  World w(
      2, [](Registry& r) { define(r, std::make_shared<Stash>()); },
      [](AgentOptions& o) { o.rpc_timeout = 300ms; });
  auto f = w[0].call("worker1", "tandem.rref.fetch",
                     {to_ivalue(std::make_tuple(int64_t(0), int64_t(4242)))}, 50ms);
  CHECK_THROWS_AS(f.wait(), TimeoutError);
  CHECK(w[1].rrefs().owned_values() == 1);  // a placeholder, in case the create is late
  CHECK(eventually([&] { return w[1].rrefs().owned_values() == 0; }, 2000ms));
  w.shutdown();
}
