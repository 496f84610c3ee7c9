// Liveness: a worker that is alive but stalled (stopped, frozen) is told from
// a slow one by its silence, within AgentOptions::peer_timeout, on every
// transport; a busy or idle one is not.
#include "test_util.h"

#include <signal.h>

#include "tandem/rpc/agent/testing.h"

using namespace tandem;
using namespace tandem::rpc;
using namespace std::chrono_literals;

namespace {

std::shared_ptr<Agent> parent_of(test::ChildWorker& child, const std::string& transport,
                                 std::chrono::milliseconds peer_timeout) {
  AgentOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.rpc_timeout = 60s;
  o.peer_timeout = peer_timeout;
  o.transport_mode = transport;
  return Agent::create(o, std::make_shared<Registry>(), child.store);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("liveness: a stopped worker fails the calls to it within the peer timeout") {
  for (const char* transport : {"tcp", "shm"}) {
    CAPTURE(transport);
    test::ChildWorker child("serve");  // its own peer timeout: the default, 30 s
    auto agent = parent_of(child, transport, 3s);
    REQUIRE(agent->rpc_sync<int64_t>("worker1", "pid") == child.pid);
    CHECK(agent->transport_to("worker1") == transport);

    // Busy is not stalled: a handler that runs longer than the timeout
    // answers (its worker's loop thread sends heartbeats meanwhile).
    CHECK(agent->rpc_sync<int64_t>("worker1", "sleep_ms", int64_t(4500)) == 4500);
    // Nor is idle: nothing asked for longer than the timeout.
    std::this_thread::sleep_for(3500ms);
    CHECK(agent->stalled("worker1").empty());
    CHECK(agent->transport_stats().stalled_peers == 0);
    CHECK(agent->transport_stats().heartbeats > 0);
    CHECK(agent->rpc_sync<int64_t>("worker1", "pid") == child.pid);

    // Stopped is stalled: the call in flight fails, naming why.
    auto f = agent->rpc_async<int64_t>("worker1", "sleep_ms", int64_t(30000));
    REQUIRE(::kill(child.pid, SIGSTOP) == 0);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string error = test::error_of([&] { f.wait(); });
    const double took = seconds_since(t0);
    CHECK(error.find("connection to worker1 lost during 'sleep_ms'") != std::string::npos);
    CHECK(error.find("its process is stopped or stalled") != std::string::npos);
    // (its last heartbeat may have come up to a beat before the stop)
    CHECK(took >= 1.5);
    CHECK(took < 6.0);
    CHECK(agent->stalled("worker1").find("stopped or stalled") != std::string::npos);
    CHECK(agent->transport_stats().stalled_peers == 1);
    CHECK(rpc::testing::pending_calls(*agent) == 0);

    // Continued, it answers again on a new connection, and is no longer stalled.
    REQUIRE(::kill(child.pid, SIGCONT) == 0);
    CHECK(agent->rpc_sync<int64_t>("worker1", "pid") == child.pid);
    CHECK(agent->stalled("worker1").empty());
    CHECK_THROWS_AS(agent->stalled("worker7"), std::invalid_argument);
    agent->shutdown(false);
    agent = nullptr;
  }
}

TEST_CASE("liveness: a worker that judges nobody still sends heartbeats to one that does") {
  ::setenv("TANDEM_PEER_TIMEOUT", "0", 1);  // the child's: never
  test::ChildWorker child("serve");
  ::unsetenv("TANDEM_PEER_TIMEOUT");
  auto agent = parent_of(child, "auto", 2s);
  REQUIRE(agent->rpc_sync<int64_t>("worker1", "pid") == child.pid);
  std::this_thread::sleep_for(3500ms);  // idle, longer than this side's timeout
  CHECK(agent->stalled("worker1").empty());
  CHECK(agent->transport_stats().stalled_peers == 0);
  CHECK(agent->rpc_sync<int64_t>("worker1", "pid") == child.pid);
  agent->shutdown(false);
  agent = nullptr;
}

TEST_CASE("liveness: a graceful shutdown waiting for a stopped worker fails, naming it") {
  // A worker this one never called (no connection to watch), stopped
  // before it reaches shutdown: the barrier's probe dials it, and its
  // silence names it.
  test::ChildWorker other("hang");  // serves, never reaches shutdown
  AgentOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.peer_timeout = 3s;
  o.init_timeout = 120s;  // what the barrier would wait out
  auto agent = Agent::create(o, std::make_shared<Registry>(), other.store);
  REQUIRE(::kill(other.pid, SIGSTOP) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(agent->shutdown(true),
                       doctest::Contains("gone before reaching shutdown: worker1 ("),
                       DisconnectedError);
  CHECK(seconds_since(t0) < 15.0);
  ::kill(other.pid, SIGCONT);
  agent = nullptr;
}

TEST_CASE("liveness: the peer timeout is checked") {
  test::ChildWorker child("serve");
  for (const auto& [timeout, message] :
       std::vector<std::pair<std::chrono::milliseconds, std::string>>{
           {1500ms, "peer_timeout 1500 ms is too short: 0 (never) or at least 2000 ms"},
           {-5ms, "peer_timeout must be"}}) {
    CAPTURE(timeout.count());
    AgentOptions o;
    o.rank = 0;
    o.world_size = 2;
    o.peer_timeout = timeout;
    o.init_timeout = 2s;
    CHECK_THROWS_WITH_AS(Agent::create(o, std::make_shared<Registry>(), child.store),
                         doctest::Contains(message.c_str()), std::invalid_argument);
  }
  ::setenv("TANDEM_PEER_TIMEOUT", "soon", 1);
  AgentOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.init_timeout = 2s;
  CHECK_THROWS_WITH_AS(Agent::create(o, std::make_shared<Registry>(), child.store),
                       doctest::Contains("TANDEM_PEER_TIMEOUT 'soon' is not a number of seconds"),
                       std::invalid_argument);
  ::unsetenv("TANDEM_PEER_TIMEOUT");
}
