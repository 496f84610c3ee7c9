// tandem-run: starts the worker processes of one Tandem job on this node and watches over them.
//
//   tandem-run --nproc-per-node N [--nnodes K --node-rank R --master-addr A --master-port P]
//              PROGRAM ARGS...
//
// What it promises:
//   * torchrun-compatible environment. Each of the N workers started here sees RANK,
//     LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT with the
//     meaning torchrun gives them (RANK = R * N + LOCAL_RANK, WORLD_SIZE = N * K), so programs
//     written for torchrun run unchanged.
//   * No port to choose for a one-node job: with --nnodes 1 and no --master-port, a free port on
//     127.0.0.1 is picked. A multi-node job must name its port.
//   * The rendezvous store, hosted here (node 0, LibTorch 1.x builds) before any worker starts,
//     on loopback for a one-node job and on the master's address otherwise; the workers join
//     it as clients. A one-node job without TANDEM_TOKEN gets a random one.
//   * Labelled output. Every line a worker writes is prefixed with "[RANK]: " and written whole
//     to the launcher's stdout or stderr (the same stream the worker used). Lines of different
//     workers never interleave mid-line, a last line without a newline is still printed, and the
//     pipes are drained before the launcher exits.
//   * Signal forwarding. SIGINT and SIGTERM sent to the launcher are passed on to every live
//     worker. As with torchrun, each worker runs in its own session (process group), and signals
//     go to the whole group, so processes a worker started (a shell's children) get them too.
//   * Cores shared out. Unless OMP_NUM_THREADS is set, each of N > 1 workers gets
//     OMP_NUM_THREADS = cores / N (at least 1), as torchrun does (it sets 1): LibTorch's
//     intra-op pool and OpenBLAS's threads default to every core in every process, and
//     OpenBLAS's idle threads spin for a while after each call, so N workers on one node would
//     compete for the cores the one that computes needs.
//   * Fail fast. When a worker exits non-zero or is killed by a signal, the launcher says which,
//     sends SIGTERM to the other workers, SIGKILLs those still alive 5 seconds later, and exits
//     with the failed worker's exit code (128 + signal number for a signal). It exits 0 only
//     when every worker exited 0. Bad arguments exit 2; a program that cannot be run exits 127.
//     With --max-restarts N, a failure while restarts are left stops the others the same way
//     and then starts every worker again (a fresh store and token, the round's number in
//     TANDEM_RESTART_COUNT); the failure after the Nth restart is the job's.
//   * Several nodes, together. With --max-restarts on several nodes, or --nnodes MIN:MAX, node
//     0's launcher coordinates (launcher/run/nodes.cc): every node's workers start and stop
//     together, a node's launcher that is gone (closed, or 5 s silent) fails the round, and an
//     elastic round goes on with the nodes that are there (MIN or more) after --last-call.
//     Workers die with their launcher. --node-rank may then be left out: the launcher that
//     can listen at the master's address is node 0 and numbers the others as they join. The
//     launchers' --nnodes, --max-restarts and --peer-timeout must agree; a node whose differ,
//     or that disagrees with node 0 on coordinating at all, is refused naming them.
//
// It uses only the C++ standard library and POSIX (no LibTorch), so it starts instantly, and it
// is single-threaded: one poll() loop serves the worker pipes and a self-pipe fed by the signal
// handler, which keeps the handler async-signal-safe.

// Its pieces are in launcher/run/: the command line (options.h), output and
// descriptors (io.h), the signal pipe (signals.h), labelled output
// (line_forwarder.h), and the Launcher that starts and watches the workers
// (launcher.h).

#include <unistd.h>

#include <exception>
#include <string>
#include <utility>

#include "launcher/run/io.h"
#include "launcher/run/launcher.h"
#include "launcher/run/options.h"
#include "launcher/run/signals.h"

int main(int argc, char** argv) {
  using namespace tandem::launcher;
  ensure_standard_fds_open();
  Options options;
  try {
    options = parse_args(argc, argv);
  } catch (const UsageError& error) {
    write_all(STDERR_FILENO, std::string("tandem-run: ") + error.what() + "\n" + kUsage);
    return kExitUsage;
  }
  if (options.help) {
    write_all(STDOUT_FILENO, std::string(kUsage) + kHelp);
    return 0;
  }
  try {
    if (options.master_port == 0) options.master_port = pick_free_port();
    const int signal_fd = install_signal_pipe();
    Launcher launcher(std::move(options), signal_fd);
    return launcher.run();
  } catch (const std::exception& error) {
    report(error.what());
    return kExitFailure;
  }
}
