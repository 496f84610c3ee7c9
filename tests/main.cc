// The test binary. Run plainly, it runs the doctest suites. With
// TANDEM_TEST_WORKER set, it is instead one worker of a multi-process test
// (started by a test through tandem-run or directly): see worker_main().
#define DOCTEST_CONFIG_IMPLEMENT
#include "tandem/rpc/transport/uv/uv_transport.h"
#include "test_util.h"

#include <ATen/ops/ones.h>
#include <ATen/ops/sum.h>

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
  // Some things start on first use and stay for the life of the process:
  // libuv's process-wide pipe (opened when any loop first starts) and
  // LibTorch's autograd engine threads (one per GPU, at the first
  // backward). Start them up front so that the leak checks count only what
  // a case itself starts. The transport's loop thread is joined, but leaves
  // the kernel's count a moment later.
  const int threads = tandem::test::thread_count();
  tandem::rpc::UvTransport(tandem::rpc::Limits{}, {}).close();
  tandem::test::eventually([&] { return tandem::test::thread_count() == threads; });
  (at::ones({1}).requires_grad_() * 2).sum().backward();
  // LibTorch's intra-op threads (one per core, OpenMP's in most builds)
  // start at the first parallel op a thread runs, which a case with a
  // large tensor does on this one. An op inside LibTorch, large enough to
  // be split (at::parallel_for here would run serially: this file is not
  // built with OpenMP).
  const at::Tensor big = at::ones({int64_t(1) << 22});
  (void)(big + big).sum().item<float>();
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
