// The test binary. Run plainly, it runs the doctest suites. With
// TANDEM_TEST_WORKER set, it is instead one worker of a multi-process test
// (started by a test through tandem-run or directly): see worker_main().
#define DOCTEST_CONFIG_IMPLEMENT
#include "test_util.h"
#include "tandem/rpc/transport/uv/uv_transport.h"

#include <cstdlib>

namespace tandem::test {
// Each test binary defines it (tests/*/process_test.cc).
int worker_main(const std::string& mode);
}  // namespace tandem::test

int main(int argc, char** argv) {
  if (const char* mode = std::getenv("TANDEM_TEST_WORKER")) {
    return tandem::test::worker_main(mode);
  }
  // libuv opens a process-wide pipe the first time any loop starts and keeps
  // it for the life of the process. Start one transport up front so the leak
  // checks count only what a test itself opens.
  tandem::rpc::UvTransport(tandem::rpc::Limits{}, {}).close();
  // Its loop thread may still be on its way out: let the count settle before
  // the first test records it.
  for (int i = 0, last = -1; i < 100; ++i) {
    int now = tandem::test::thread_count();
    if (now == last) break;
    last = now;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
