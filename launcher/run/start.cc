// Starting the workers (launcher/run/launcher.h): their environment, the
// cluster token, the rendezvous store hosted here, fork and exec; and, once
// they exited, joining their traces.
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "launcher/run/io.h"
#include "launcher/run/launcher.h"
#include "launcher/run/signals.h"
#include "launcher/trace_join.h"
#include "tandem/rpc/common/auth.h"

extern char** environ;

namespace tandem::launcher {

namespace {

constexpr const char* kWorkerVariables[] = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    // set for each round (--max-restarts)
    "TANDEM_RESTART_COUNT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "GROUP_WORLD_SIZE",
    // set for each worker started again alone (--replace-failed)
    "TANDEM_REPLACEMENT_COUNT",
};

std::string variable_name(const char* entry) {
  const char* equals = std::strchr(entry, '=');
  return equals ? std::string(entry, equals) : std::string(entry);
}

bool is_worker_variable(const std::string& name) {
  for (const char* variable : kWorkerVariables) {
    if (name == variable) return true;
  }
  return false;
}

std::vector<char*> to_pointers(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

[[noreturn]] void run_child(int out_fd, int err_fd, char** argv, char** envp, pid_t launcher) {
  // A worker does not outlive its launcher: with no one left to stop it or
  // to report its end (the launcher SIGKILLed, its node lost), it would hold
  // its peers and its GPU until they time out.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(kExitFailure);  // the launcher died before prctl
  reset_child_signals();
  ::setsid();  // own session and process group, like torchrun's start_new_session
  ::dup2(out_fd, STDOUT_FILENO);  // dup2 clears close-on-exec on the copies
  ::dup2(err_fd, STDERR_FILENO);
  environ = envp;
  ::execvp(argv[0], argv);
  const int error = errno;
  write_all(STDERR_FILENO,
            std::string("tandem-run: cannot run ") + argv[0] + ": " + errno_text(error) + "\n");
  ::_exit(kExitCannotRun);
}

}  // namespace

// This node's workers' traces into <dir>/tandem-trace.json (launcher/trace_join.h).
void Launcher::join_traces() {
  std::vector<std::string> files;
  const int first = round_.group_rank * options_.nproc_per_node;
  for (int rank = first; rank < first + options_.nproc_per_node; ++rank) {
    files.push_back(options_.trace_dir + "/tandem-trace-rank" + std::to_string(rank) + ".json");
  }
  const std::string out = options_.trace_dir + "/tandem-trace.json";
  try {
    auto r = tandem::launcher::join_traces(files, out);
    for (const auto& s : r.skipped) report("no trace from " + s);
    report("joined the traces of " + std::to_string(r.files) + " worker(s) into " + out);
  } catch (const std::exception& e) {
    report(std::string("no joined trace: ") + e.what());
  }
}

int Launcher::threads_per_worker() const {
  if (options_.nproc_per_node <= 1 || std::getenv("OMP_NUM_THREADS") != nullptr) return 0;
  cpu_set_t set;
  long cores = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    cores = CPU_COUNT(&set);  // the cores this launcher may use, as its workers will
  } else {
    cores = sysconf(_SC_NPROCESSORS_ONLN);
  }
  return static_cast<int>(std::max(1L, cores / options_.nproc_per_node));
}

void Launcher::next_round() {
  // Whatever a failed round's workers left in their process groups (a child
  // that ignored SIGTERM) must not live on beside the next round.
  for (const Worker& worker : workers_) {
    if (!worker.replaced) ::kill(-worker.pid, SIGKILL);
  }
  restarting_ = false;
  shutting_down_ = false;
  kill_deadline_.reset();
  drain_deadline_.reset();
  workers_.clear();
  live_workers_ = 0;
  ++round_.number;
  ++round_.restarts;
  report("restart " + std::to_string(round_.restarts) + " of " +
         std::to_string(options_.max_restarts) + ": starting " +
         std::to_string(options_.nproc_per_node) + " worker(s)");
  start_workers();
}

void Launcher::start_workers() {
  const bool first_round = round_.number == 0;
  if (const int threads = threads_per_worker(); threads && first_round) {
    report("OMP_NUM_THREADS=" + std::to_string(threads) + " for each of " +
           std::to_string(options_.nproc_per_node) +
           " workers (the node's cores shared out); set OMP_NUM_THREADS to choose");
  }
  // Workers prove the cluster token to each other (rpc/common/auth.h). A one-node
  // job without TANDEM_TOKEN gets a fresh random one, so that no other
  // process on the host can join it; nodes of a multi-node job must share
  // one, which only the user can give them all. Each round of a restarted
  // job has a token of its own, so that nothing left of an earlier round
  // can join it: a fresh random one where tandem-run makes it, else the
  // user's with the round appended.
  const char* token = std::getenv("TANDEM_TOKEN");
  if ((!token || !*token) && options_.nnodes == 1) {
    job_token_ = tandem::rpc::random_hex(32);
  } else if (token && *token && !first_round) {
    job_token_ = std::string(token) + ".round" + std::to_string(round_.number);
  } else if (first_round && (!token || !*token)) {
    report(
        "warning: TANDEM_TOKEN is not set: any process that can reach this job's workers "
        "can join it; set the same random TANDEM_TOKEN on every node");
  }
#ifdef TANDEM_RUN_HOSTS_STORE
  // Node 0's launcher hosts the store, listening on loopback for a one-node
  // job and on the master's address otherwise, before any worker starts:
  // no worker waits for rank 0 to come up, and the store outlives rank 0.
  // The workers join it as clients (TORCHELASTIC_USE_AGENT_STORE, as under
  // torchrun). TANDEM_STORE=c10d leaves it to rank 0.
  const char* store_choice = std::getenv("TANDEM_STORE");
  // A round after a restart gets a fresh store (no stale keys) on the same port.
  // (A coordinated job's store is opened by the coordinator, launcher/run/nodes.cc.)
  if (!coordinated(options_)) {
    store_.reset();
    hosts_store_ = false;
  }
  if (!coordinated(options_) && options_.node_rank == 0 &&
      !(store_choice && std::string(store_choice) == "c10d")) {
    const char* bind = std::getenv("TANDEM_STORE_BIND");
    const std::string host = bind                   ? bind
                             : options_.nnodes == 1 ? "127.0.0.1"
                                                    : options_.master_addr;
    try {
      store_ = std::make_unique<tandem::rpc::StoreServer>(host, options_.master_port, true);
      hosts_store_ = true;
    } catch (const std::exception& e) {
      report(std::string(e.what()) + "; rank 0 hosts the store instead");
    }
  }
#endif
  workers_.reserve(options_.nproc_per_node);
  for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
    if (!spawn(local_rank)) {
      if (coordinated(options_)) {  // the round's failure, on every node
        Worker failed;
        failed.rank = round_.group_rank * options_.nproc_per_node + local_rank;
        local_worker_failed(failed, kExitFailure, "could not be started");
        return;
      }
      begin_shutdown(kExitFailure);
      return;
    }
  }
}

