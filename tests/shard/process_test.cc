// The sharded stages across real worker processes: a rank killed mid-step.
#include <ATen/ops/ones.h>
#include <ATen/ops/sum.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <cstdlib>

#include "ddp/ddp_support.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/ddp/fully_sharded.h"
#include "tandem/optim/zero_redundancy_optimizer.h"

using namespace tandem;
using namespace std::chrono_literals;

TEST_CASE("zero process: rank 2 of 3 killed mid-step: the others fail within seconds naming it") {
  // Stage 1: rank 2 dies after its backward, where its step would be, so
  // the others fail in the broadcasts of the parameters (over Gloo). Stage 2: it dies
  // before its backward, so they fail in a bucket's reduce-scatter.
  // Stage 3: it dies before its forward, so they fail in a unit's all-gather.
  for (const std::string mode : {"zero1_rank2_dies_in_step", "zero2_rank2_dies_in_backward",
                                 "zero3_rank2_dies_in_forward"}) {
    CAPTURE(mode);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string out = test::run_direct_job(mode, 3);
    INFO(out);
    CHECK(std::chrono::steady_clock::now() - t0 < 30s);
    CHECK(out.find("[2] exit 7") != std::string::npos);
    // Stage 2: whichever collective of the step a survivor was in (the
    // buckets' order broadcast at forward, or a reduce-scatter).
    // Stage 1: one of the broadcasts of the parameters, from whichever rank.
    const std::string what = mode[4] == '3' ? "all_gather on rank " : " on rank ";
    for (int r : {0, 1}) {
      const std::string line = test::line_of(out, "[" + std::to_string(r) + "] worker failed");
      CAPTURE(line);
      CHECK(line.find(what + std::to_string(r) + " of 3 failed: rank 2 (pid ") !=
            std::string::npos);
      CHECK(line.find("is gone (its process exited)") != std::string::npos);
      if (mode[4] == '1') CHECK(line.find("broadcast from rank ") != std::string::npos);
      CHECK(out.find("[" + std::to_string(r) + "] exit 2") != std::string::npos);
    }
  }
}

namespace tandem::test {

// A worker process of this binary (TANDEM_TEST_WORKER=mode; see main.cc):
// a Linear trained by DDP with a ZeroRedundancyOptimizer, one good step,
// then rank 2 exits abruptly in the second.
//   "zero1_rank2_dies_in_step": stage 1; rank 2 exits after its backward.
//   "zero2_rank2_dies_in_backward": stage 2; rank 2 exits before its backward.
//   "zero3_rank2_dies_in_forward": FullyShardedDataParallel over two
//          Linears; rank 2 exits before its second forward.
int worker_main(const std::string& mode) {
  try {
    ddp::init_process_group("gloo", "env://", -1, -1, 30s);
    if (mode == "zero3_rank2_dies_in_forward") {
      ddp::FullyShardedDataParallel fsdp(
          torch::nn::Sequential(torch::nn::Linear(64, 64), torch::nn::Linear(64, 64)));
      torch::optim::SGD opt(fsdp.parameters(), 0.1);
      for (int step = 0; step < 2; ++step) {
        if (step == 1 && ddp::get_rank() == 2) std::_Exit(7);
        at::sum(fsdp(at::ones({4, 64}))).backward();
        opt.step();
        opt.zero_grad();
      }
    } else {
      torch::nn::Linear fc(64, 64);
      optim::ZeroRedundancyOptimizer opt(fc->parameters(), optim::Kind::kAdam);
      ddp::DDPOptions d;
      const bool stage2 = mode == "zero2_rank2_dies_in_backward";
      if (stage2) d.gradient_owner = opt.gradient_owner();
      ddp::DistributedDataParallel net(fc, d);
      for (int step = 0; step < 2; ++step) {
        const bool dying = step == 1 && ddp::get_rank() == 2;
        if (dying && stage2) std::_Exit(7);
        at::sum(net(at::ones({4, 64}))).backward();
        if (dying) std::_Exit(7);
        opt.step();
        opt.zero_grad();
      }
    }
    ddp::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker failed: %s\n", e.what());
    return 2;
  }
}

}  // namespace tandem::test
