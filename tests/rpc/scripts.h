// Tests that drive tandem-run from a bash script: the script's set-up and
// how its output is read.
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

#include "support/local_job.h"
#include "test_util.h"

namespace tandem::test {

// Runs a bash script with R (tandem-run), W (the test binary, a worker
// under TANDEM_TEST_WORKER), P (a free port) and D (a fresh directory) set;
// returns what it printed and its status.
inline RunResult run_script(const std::string& script) {
  TempDir dir;
  const std::string path = dir.file("script.sh");
  std::ofstream(path) << "R=" << TANDEM_RUN_PATH << "\nW=" << support::self_exe()
                      << "\nP=" << support::free_port() << "\nD=" << dir.path << "\n"
                      << script;
  return run_command("bash " + path);
}

// The value of `key=` in a script's output, or -1.
inline long value_of(const std::string& output, const std::string& key) {
  const size_t at = output.find(key + "=");
  return at == std::string::npos ? -1 : std::atol(output.c_str() + at + key.size() + 1);
}

// Waits (in bash) until FILE holds N lines matching PATTERN.
constexpr char kAwait[] = R"sh(
await() { for i in $(seq 400); do [ "$(grep -c "$2" "$1")" -ge "$3" ] && return; sleep 0.05; done; }
)sh";

}  // namespace tandem::test
