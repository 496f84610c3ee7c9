// Workers on hosts of their own: Linux network namespaces joined by a veth
// pair, each end with its own address, so that traffic crosses a real
// (virtual) link and not loopback. Needs root and iproute2; without them the
// cases say "skipped: ..." and ctest reports them skipped.
#include "test_util.h"

#include <spawn.h>
#include <unistd.h>

#include <cstdlib>

#include "tandem/autograd/autograd.h"
#include "tandem/rpc/api.h"

using namespace tandem;
using namespace tandem::rpc;
using namespace std::chrono_literals;

extern char** environ;

namespace {

bool sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }

// Two hosts: `left` and `right`, each a network namespace with one end of a
// veth pair (10.231.0.1 and 10.231.0.2). With `left_is_here`, the left end
// stays in this process's own namespace, so the test itself is a host.
struct Hosts {
  explicit Hosts(bool left_is_here) {
    const std::string id = std::to_string(::getpid());
    left = left_is_here ? "" : "tandem-l" + id;
    right = "tandem-r" + id;
    left_if = "tdl" + id;
    right_if = "tdr" + id;
    ok = ::geteuid() == 0 && sh("command -v ip");
    if (!ok) return;
    ok = (left.empty() || sh("ip netns add " + left)) && sh("ip netns add " + right) &&
         sh("ip link add " + left_if + " type veth peer name " + right_if) &&
         (left.empty() || sh("ip link set " + left_if + " netns " + left)) &&
         sh("ip link set " + right_if + " netns " + right) &&
         sh(in(left) + "ip addr add 10.231.0.1/24 dev " + left_if) &&
         sh(in(left) + "ip link set " + left_if + " up") &&
         sh(in(right) + "ip addr add 10.231.0.2/24 dev " + right_if) &&
         sh(in(right) + "ip link set " + right_if + " up") &&
         (left.empty() || sh(in(left) + "ip link set lo up")) &&
         sh(in(right) + "ip link set lo up");
  }
  ~Hosts() {
    sh("ip link del " + left_if);  // here, if it stayed here (and not cut already)
    if (!left.empty()) sh("ip netns del " + left);
    sh("ip netns del " + right);
  }
  Hosts(const Hosts&) = delete;
  Hosts& operator=(const Hosts&) = delete;

  // The prefix that runs a command on host `ns` ("" is here).
  static std::string in(const std::string& ns) {
    return ns.empty() ? "" : "ip netns exec " + ns + " ";
  }
  // Cuts the link: the veth pair goes, both ends at once.
  void cut() { sh(in(left) + "ip link del " + left_if); }

  bool ok = false;
  std::string left, right, left_if, right_if;
};

bool skipped(const Hosts& h) {
  if (h.ok) return false;
  std::printf("skipped: network namespaces (root and iproute2's ip netns) not permitted here\n");
  return true;
}

}  // namespace

TEST_CASE("hosts: a two-node job on addresses of its own trains, and requires the token") {
  Hosts h(/*left_is_here=*/false);
  if (skipped(h)) return;
  auto node = [&](const std::string& ns, int node_rank, const std::string& token) {
    return Hosts::in(ns) + "env TANDEM_TOKEN=" + token +
           " TANDEM_TEST_WORKER=launch TANDEM_TEST_INIT_TIMEOUT_MS=20000 " + TANDEM_RUN_PATH +
           " --nnodes 2 --node-rank " + std::to_string(node_rank) +
           " --master-addr 10.231.0.1 --master-port 29400 --nproc-per-node 2 " +
           support::self_exe();
  };
  auto run_both = [&](const std::string& right_token) {
    test::RunResult a, b;
    std::thread left([&] { a = test::run_command(node(h.left, 0, "job-token")); });
    b = test::run_command(node(h.right, 1, right_token));
    left.join();
    return std::make_pair(a, b);
  };
  SUBCASE("with the same token, every rank calls the next across the link") {
    auto [a, b] = run_both("job-token");
    INFO(a.output << "\n----\n" << b.output);
    CHECK(a.status == 0);
    CHECK(b.status == 0);
    for (int rank = 0; rank < 4; ++rank) {
      const std::string line =
          "rank " + std::to_string(rank) + " of 4 (local " + std::to_string(rank % 2) + ") ok";
      CHECK((rank < 2 ? a : b).output.find(line) != std::string::npos);
    }
  }
  SUBCASE("a model split across the two hosts trains as it does in one process") {
    const std::string bin =
        std::string(TANDEM_RUN_PATH).substr(0, std::string(TANDEM_RUN_PATH).rfind('/'));
    auto mlp = [&](const std::string& ns, int node_rank) {
      return Hosts::in(ns) + "env TANDEM_TOKEN=job-token " + TANDEM_RUN_PATH +
             " --nnodes 2 --node-rank " + std::to_string(node_rank) +
             " --master-addr 10.231.0.1 --master-port 29402 --nproc-per-node 1 " + bin +
             "/model_parallel_mlp --steps 10";
    };
    test::RunResult a, b;
    std::thread left([&] { a = test::run_command(mlp(h.left, 0)); });
    b = test::run_command(mlp(h.right, 1));
    left.join();
    INFO(a.output << "\n----\n" << b.output);
    CHECK(a.status == 0);
    CHECK(b.status == 0);
    CHECK(a.output.find("final parameters agree with") != std::string::npos);
  }
  SUBCASE("a node with another token is refused in the handshake") {
    auto [a, b] = run_both("another-token");
    INFO(a.output << "\n----\n" << b.output);
    CHECK(a.status != 0);
    CHECK(b.status != 0);
    CHECK((a.output + b.output).find("did not prove the cluster token") != std::string::npos);
  }
}

