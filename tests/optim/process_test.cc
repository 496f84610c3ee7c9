// DistributedOptimizer with a real owner process that dies between steps.
// The same binary is the owner (see main.cc: TANDEM_TEST_WORKER selects it).
#include "test_util.h"

#include <signal.h>

#include <ATen/ops/mm.h>

#include <cstdio>
#include <cstdlib>

#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rref.h"

using namespace tandem;
using namespace std::chrono_literals;
namespace dist = tandem::autograd;

namespace tandem::test {

int worker_main(const std::string& mode) {
  (void)mode;  // "owner": serve until the others shut down (or this dies)
  auto weight = at::ones({3, 2}).requires_grad_();
  auto reg = std::make_shared<rpc::Registry>();
  reg->def("param",
           [weight] { return rpc::RRef<at::Tensor>::make_local(*rpc::current_agent(), weight); });
  reg->def("layer", [weight](at::Tensor x) { return at::mm(x, weight); });
  reg->def("die", [] { std::_Exit(9); });
  return serve(reg);
}

}  // namespace tandem::test

TEST_CASE("optim process: an owner that dies fails step with Disconnected, never hangs") {
  test::ChildWorker child("owner");
  auto agent = child.parent_agent(30s);
  {
    auto p = agent->rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param");
    optim::DistributedOptimizer opt(*agent, optim::Kind::kSGD, {p});
    {
      dist::Context ctx(*agent);
      auto y = agent->rpc_sync<at::Tensor>("worker1", "layer", at::ones({1, 3}));
      dist::backward(*agent, ctx.id(), {y.sum()});
      opt.step(ctx.id());  // a healthy step first
      CHECK_THROWS(agent->rpc_sync("worker1", "die"));
      auto t0 = std::chrono::steady_clock::now();
      CHECK_THROWS_AS(opt.step(ctx.id()), rpc::DisconnectedError);
      CHECK(std::chrono::steady_clock::now() - t0 < 5s);
    }
    p = rpc::RRef<at::Tensor>();
  }  // dropping the optimizer does not wait for the dead owner
  child.expect_exit(9);
  agent->shutdown(false);
  agent = nullptr;
}
