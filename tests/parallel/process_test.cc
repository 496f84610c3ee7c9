// Tensor-parallel ranks in processes of their own: one that dies fails the
// others' collectives, in forward or in backward, naming it.
#include "test_util.h"

#include <ATen/ops/randn.h>
#include <ATen/ops/sum.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "tandem/ddp/process_group.h"
#include "tandem/parallel/collectives.h"
#include "tandem/rpc/api.h"

using namespace tandem;
using namespace std::chrono_literals;

TEST_CASE("parallel process: a tp rank that dies before backward fails the others' backward") {
  ::setenv("TANDEM_TEST_WITH_RPC", "1", 1);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string out = test::run_direct_job("rank2_dies_before_backward", 3);
  ::unsetenv("TANDEM_TEST_WITH_RPC");
  INFO(out);
  CHECK(std::chrono::steady_clock::now() - t0 < 40s);
  CHECK(out.find("[2] exit 7") != std::string::npos);
  for (int r : {0, 1}) {
    const std::string line = test::line_of(out, "[" + std::to_string(r) + "] worker failed");
    CAPTURE(line);
    CHECK(line.find("all_reduce(sum) on rank " + std::to_string(r) + " of 3 failed") !=
          std::string::npos);
    CHECK(line.find("rank 2 (worker \"worker2\", pid ") != std::string::npos);
    CHECK(line.find("is gone (its process exited)") != std::string::npos);
    CHECK(out.find("[" + std::to_string(r) + "] forward done") != std::string::npos);
    CHECK(out.find("[" + std::to_string(r) + "] exit 2") != std::string::npos);
  }
}

namespace tandem::test {

// A worker process of this binary (TANDEM_TEST_WORKER=mode; see main.cc).
//   "rank2_dies_before_backward": three tp ranks run a column- then
//          row-parallel product forward; rank 2 exits abruptly before
//          backward, whose first collective (copy_to_region's all-reduce)
//          then fails on the others (printed by the catch).
int worker_main(const std::string& mode) {
  try {
    const bool with_rpc = std::getenv("TANDEM_TEST_WITH_RPC") != nullptr;
    if (with_rpc) rpc::init(std::make_shared<rpc::Registry>());
    ddp::init_process_group("gloo", "env://", -1, -1, 30s);
    auto tp = ddp::default_group_ptr();
    if (mode == "rank2_dies_before_backward") {
      at::manual_seed(tp->rank());
      at::Tensor x = at::randn({4, 8}).requires_grad_();
      at::Tensor w1 = at::randn({6, 8}).requires_grad_();  // this rank's rows of a [18, 8]
      at::Tensor w2 = at::randn({8, 6}).requires_grad_();  // its columns of an [8, 18]
      at::Tensor h = at::linear(parallel::copy_to_region(x, tp), w1).tanh();
      at::Tensor y = parallel::reduce_from_region(at::linear(h, w2), tp);
      std::printf("forward done\n");
      std::fflush(stdout);
      if (tp->rank() == 2) std::_Exit(7);
      at::sum(y).backward();
      std::printf("backward done\n");
    }
    ddp::destroy_process_group();
    if (with_rpc) rpc::shutdown(true);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker failed: %s\n", e.what());
    std::fflush(stderr);
    return 2;
  }
}

}  // namespace tandem::test
