// The test binary. Run plainly, it runs the doctest suites. With
// TANDEM_TEST_WORKER set, it is instead one worker of a multi-process test
// (started by a test through tandem-run or directly): see worker_main().
#define DOCTEST_CONFIG_IMPLEMENT
#include "test_util.h"
#include "rpc/transport/uv/uv_transport.h"

#include <unistd.h>

#include <cstdlib>

namespace tandem::test {
int worker_main(const std::string& mode);  // tests/rpc/process_test.cc

std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}
}  // namespace tandem::test

int main(int argc, char** argv) {
  if (const char* mode = std::getenv("TANDEM_TEST_WORKER")) {
    return tandem::test::worker_main(mode);
  }
  // libuv opens a process-wide pipe the first time any loop starts and keeps
  // it for the life of the process. Start one transport up front so the leak
  // checks count only what a test itself opens.
  tandem::rpc::UvTransport(tandem::rpc::Limits{}, {}).close();
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
