// Distributed backward with a real worker process that dies in the middle.
// The same binary is the worker (see main.cc: TANDEM_TEST_WORKER selects it).
#include "test_util.h"

#include <signal.h>

#include <cstdio>
#include <cstdlib>

#include "tandem/autograd/autograd.h"
#include "tandem/rpc/api.h"

using namespace tandem;
using namespace std::chrono_literals;
namespace dist = tandem::autograd;

namespace tandem::test {

int worker_main(const std::string& mode) {
  (void)mode;  // "serve": answer until the others shut down (or die)
  auto reg = std::make_shared<rpc::Registry>();
  reg->def("double", [](at::Tensor x) { return x * 2; });
  // The process ends while its part of backward runs.
  reg->def("die_in_backward", [](at::Tensor x) {
    auto y = x * 2;
    y.register_hook([](at::Tensor g) -> at::Tensor {
      std::_Exit(9);
      return g;
    });
    return y;
  });
  return serve(reg);
}

}  // namespace tandem::test

TEST_CASE("autograd process: a worker that dies during backward fails it with Disconnected") {
  test::ChildWorker child("serve");
  auto agent = child.parent_agent(30s);
  auto x = at::ones({3}).requires_grad_();
  {
    dist::Context ctx(*agent);
    // A healthy round first: the remote part runs and returns.
    auto y = agent->rpc_sync<at::Tensor>("worker1", "double", x);
    dist::backward(ctx.id(), {y.sum()});
    CHECK(at::equal(dist::get_gradients(ctx.id()).at(x), at::full({3}, 2.0)));

    auto z = agent->rpc_sync<at::Tensor>("worker1", "die_in_backward", x);
    auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(dist::backward(ctx.id(), {z.sum()}), rpc::DisconnectedError);
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  }  // releasing the context does not wait for the dead worker
  CHECK(dist::live_contexts(*agent) == 0);
  child.expect_exit(9);
  agent->shutdown(false);
  agent = nullptr;
}
