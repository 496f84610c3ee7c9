// Watching over the workers (launcher/run/launcher.h): one poll() loop over
// their pipes and the signal pipe, reaping, fail-fast shutdown, and draining.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include "launcher/run/io.h"
#include "launcher/run/join.h"
#include "launcher/run/launcher.h"

namespace tandem::launcher {

namespace {

constexpr auto kKillGrace = std::chrono::seconds(5);
// How long pipes may stay open after every worker exited (a descendant of a worker can hold
// them); everything the workers themselves wrote is readable at once.
constexpr auto kDrainGrace = std::chrono::seconds(2);
constexpr int kMaxPollMs = 1000;
constexpr int kNodeTickMs = 100;

}  // namespace

int Launcher::run() {
  round_.nnodes = options_.nnodes;
  round_.group_rank = options_.node_rank;
  round_.store_port = options_.master_port;
  return coordinated(options_) ? run_coordinated() : run_plain();
}

int Launcher::run_plain() {
  if (options_.nnodes > 1 && options_.node_rank != 0 && coordinating_node0()) {
    report("node 0's launcher at " + options_.master_addr + ":" +
           std::to_string(options_.master_port) +
           " coordinates this job (it greeted as a coordinating tandem-run does) and this one "
           "does not: " +
           coordination_rule(options_) +
           ": start every node's launcher with node 0's --nnodes and --max-restarts");
    return kExitFailure;
  }
  start_workers();
  for (;;) {
    while (live_workers_ > 0 || has_open_pipes()) {
      poll_once();
      reap_workers();
      check_deadlines();
    }
    if (!restarting_) break;
    next_round();
  }
  if (!options_.trace_dir.empty()) join_traces();
  return exit_code_;
}

bool Launcher::coordinating_node0() {
  // A coordinating node 0 greets every connection at once; the store a
  // plain node 0 hosts (its launcher's, or its rank 0's) says nothing first.
  // Until something listens there (within --join-timeout, as the workers
  // would wait for the store), knock; a signal meanwhile ends the wait.
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(options_.join_timeout_s);
  std::optional<Channel> probe;
  while (!probe) {
    std::string error;
    probe = connect_channel(options_.master_addr, options_.master_port,
                            std::chrono::milliseconds(1000), error);
    if (probe) break;
    pollfd s{signal_fd_, POLLIN, 0};
    if (Clock::now() >= deadline || ::poll(&s, 1, 250) > 0) return false;
  }
  const Clock::time_point until = Clock::now() + std::chrono::milliseconds(300);
  while (Clock::now() < until && probe->is_open()) {
    pollfd p{probe->fd(), POLLIN, 0};
    if (::poll(&p, 1, 20) > 0) probe->read_some();
    if (std::optional<std::string> line = probe->next_line()) {
      return line->rfind("tandem-run ", 0) == 0;
    }
  }
  return false;
}

void Launcher::poll_once(std::vector<std::pair<int, std::function<void()>>> extra) {
  std::vector<pollfd> fds;
  std::vector<LineForwarder*> forwarders;
  fds.push_back({signal_fd_, POLLIN, 0});
  forwarders.push_back(nullptr);
  for (const auto& e : extra) {
    fds.push_back({e.first, POLLIN, 0});
    forwarders.push_back(nullptr);
  }
  for (Worker& worker : workers_) {
    for (LineForwarder* forwarder : {&worker.out, &worker.err}) {
      if (!forwarder->is_open()) continue;
      fds.push_back({forwarder->fd(), POLLIN, 0});
      forwarders.push_back(forwarder);
    }
  }
  if (::poll(fds.data(), fds.size(), poll_timeout_ms()) <= 0) return;  // timeout or EINTR
  if (fds[0].revents != 0) handle_signals();
  for (size_t i = 0; i < extra.size(); ++i) {
    if (fds[1 + i].revents != 0) extra[i].second();
  }
  for (size_t i = 1 + extra.size(); i < fds.size(); ++i) {
    if (fds[i].revents != 0) forwarders[i]->read_some();
  }
}

int Launcher::poll_timeout_ms() const {
  const Clock::time_point now = Clock::now();
  // A coordinated job's timers (heartbeats, the last call, reconnecting) are
  // looked at between polls.
  long long timeout = coordinated(options_) ? kNodeTickMs : kMaxPollMs;
  for (const auto& deadline : {kill_deadline_, drain_deadline_}) {
    if (!deadline || (deadline == drain_deadline_ && !has_open_pipes())) continue;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - now).count();
    timeout = std::min(timeout, std::max(0LL, static_cast<long long>(left)));
  }
  return static_cast<int>(timeout);
}

void Launcher::handle_signals() {
  unsigned char buffer[64];
  ssize_t n;
  while ((n = ::read(signal_fd_, buffer, sizeof(buffer))) > 0) {
    for (ssize_t i = 0; i < n; ++i) {
      const int signal_number = buffer[i];
      if ((signal_number == SIGINT || signal_number == SIGTERM) && coordinated(options_)) {
        // The job ends for good, on every node.
        const int code = kSignalExitBase + signal_number;
        stopped_by_user_ = true;
        signal_live_workers(signal_number);
        if (options_.node_rank != 0) {
          coordinator_.send("quit " + std::to_string(code));
          if (!final_code_) final_code_ = code;
          if (round_active_) {
            begin_shutdown(code);
          } else {
            finish(code);
          }
        } else if (phase_ == Phase::kRunning) {
          round_failed("tandem-run was stopped by signal " + std::to_string(signal_number), code,
                       false);
        } else if (phase_ == Phase::kStopping && !final_code_) {
          final_code_ = code;  // the round being stopped is the last
        } else {
          // Waiting for nodes, or a second signal while stopping: now.
          signal_live_workers(SIGKILL);
          finish(code);
        }
        continue;
      }
      if (signal_number == SIGINT || signal_number == SIGTERM) {
        stopped_by_user_ = true;
        if (restarting_) {  // the round being stopped is the last
          restarting_ = false;
          exit_code_ = kSignalExitBase + signal_number;
        }
        signal_live_workers(signal_number);
      }
      // SIGCHLD only wakes the loop; reap_workers() runs after every poll.
    }
  }
}

