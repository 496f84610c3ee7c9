// RemoteModule with a real owner process: it builds and serves modules
// though its own code never names the layer, and its death fails a forward
// with Disconnected, never a hang. The same binary is the owner (see
// main.cc: TANDEM_TEST_WORKER selects it).

#include <cstdlib>

#include "tandem/autograd/autograd.h"
#include "tandem/remote_module/remote_module.h"
#include "tandem/rpc/api.h"
#include "test_util.h"

using namespace tandem;
using namespace std::chrono_literals;
namespace dist = tandem::autograd;

namespace tandem::test {

int worker_main(const std::string& mode) {
  (void)mode;  // "owner": serve until the others shut down (or this dies)
  auto reg = std::make_shared<rpc::Registry>();
  reg->def("die", [] { std::_Exit(9); });
  return serve(reg);
}

}  // namespace tandem::test

TEST_CASE(
    "nn process: an owner process serves modules, and its death fails forward with Disconnected") {
  test::ChildWorker child("owner");
  auto agent = child.parent_agent(30s);
  {
    nn::RemoteModule fc(*agent, "worker1/cpu", "Linear", {3, 2});
    dist::Context ctx(*agent);
    at::Tensor y = fc.forward(at::ones({1, 3}));
    CHECK(y.sizes() == at::IntArrayRef{1, 2});
    CHECK_THROWS(agent->rpc_sync("worker1", "die"));
    auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(fc.forward(at::ones({1, 3})), rpc::DisconnectedError);
    CHECK_THROWS_AS(fc.remote_parameters(), rpc::DisconnectedError);
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  }  // dropping the module does not wait for the dead owner
  child.expect_exit(9);
  agent->shutdown(false);
  agent = nullptr;
}
