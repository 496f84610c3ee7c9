// Agents over the fault-injecting transport: lost replies, lost RRef control
// messages, cut connections and duplicated requests, each failing or
// recovering the way the contract says, with nothing leaked.
#include "test_util.h"

#include <atomic>

#include "tandem/rpc/api.h"
#include "tandem/rpc/rref.h"
#include "tandem/rpc/transport/faulty/faulty_transport.h"

using namespace tandem;
using namespace tandem::rpc;
using namespace std::chrono_literals;
using test::eventually;
using test::World;

namespace {

std::atomic<int> g_runs{0};

struct Held {
  std::mutex mu;
  std::vector<RRef<at::Tensor>> refs;
};
Held& held() {
  static Held h;
  return h;
}

void define(Registry& r) {
  r.def("echo", [](int64_t x) { return x; });
  r.def("count", [](int64_t x) {
    ++g_runs;
    return x;
  });
  r.def("ones", [](int64_t n) { return at::ones({n}); });
  r.def("keep", [](RRef<at::Tensor> ref) {
    std::lock_guard<std::mutex> lock(held().mu);
    held().refs.push_back(ref);
  });
  r.def("release", []() {
    std::lock_guard<std::mutex> lock(held().mu);
    held().refs.clear();
  });
}

// Every agent of the world sends through `plan`; calls time out after 400 ms.
World faulty_world(int n, const std::shared_ptr<FaultPlan>& plan) {
  return World(n, define, [plan](AgentOptions& o) {
    o.transport = faulty_transport(plan);
    o.rpc_timeout = 400ms;
  });
}

// A lost RRef message is retried after a while: how long to wait for its effect.
constexpr auto kRetried = 8000ms;

}  // namespace

TEST_CASE("fault: a lost reply fails the call at its timeout, the next call goes through") {
  auto plan = std::make_shared<FaultPlan>();
  plan->add({Fault::kDrop, MessageKind::kResponse});
  World w = faulty_world(2, plan);
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(w[0].rpc_sync<int64_t>("worker1", "echo", 1), doctest::Contains("timed out"),
                       TimeoutError);
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 390ms);
  CHECK(took < 2000ms);
  CHECK(plan->hits(0) == 1);
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 2) == 2);
  CHECK(testing::pending_calls(w[0]) == 0);
  w.shutdown();
}

TEST_CASE("fault: RRef fork, accept and delete messages lost once are retried, nothing leaks") {
  auto plan = std::make_shared<FaultPlan>();
  plan->add({Fault::kDrop, MessageKind::kRequest, "tandem.rref.fork"});
  plan->add({Fault::kDrop, MessageKind::kRequest, "tandem.rref.child_accept"});
  plan->add({Fault::kDrop, MessageKind::kRequest, "tandem.rref.delete"});
  World w = faulty_world(3, plan);
  {
    // worker0 creates the value on worker2 and hands its (user) reference
    // to worker1: worker1 asks the owner to add its fork (lost once), then
    // tells worker0 it may let go (lost once).
    auto r = remote<at::Tensor>(w[0], "worker2", "ones", 3);
    w[0].rpc_sync("worker1", "keep", r);
    CHECK(eventually([&] { return plan->hits(0) == 1 && plan->hits(1) == 1; }, kRetried));
    CHECK(at::equal(r.to_here(), at::ones({3})));
    w[0].rpc_sync("worker1", "release");
  }
  // Both references are gone: their deletes (the first lost) reach the owner.
  CHECK(eventually([&] { return w[2].rrefs().owned_values() == 0; }, kRetried));
  CHECK(plan->hits(2) == 1);
  for (int r = 0; r < 3; ++r) {
    INFO("worker" << r);
    CHECK(eventually([&] { return w[r].rrefs().live_user_refs().empty(); }, kRetried));
  }
  w.shutdown();  // graceful: would throw naming any reference still alive
}

TEST_CASE("fault: a connection cut under a call fails it with Disconnected, the next reconnects") {
  auto plan = std::make_shared<FaultPlan>();
  plan->add({Fault::kCut, MessageKind::kRequest, "echo"});
  World w = faulty_world(2, plan);
  CHECK_THROWS_AS(w[0].rpc_sync<int64_t>("worker1", "echo", 1), DisconnectedError);
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 2) == 2);
  CHECK(testing::pending_calls(w[0]) == 0);
  w.shutdown();
}

TEST_CASE("fault: a duplicated request runs twice, but its caller completes once") {
  auto plan = std::make_shared<FaultPlan>();
  plan->add({Fault::kDuplicate, MessageKind::kRequest, "count"});
  World w = faulty_world(2, plan);
  g_runs = 0;
  CHECK(w[0].rpc_sync<int64_t>("worker1", "count", 7) == 7);
  CHECK(eventually([] { return g_runs == 2; }));
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 8) == 8);  // the late second reply was dropped
  CHECK(testing::pending_calls(w[0]) == 0);
  w.shutdown();
}