void Launcher::reap_workers() {
  int status = 0;
  pid_t pid;
  while (live_workers_ > 0 && (pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
    Worker* worker = find_worker(pid);
    if (worker != nullptr) on_worker_exit(*worker, status);
  }
  // A replaced worker's entry goes once its pipes are drained (its pid may
  // be another process's by then: nothing must signal or match it).
  if (replacements_ > 0) {
    workers_.erase(std::remove_if(workers_.begin(), workers_.end(),
                                  [](const Worker& w) {
                                    return !w.alive && w.replaced && !w.out.is_open() &&
                                           !w.err.is_open();
                                  }),
                   workers_.end());
  }
}

void Launcher::on_worker_exit(Worker& worker, int status) {
  worker.alive = false;
  --live_workers_;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  if (shutting_down_) return;  // a consequence of the shutdown already under way
  int code = kExitFailure;
  std::string what = "exited abnormally";
  if (WIFEXITED(status)) {
    code = WEXITSTATUS(status);
    what = "exited with code " + std::to_string(code);
  } else if (WIFSIGNALED(status)) {
    code = kSignalExitBase + WTERMSIG(status);
    what = "killed by signal " + std::to_string(WTERMSIG(status));
  }
  // (exit code 78: the worker says its failure is the job's, not its own)
  if (!stopped_by_user_ && replacements_ < options_.replace_failed &&
      !(WIFEXITED(status) && WEXITSTATUS(status) == kExitNotReplaceable)) {
    // The others go on; this rank starts again alone (its replica rejoins
    // the job at a step boundary and is healed from a peer).
    ++replacements_;
    worker.replaced = true;
    // Whatever it left in its process group goes with it (reaped just now,
    // its pid stays reserved while that group has members).
    ::kill(-worker.pid, SIGKILL);
    const int local_rank = worker.rank - round_.group_rank * options_.nproc_per_node;
    const int count = ++replaced_[local_rank];
    report("worker " + std::to_string(worker.rank) + " " + what + "; starting it again alone (" +
           "replacement " + std::to_string(replacements_) + " of " +
           std::to_string(options_.replace_failed) + "; this rank's " + std::to_string(count) +
           ")");
    if (spawn(local_rank)) return;
  }
  if (coordinated(options_)) {
    local_worker_failed(worker, code, what);
    return;
  }
  if (!stopped_by_user_ && round_.restarts < options_.max_restarts) {
    report("worker " + std::to_string(worker.rank) + " " + what +
           "; stopping the others to start every worker again (restart " +
           std::to_string(round_.restarts + 1) + " of " + std::to_string(options_.max_restarts) +
           ")");
    restarting_ = true;
    begin_shutdown(0);
    return;
  }
  report("worker " + std::to_string(worker.rank) + " " + what);
  begin_shutdown(code);
}

void Launcher::begin_shutdown(int exit_code) {
  if (shutting_down_) return;
  shutting_down_ = true;
  exit_code_ = exit_code;
  signal_live_workers(SIGTERM);
  // A stopped worker (SIGSTOP, a debugger's) takes its SIGTERM now rather
  // than at the SIGKILL.
  signal_live_workers(SIGCONT);
  kill_deadline_ = Clock::now() + kKillGrace;
}

// Signals each live worker's process group; a worker that has not called setsid() yet (just
// forked) has no group of its own, so it is signalled directly.
void Launcher::signal_live_workers(int signal_number) {
  for (const Worker& worker : workers_) {
    if (!worker.alive) continue;
    if (::kill(-worker.pid, signal_number) != 0) ::kill(worker.pid, signal_number);
  }
}

void Launcher::check_deadlines() {
  const Clock::time_point now = Clock::now();
  if (kill_deadline_ && now >= *kill_deadline_) {
    kill_deadline_.reset();
    signal_live_workers(SIGKILL);
  }
  // (only while a pipe is open: a launcher waiting between rounds with no
  // workers must not find a past deadline and spin)
  if (live_workers_ == 0 && !drain_deadline_ && has_open_pipes()) {
    drain_deadline_ = now + kDrainGrace;
  }
  if (drain_deadline_ && now >= *drain_deadline_) {
    for (Worker& worker : workers_) {
      worker.out.finish();
      worker.err.finish();
    }
  }
}

bool Launcher::has_open_pipes() const {
  for (const Worker& worker : workers_) {
    if (worker.out.is_open() || worker.err.is_open()) return true;
  }
  return false;
}

Worker* Launcher::find_worker(pid_t pid) {
  for (Worker& worker : workers_) {
    if (worker.alive && worker.pid == pid) return &worker;
  }
  return nullptr;
}

}  // namespace tandem::launcher
