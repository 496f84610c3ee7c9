// Process groups across real worker processes: env:// under tandem-run (with
// and without an RPC agent at the same MASTER_PORT), and a rank that dies.
#include "ddp_support.h"

#include <signal.h>

#include <cstdio>
#include <cstdlib>

#include <ATen/ops/sum.h>
#include <torch/nn/modules/linear.h>

#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/rpc/api.h"

using namespace tandem;
using namespace std::chrono_literals;

namespace {

void expect_sums(const std::string& env) {
  test::RunResult r = test::run_command(env + " TANDEM_TEST_WORKER=sum " + TANDEM_RUN_PATH +
                                        " --nproc-per-node 3 " + support::self_exe());
  INFO(r.output);
  CHECK(r.status == 0);
  for (int rank = 0; rank < 3; ++rank) {
    CHECK(r.output.find("[" + std::to_string(rank) + "]: rank " + std::to_string(rank) +
                        " of 3 sum 6") != std::string::npos);
  }
}

// The test's own rank (0 of 2) in a group with `child`.
std::shared_ptr<ddp::ProcessGroup> parent_group(test::ChildWorker& child) {
  ddp::ProcessGroupOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.timeout = 30s;
  o.store = child.store;
  return ddp::ProcessGroup::create(o);
}

}  // namespace

TEST_CASE("ddp process: init_process_group from tandem-run's environment") { expect_sums(""); }

TEST_CASE("ddp process: a process group and an RPC agent share the job's MASTER_PORT") {
  expect_sums("TANDEM_TEST_WITH_RPC=1");
}

