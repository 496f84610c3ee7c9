// An outside project's program: built against an installed Tandem through
// find_package(Tandem), it starts a one-worker world and calls itself.
#include <tandem/rpc/api.h>

#include <cstdio>

int main() {
  auto reg = std::make_shared<tandem::rpc::Registry>();
  reg->def("twice", [](int64_t x) { return 2 * x; });
  tandem::rpc::AgentOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.init_method = "tcp://127.0.0.1:0";  // one worker: it hosts the store itself
  tandem::rpc::init(reg, o);
  int64_t y = tandem::rpc::rpc_sync<int64_t>("worker0", "twice", 21);
  tandem::rpc::shutdown();
  std::printf("twice(21) = %lld\n", static_cast<long long>(y));
  return y == 42 ? 0 : 1;
}