TEST_CASE(
    "hosts: cutting a host's link fails calls and a distributed backward with DisconnectedError") {
  Hosts h(/*left_is_here=*/true);
  if (skipped(h)) return;
  // This process is worker 0 on 10.231.0.1 and hosts the store there;
  // worker 1 serves from the other host.
  const int port = 29401;
  std::vector<std::string> env = support::worker_env(1, 2, port);
  env[2] = "MASTER_ADDR=10.231.0.1";
  env.push_back("TANDEM_TEST_WORKER=serve");
  env.push_back("TANDEM_TEST_INIT_TIMEOUT_MS=30000");
  std::vector<std::string> all;
  for (char** e = environ; *e; ++e) all.emplace_back(*e);
  all.insert(all.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& s : all) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string ip = "ip", netns = "netns", exec = "exec", exe = support::self_exe();
  char* argv[] = {ip.data(), netns.data(), exec.data(), h.right.data(), exe.data(), nullptr};
  pid_t pid = -1;
  REQUIRE(::posix_spawnp(&pid, "ip", nullptr, nullptr, argv, envp.data()) == 0);

  AgentOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.init_method = "tcp://10.231.0.1:" + std::to_string(port);
  o.rpc_timeout = 60s;
  o.init_timeout = 30s;
  auto agent = Agent::create(o, std::make_shared<Registry>());
  CHECK(agent->info().host == "10.231.0.1");
  CHECK(agent->get_worker_info("worker1").host == "10.231.0.2");
  CHECK(agent->rpc_sync<int64_t>("worker1", "pid") > 0);
  auto in_flight = agent->rpc_async<int64_t>("worker1", "sleep_ms", 50000);
  {
    // A forward across the link, recorded in a context; its backward runs
    // after the cut.
    autograd::Context ctx(*agent);
    at::Tensor x = at::ones({4}).requires_grad_();
    at::Tensor y = agent->rpc_sync<at::Tensor>("worker1", "add", x, x);
    h.cut();
    // Nothing comes back from a vanished host: keepalive (idle 10 s, 3 probes
    // 2 s apart) and the user timeout (16 s for unacknowledged data) notice.
    auto t0 = std::chrono::steady_clock::now();
    std::string backward_error;
    std::thread backward([&] {
      try {
        autograd::backward(*agent, ctx.id(), {y.sum()});
      } catch (const DisconnectedError& e) {
        backward_error = e.what();
      } catch (const std::exception& e) {
        backward_error = std::string("not a DisconnectedError: ") + e.what();
      }
    });
    CHECK_THROWS_AS(agent->rpc_sync<int64_t>("worker1", "pid"), DisconnectedError);
    CHECK_THROWS_AS(in_flight.wait(), DisconnectedError);
    backward.join();
    const auto took = std::chrono::steady_clock::now() - t0;
    MESSAGE("calls and backward failed " << std::chrono::duration<double>(took).count()
                                         << " s after the cut: " << backward_error);
    CHECK(backward_error.find("worker1") != std::string::npos);
    CHECK(backward_error.find("not a DisconnectedError") == std::string::npos);
    CHECK(took < 25s);
  }
  agent->shutdown(false);
  agent = nullptr;
  ::kill(pid, SIGKILL);
  support::wait_exit(pid);
}
