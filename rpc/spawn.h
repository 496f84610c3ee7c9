// tandem::spawn: start a local job from code, as torch.multiprocessing.spawn
// does for Python.
//
//   int main(int argc, char** argv) {
//     tandem::spawn(2, [](int rank, int world_size) {
//       auto agent = tandem::rpc::init(registry);   // RANK, MASTER_PORT ... are set
//       ...
//       tandem::rpc::shutdown();
//     });
//   }
//
// How it works:
//  1. spawn() starts this same program again, nprocs times, under tandem-run
//     (launcher/tandem_run.cc), so each worker sees exactly what
//     tandem-run gives its workers: RANK, LOCAL_RANK, WORLD_SIZE,
//     LOCAL_WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT, a random job token,
//     the cores shared out (OMP_NUM_THREADS), its output prefixed "[RANK]: ".
//  2. In a worker, the program runs from main() again; its call to spawn()
//     runs fn(rank, world_size) and ends the process: exit code 0 when fn
//     returns, 1 (the error printed first) when it throws. So whatever main
//     does before spawn() runs in every worker too: call spawn() first.
//  3. In the caller, spawn() relays the workers' output and returns once
//     every worker has returned from fn. When one fails (fn throws, the
//     process exits non-zero or is killed by a signal), tandem-run stops the
//     others (SIGTERM, then SIGKILL 5 s later) and spawn() throws SpawnError
//     naming the rank, how it ended and the last lines it printed. No
//     worker outlives the call; if the caller itself dies, tandem-run gets
//     SIGTERM and stops the workers.
//  4. The launcher is $TANDEM_RUN when set, else the tandem-run installed
//     beside this library (../bin/tandem-run), else the one on PATH.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem {

class SpawnError : public std::runtime_error {
 public:
  SpawnError(const std::string& what, int rank, int exit_code, int signal,
             std::vector<std::string> last_lines)
      : std::runtime_error(what),
        rank(rank),
        exit_code(exit_code),
        signal(signal),
        last_lines(std::move(last_lines)) {}
  int rank;       // the worker that failed first; -1 when the launcher itself failed
  int exit_code;  // its exit code, or -1 when a signal killed it
  int signal;     // the signal that killed it, or 0
  std::vector<std::string> last_lines;  // what it printed last (stdout and stderr, in order)
};

struct SpawnOptions {
  std::string launcher;    // tandem-run's path; empty: found as in 4.
  size_t last_lines = 20;  // how many of the failed worker's lines SpawnError keeps
};

void spawn(int nprocs, const std::function<void(int rank, int world_size)>& fn,
           const SpawnOptions& options = {});

// True in a process spawn() started (a worker, 2.).
bool spawned_worker();

}  // namespace tandem