TEST_CASE("ddp process: a rank that dies fails the others' collective, not hangs it") {
  test::ChildWorker child("join_then_die");
  auto pg = parent_group(child);
  child.expect_exit(7);
  at::Tensor t = at::ones({1024});
  auto t0 = std::chrono::steady_clock::now();
  std::string err;
  try {
    pg->all_reduce(t);
  } catch (const ddp::CollectiveError& e) {
    err = e.what();
  }
  CHECK(err.find("all_reduce(sum) on rank 0 of 2 failed") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  INFO(err);
}

TEST_CASE("ddp process: a rank killed mid-training fails the others' backward, not hangs it") {
  test::ChildWorker child("ddp_then_die");
  auto pg = parent_group(child);
  // Gloo's writes to the dead peer must fail the collective, not kill us.
  struct sigaction pipe {};
  REQUIRE(::sigaction(SIGPIPE, nullptr, &pipe) == 0);
  const bool ignored = pipe.sa_handler == SIG_IGN;
  CHECK(ignored);
  torch::nn::Linear fc(4, 4);
  ddp::DistributedDataParallel net(fc, {}, pg);
  child.expect_exit(7);
  auto t0 = std::chrono::steady_clock::now();
  std::string err = test::error_of([&] { at::sum(net(at::ones({2, 4}))).backward(); });
  INFO(err);
  CHECK(err.find("all_reduce(sum) on rank 0 of 2 failed") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
}

TEST_CASE("ddp process: rank 2 of 3 killed in its all-reduce: the others' errors name it") {
  // With RPC agents beside the group (so the errors name workers), and
  // without (the ranks alone).
  for (const bool with_rpc : {true, false}) {
    CAPTURE(with_rpc);
    ::setenv("TANDEM_TEST_WITH_RPC", with_rpc ? "1" : "", 1);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string out = test::run_direct_job("rank2_dies_in_allreduce", 3);
    ::unsetenv("TANDEM_TEST_WITH_RPC");
    INFO(out);
    CHECK(std::chrono::steady_clock::now() - t0 < 30s);
    CHECK(out.find("[2] exit 7") != std::string::npos);
    for (int r : {0, 1}) {
      const std::string line = test::line_of(out, "[" + std::to_string(r) + "] worker failed");
      CAPTURE(line);
      CHECK(line.find("all_reduce(sum) on rank " + std::to_string(r) + " of 3 failed: rank 2 (") !=
            std::string::npos);
      CHECK(line.find(with_rpc ? "(worker \"worker2\", pid " : "(pid ") != std::string::npos);
      CHECK(line.find("is gone (its process exited)") != std::string::npos);
      CHECK(line.find("timeout") == std::string::npos);  // nothing timed out
      CHECK(out.find("[" + std::to_string(r) + "] exit 2") != std::string::npos);
    }
  }
}

TEST_CASE("ddp process: rank 2 of 3 stopped in its all-reduce: the others fail, naming it") {
  // Its process is alive (SIGSTOP, as a debugger or a frozen container does) and
  // killed 10 s later; the others' group timeout is 30 s. Their RPC agents
  // (peer timeout 2 s) find it silent, and their collective fails then.
  ::setenv("TANDEM_TEST_WITH_RPC", "1", 1);
  ::setenv("TANDEM_PEER_TIMEOUT", "2", 1);
  const std::string out = test::run_direct_job("rank2_stops_in_allreduce", 3);
  ::unsetenv("TANDEM_TEST_WITH_RPC");
  ::unsetenv("TANDEM_PEER_TIMEOUT");
  INFO(out);
  for (int r : {0, 1}) {
    const std::string line = test::line_of(out, "[" + std::to_string(r) + "] worker failed");
    CAPTURE(line);
    CHECK(line.find("all_reduce(sum) on rank " + std::to_string(r) +
                    " of 3 failed: rank 2 (worker \"worker2\", pid ") != std::string::npos);
    CHECK(line.find(") is stalled: ") != std::string::npos);
    CHECK(line.find("stopped or stalled") != std::string::npos);
    const std::string took = test::line_of(out, "[" + std::to_string(r) + "] failed after ms=");
    CAPTURE(took);
    REQUIRE(!took.empty());
    const long ms = std::atol(took.c_str() + took.find('=') + 1);
    CHECK(ms >= 1500);
    CHECK(ms < 8000);  // the kill comes at 10 s
    CHECK(out.find("[" + std::to_string(r) + "] exit 2") != std::string::npos);
  }
}

namespace tandem::test {

// A worker process of this binary (TANDEM_TEST_WORKER=mode; see main.cc).
//   "sum": joins the default group through env:// and all-reduces its rank + 1,
//          printing the sum; with an RPC agent at the same MASTER_PORT when
//          TANDEM_TEST_WITH_RPC is set (the two share the store).
//   "join_then_die": joins, then exits abruptly in its first collective's place.
//   "ddp_then_die": wraps a model in DDP (a collective with the test), then
//          exits abruptly before its first backward.
//   "rank2_dies_in_allreduce": rank 2 exits abruptly where its all-reduce
//          would be; the others' all-reduce fails (printed by the catch).
//   "rank2_stops_in_allreduce": rank 2 stops itself (SIGSTOP) there, and is
//          killed 10 s later; the others print how long theirs took to fail.
int worker_main(const std::string& mode) {
  try {
    bool with_rpc = std::getenv("TANDEM_TEST_WITH_RPC") != nullptr;
    if (const char* w = std::getenv("TANDEM_TEST_WITH_RPC"); !w || !*w) with_rpc = false;
    if (with_rpc) rpc::init(std::make_shared<rpc::Registry>());
    ddp::init_process_group("gloo", "env://", -1, -1, 30s);
    if (mode == "join_then_die") std::_Exit(7);
    if (mode == "ddp_then_die") {
      torch::nn::Linear fc(4, 4);
      ddp::DistributedDataParallel net(fc);
      std::_Exit(7);
    }
    at::Tensor t = at::full_like(at::zeros({4}), ddp::get_rank() + 1);
    if (mode == "rank2_dies_in_allreduce") {
      if (ddp::get_rank() == 2) std::_Exit(7);
      t = at::ones({1 << 16});
    }
    if (mode == "rank2_stops_in_allreduce") {
      ddp::barrier();  // every rank's watch is up
      if (ddp::get_rank() == 2) {
        const std::string kill_later =
            "(sleep 10; kill -KILL " + std::to_string(::getpid()) + ") >/dev/null 2>&1 &";
        if (std::system(kill_later.c_str()) != 0) return 3;
        ::raise(SIGSTOP);
      }
      const auto t0 = std::chrono::steady_clock::now();
      try {
        ddp::all_reduce(t);
      } catch (const std::exception&) {
        std::printf("failed after ms=%lld\n",
                    static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                               std::chrono::steady_clock::now() - t0)
                                               .count()));
        std::fflush(stdout);
        throw;
      }
    }
    ddp::all_reduce(t);
    std::printf("rank %d of %d sum %g\n", ddp::get_rank(), ddp::get_world_size(),
                t[0].item<double>());
    std::fflush(stdout);
    ddp::barrier();
    ddp::destroy_process_group();
    if (with_rpc) rpc::shutdown(true);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker failed: %s\n", e.what());
    return 2;
  }
}

}  // namespace tandem::test
