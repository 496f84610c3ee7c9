// A pipeline stage whose process dies mid-step: the step fails at once on
// the driver (the other workers are told to stop), never waiting out the
// pass timeout.
#include "tandem/pipeline/pipe.h"

#include <torch/nn/module.h>

#include <cstdlib>

#include "tandem/autograd/autograd.h"
#include "test_util.h"

using namespace tandem;
using namespace std::chrono_literals;
namespace dist = tandem::autograd;

namespace {

// A stage that ends its process when it runs.
struct DieImpl : torch::nn::Module {
  at::Tensor forward(at::Tensor x) {
    std::_Exit(9);
    return x;
  }
};

const bool kDie = [] {
  nn::register_module("test_die", [] { return std::make_shared<DieImpl>(); });
  return true;
}();

}  // namespace

namespace tandem::test {

int worker_main(const std::string& mode) {
  (void)kDie;
  (void)mode;  // "stage": serve stages until the driver shuts down (or this dies)
  return serve(std::make_shared<rpc::Registry>());
}

}  // namespace tandem::test

TEST_CASE("pipeline process: a stage's process dying mid-step fails the step at once") {
  test::ChildWorker child("stage");
  auto agent = child.parent_agent(30s);
  {
    // Stage 0 here (worker0), stage 1 in the child, which dies in its first forward.
    std::vector<nn::RemoteModule> stages;
    stages.emplace_back(*agent, "worker0/cpu", "Linear", std::vector<c10::IValue>{4, 4});
    stages.emplace_back(*agent, "worker1/cpu", "test_die");
    pipeline::PipeOptions o;
    o.chunks = 2;
    o.schedule = "1f1b";
    o.loss = "mse";
    pipeline::Pipe pipe(*agent, stages, o);
    dist::Context ctx(*agent);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string error = test::error_of([&] {
      pipe.step(ctx.id(), at::ones({4, 4}), at::zeros({4, 4}));
    });
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);  // the pass timeout is 60 s
    INFO(error);
    CHECK(error.find("Pipe::step: ") == 0);
    CHECK(error.find("worker1") != std::string::npos);
    CHECK(error.find("step aborted") == std::string::npos);  // the cause, not the echo
  }
  child.expect_exit(9);
  agent->shutdown(false);
  agent = nullptr;
}
