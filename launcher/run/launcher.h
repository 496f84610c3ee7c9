// tandem-run's Launcher: starts this node's workers (launcher/run/start.cc:
// the environment, the cluster token, the rendezvous store it hosts, fork
// and exec) and watches over them until all exited and their output is
// drained (launcher/run/supervise.cc: the poll loop, signals forwarded,
// fail fast). main() (launcher/tandem_run.cc) parses Options, installs the
// signal pipe (launcher/run/signals.h) and runs it; its answer is the
// launcher's exit code.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "launcher/run/line_forwarder.h"
#include "launcher/run/options.h"
#ifdef TANDEM_RUN_HOSTS_STORE
#include "tandem/rpc/rendezvous/store_server.h"
#endif

namespace tandem::launcher {

using Clock = std::chrono::steady_clock;

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitCannotRun = 127;
constexpr int kSignalExitBase = 128;

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
  LineForwarder out;
  LineForwarder err;
};

class Launcher {
 public:
  Launcher(Options options, int signal_fd) : options_(std::move(options)), signal_fd_(signal_fd) {}

  // Starts the workers, supervises them until all exited and their output is drained, and
  // returns the launcher's exit status.
  int run();

 private:
  void start_workers();
  // After a failure with restarts left, once every worker of the round is
  // gone: the next round, with a fresh store and token.
  void next_round();
  void join_traces();
  bool spawn(int local_rank);
  std::vector<std::string> worker_environment(int local_rank) const;
  // OMP_NUM_THREADS for each worker when the user did not set it; 0: leave it unset.
  int threads_per_worker() const;
  void poll_once();
  int poll_timeout_ms() const;
  void handle_signals();
  void reap_workers();
  void on_worker_exit(Worker& worker, int status);
  void begin_shutdown(int exit_code);
  void signal_live_workers(int signal_number);
  void check_deadlines();
  bool has_open_pipes() const;
  Worker* find_worker(pid_t pid);

  Options options_;
  int signal_fd_;
  // A one-node job's cluster token when the user set none (see start_workers).
  std::string job_token_;
#ifdef TANDEM_RUN_HOSTS_STORE
  // The rendezvous store, hosted here on node 0 before any worker starts.
  std::unique_ptr<tandem::rpc::StoreServer> store_;
#endif
  bool hosts_store_ = false;
  std::vector<Worker> workers_;
  int live_workers_ = 0;
  int exit_code_ = 0;  // the first failure's status; 0 while none
  bool shutting_down_ = false;
  // A failed round is being stopped to start the next (--max-restarts).
  bool restarting_ = false;
  // SIGINT or SIGTERM came to the launcher: no more restarts.
  bool stopped_by_user_ = false;
  int restart_count_ = 0;  // rounds started again so far
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> drain_deadline_;
};

}  // namespace tandem::launcher