std::vector<std::string> Launcher::worker_environment(int local_rank) const {
  std::vector<std::string> env;
  for (char** entry = environ; entry && *entry; ++entry) {
    const std::string name = variable_name(*entry);
    if (is_worker_variable(name)) continue;
    if (hosts_store_ && name == "TORCHELASTIC_USE_AGENT_STORE") continue;  // set below
    if (!job_token_.empty() && name == "TANDEM_TOKEN") continue;           // this round's, below
    if (options_.peer_timeout_s >= 0 && name == "TANDEM_PEER_TIMEOUT")
      continue;  // --peer-timeout's
    env.emplace_back(*entry);
  }
  const int nproc = options_.nproc_per_node;
  const auto add = [&env](const char* name, const std::string& value) {
    env.push_back(std::string(name) + "=" + value);
  };
  add("RANK", std::to_string(round_.group_rank * nproc + local_rank));
  add("LOCAL_RANK", std::to_string(local_rank));
  add("WORLD_SIZE", std::to_string(nproc * round_.nnodes));
  add("LOCAL_WORLD_SIZE", std::to_string(nproc));
  add("GROUP_RANK", std::to_string(round_.group_rank));
  add("GROUP_WORLD_SIZE", std::to_string(round_.nnodes));
  add("MASTER_ADDR", options_.master_addr);
  add("MASTER_PORT", std::to_string(round_.store_port));
  add("TANDEM_LAUNCHER", "tandem-run");  // rpc::init then prints debug info on SIGUSR1
  if (!options_.trace_dir.empty()) add("TANDEM_TRACE", options_.trace_dir);
  if (options_.peer_timeout_s >= 0) {
    add("TANDEM_PEER_TIMEOUT", std::to_string(options_.peer_timeout_s));
  }
  if (const int threads = threads_per_worker()) add("OMP_NUM_THREADS", std::to_string(threads));
  if (!job_token_.empty()) add("TANDEM_TOKEN", job_token_);
  add("TANDEM_RESTART_COUNT", std::to_string(round_.number));
  add("TORCHELASTIC_RESTART_COUNT", std::to_string(round_.restarts));
  add("TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts));
  if (options_.replace_failed > 0) {
    const auto it = replaced_.find(local_rank);
    add("TANDEM_REPLACEMENT_COUNT", std::to_string(it == replaced_.end() ? 0 : it->second));
  }
  if (hosts_store_) add("TORCHELASTIC_USE_AGENT_STORE", "True");
  return env;
}

bool Launcher::spawn(int local_rank) {
  const int rank = round_.group_rank * options_.nproc_per_node + local_rank;
  int out_pipe[2];
  int err_pipe[2];
  if (!make_pipe(out_pipe, false)) {
    report("cannot create a pipe for worker " + std::to_string(rank) + ": " + errno_text(errno));
    return false;
  }
  if (!make_pipe(err_pipe, false)) {
    report("cannot create a pipe for worker " + std::to_string(rank) + ": " + errno_text(errno));
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    return false;
  }
  std::vector<std::string> env = worker_environment(local_rank);
  std::vector<std::string> args = options_.program;
  std::vector<char*> envp = to_pointers(env);
  std::vector<char*> argv = to_pointers(args);

  // Signals stay blocked across fork so the child never runs the launcher's handler.
  const sigset_t blocked = handled_signal_set();
  sigset_t saved;
  ::sigprocmask(SIG_BLOCK, &blocked, &saved);
  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) run_child(out_pipe[1], err_pipe[1], argv.data(), envp.data(), launcher);
  const int fork_error = errno;
  ::sigprocmask(SIG_SETMASK, &saved, nullptr);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (pid < 0) {
    report("cannot start worker " + std::to_string(rank) + ": " + errno_text(fork_error));
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    return false;
  }
  const std::string prefix = "[" + std::to_string(rank) + "]: ";
  Worker worker;
  worker.rank = rank;
  worker.pid = pid;
  worker.alive = true;
  worker.out = LineForwarder(out_pipe[0], STDOUT_FILENO, prefix);
  worker.err = LineForwarder(err_pipe[0], STDERR_FILENO, prefix);
  workers_.push_back(std::move(worker));
  ++live_workers_;
  return true;
}

}  // namespace tandem::launcher
