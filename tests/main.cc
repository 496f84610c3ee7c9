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
  // Every agent made from now on is tracked, for the leak check at the end
  // of each case (test_util.h).
  tandem::test::track_agents();
  // libuv opens a process-wide pipe the first time any loop starts and keeps
  // it for the life of the process. Start one transport up front so the leak
  // checks count only what a test itself opens; its loop thread is joined,
  // but leaves the kernel's count a moment later.
  const int threads = tandem::test::thread_count();
  tandem::rpc::UvTransport(tandem::rpc::Limits{}, {}).close();
  tandem::test::eventually([&] { return tandem::test::thread_count() == threads; });
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
