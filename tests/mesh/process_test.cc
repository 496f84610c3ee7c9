// Pipeline x data parallelism across real processes: a rank killed
// mid-step. Every survivor fails within seconds with an error naming the
// dead worker (the replica it served: a DisconnectedError; the other
// replica, through the stage whose data-parallel peer it was: the
// collective's error), the stage-only rank fails its graceful shutdown at
// once, and nothing hangs. And the launcher exits non-zero, naming the rank.
#include "tandem/mesh/mesh.h"
#include "tandem/pipeline/pipe.h"

#include <ATen/ops/randn.h>
#include <torch/nn/module.h>

#include <cstdio>
#include <cstdlib>

#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/remote_module/remote_module.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/errors.h"
#include "test_util.h"

using namespace tandem;
using namespace std::chrono_literals;
namespace dist = tandem::autograd;

namespace {

// A stage that ends its process at its sixth forward, on rank 3 only (the
// stage 1 of replica 1); elsewhere the identity.
struct DieOnRank3Impl : torch::nn::Module {
  at::Tensor forward(at::Tensor x) {
    static int forwards = 0;
    const char* rank = std::getenv("RANK");
    if (rank && std::string(rank) == "3" && ++forwards == 6) std::_Exit(9);
    return x;
  }
};

const bool kDie = [] {
  nn::register_module("test_die_on_rank3", [] { return std::make_shared<DieOnRank3Impl>(); });
  return true;
}();

std::string type_of(const std::exception& e) {
  if (dynamic_cast<const rpc::DisconnectedError*>(&e)) return "DisconnectedError";
  if (dynamic_cast<const rpc::RemoteError*>(&e)) return "RemoteError";
  if (dynamic_cast<const ddp::CollectiveError*>(&e)) return "CollectiveError";
  return "std::exception";
}

}  // namespace

TEST_CASE("pp x dp process: a rank killed mid-step fails every survivor within seconds, named") {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string out = test::run_direct_job("pp_dp_die", 4);
  INFO(out);
  CHECK(std::chrono::steady_clock::now() - t0 < 60s);
  auto has = [&](const std::string& s) { return out.find(s) != std::string::npos; };
  CHECK(has("[3] exit 9"));
  CHECK_FALSE(has("exit 124"));  // nothing hung
  // Replica 1's driver: its pipe lost worker3.
  CHECK(has("[1] failed (DisconnectedError): Pipe::step: "));
  // Replica 0's driver: its stage 1 (worker2) could not average with worker3.
  CHECK(has("[0] failed ("));
  CHECK(has("[0] exit 3"));
  CHECK(has("[1] exit 3"));
  // The stage-only rank: its graceful shutdown fails at once, naming the
  // workers that will never arrive (worker3 had arrived before it died; the
  // drivers have failed and gone by then).
  CHECK(
      has("[2] failed (DisconnectedError): graceful shutdown of worker2: worker(s) gone before "
          "reaching shutdown: "));
  CHECK(has("[2] exit 3"));
  CHECK(test::line_of(out, "[1] failed").find("worker3") != std::string::npos);
  // Replica 0's cause is the collective's error, naming the dead peer.
  const std::string line0 = test::line_of(out, "[0] failed");
  CHECK(line0.find("(worker \"worker3\", pid ") != std::string::npos);
  CHECK(line0.find("is gone (its process exited)") != std::string::npos);
  CHECK(line0.find("timeout") == std::string::npos);  // it did not time out
}

TEST_CASE("pp x dp process: under tandem-run, the launcher exits non-zero naming the dead rank") {
  test::RunResult r =
      test::run_command("TANDEM_TEST_WORKER=pp_dp_die " + std::string(TANDEM_RUN_PATH) +
                        " --nproc-per-node 4 " + support::self_exe());
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(r.output.find("worker 3 exited with code 9") != std::string::npos);
}

namespace tandem::test {

// "pp_dp_die": a mesh (pp=2, dp=2); ranks 0 and 1 drive their replica's
// pipe (stage 0 on themselves, stage 1 on rank 2 or 3) for up to 20 steps,
// ranks 2 and 3 serve; rank 3 dies in its sixth forward. Each rank prints
// "failed (<type>): <what>" for its first error and exits 3.
int worker_main(const std::string& mode) {
  (void)kDie;
  if (mode != "pp_dp_die") return 2;
  int code = 0;
  auto fail = [&](const std::exception& e) {
    if (code == 0) {
      std::printf("failed (%s): %s\n", type_of(e).c_str(), e.what());
      std::fflush(stdout);
      code = 3;
    }
  };
  try {
    rpc::AgentOptions ao;
    ao.init_timeout = 30s;
    rpc::init(std::make_shared<rpc::Registry>(), ao);
    MeshOptions mo;
    mo.timeout = 30s;
    Mesh mesh({{"pp", 2}, {"dp", 2}}, mo);
    try {
      if (mesh.coordinate("pp") == 0) {
        std::vector<nn::RemoteModule> stages;
        for (int s = 0; s < 2; ++s) {
          c10::IValue layers =
              nn::list({nn::spec("Linear", {8, 8}), nn::spec("test_die_on_rank3")});
          stages.emplace_back(mesh.worker_at({{"pp", s}}) + "/cpu", "Sequential",
                              std::vector<c10::IValue>{layers});
        }
        pipeline::PipeOptions o;
        o.chunks = 2;
        o.loss = "mse";
        o.timeout = 30s;
        o.data_parallel_group = mesh.group_name("dp");
        pipeline::Pipe pipe(stages, o);
        optim::DistributedOptimizer opt(optim::Kind::kSGD, pipe.parameters());
        for (int step = 0; step < 20; ++step) {
          dist::Context ctx;
          pipe.step(ctx.id(), at::randn({4, 8}), at::randn({4, 8}));
          opt.step(ctx.id());
        }
      }
    } catch (const std::exception& e) {
      fail(e);
    }
    try {
      rpc::shutdown(code == 0);
    } catch (const std::exception& e) {
      fail(e);
    }
  } catch (const std::exception& e) {
    fail(e);
  }
  if (rpc::is_initialized()) rpc::shutdown(false);
  return code;
}

}  // namespace tandem::test
