// An outside project's program: built against an installed Tandem through
// find_package(Tandem), it starts a one-worker world, calls itself, and runs
// distributed autograd through that call.
#include <tandem/autograd/autograd.h>
#include <tandem/rpc/api.h>

#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sum.h>

#include <cstdio>

int main() {
  auto reg = std::make_shared<tandem::rpc::Registry>();
  reg->def("twice", [](int64_t x) { return 2 * x; });
  reg->def("scale", [](at::Tensor t, double s) { return at::mul(t, s); });
  tandem::rpc::AgentOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.init_method = "tcp://127.0.0.1:0";  // one worker: it hosts the store itself
  tandem::rpc::init(reg, o);
  int64_t y = tandem::rpc::rpc_sync<int64_t>("worker0", "twice", 21);
  double g = 0;
  {
    tandem::autograd::Context ctx;
    at::Tensor x = at::ones({4}).requires_grad_();
    at::Tensor z = tandem::rpc::rpc_sync<at::Tensor>("worker0", "scale", x, 3.0);
    tandem::autograd::backward(ctx.id(), {at::sum(z)});
    g = tandem::autograd::get_gradients(ctx.id()).at(x)[0].item<double>();
  }
  tandem::rpc::shutdown();
  std::printf("twice(21) = %lld, d(sum(3x))/dx = %.1f\n", static_cast<long long>(y), g);
  return y == 42 && g == 3.0 ? 0 : 1;
}
