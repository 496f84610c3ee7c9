// What a failure costs the main demo (examples/gpt, 2 x 2 on 4 local
// processes) under tandem-run --max-restarts, and what its checkpoints cost
// the steps. Three runs of the same job (--steps 60, a checkpoint every 10):
//   1. uninterrupted, checkpoints in the background: its final loss, and
//      how long a save held its step (the median; gpt prints it) and how
//      much of that was copying the state;
//   2. the same with --checkpoint-sync: a save written and committed in the
//      step;
//   3. under --max-restarts 3, worker 3 (a stage worker of replica 1) killed
//      by SIGKILL right after step 35 is printed: the time from the kill to
//      the first step printed after the restart, and the steps done again
//      (the last step printed before the kill minus the step it resumed
//      from); its final loss should be run 1's.
// Prints one JSON line:
//   {"bench":"restart","impl":"tandem","workers":4,"restart_s":..,"steps_lost":..,
//    "checkpoint_every":10,"final_loss":..,"uninterrupted_loss":..,
//    "async_stall_ms":..,"sync_stall_ms":..,"copy_ms":..}
// Usage: restart_bench [--steps 60] [--every 10] [--kill-after 35]
// (tandem-run and gpt are taken from this program's own directory.)
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "bench/bench_util.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Run {
  std::optional<double> final_loss;
  double stall_ms = -1, copy_ms = -1;
  std::optional<double> restart_s;
  int64_t resumed_from = -1;
  int64_t last_before_kill = -1;
  int status = -1;
};

// The pid of the job's worker `rank` in round 0 (its environment has `tag`).
pid_t find_worker(const std::string& tag, int rank) {
  return tandem::bench::find_process(
      "gpt",
      {"RESTART_BENCH_TAG=" + tag, "RANK=" + std::to_string(rank), "TANDEM_RESTART_COUNT=0"});
}

// Runs the job; with kill_after > 0, kills worker 3 once that step is printed.
Run run_job(const std::string& args, int kill_after, const std::string& tag) {
  const std::string dir = tandem::bench::self_dir();
  const std::string cmd = "RESTART_BENCH_TAG=" + tag + " " + dir + "/tandem-run" +
                          (kill_after > 0 ? " --max-restarts 3" : "") + " --nproc-per-node 4 " +
                          dir + "/gpt --pp 2 --dp 2 " + args + " 2>&1";
  Run r;
  FILE* out = ::popen(cmd.c_str(), "r");
  if (!out) return r;
  char line[4096];
  std::optional<Clock::time_point> killed;
  bool restarted = false;
  while (std::fgets(line, sizeof line, out)) {
    const std::string l(line);
    long long step = 0, total = 0;
    const size_t at = l.find("step ");
    const bool progress = at != std::string::npos && l.find("loss") != std::string::npos &&
                          std::sscanf(l.c_str() + at, "step %lld/%lld", &step, &total) == 2;
    if (progress && !killed) r.last_before_kill = step;
    if (progress && kill_after > 0 && !killed && step == kill_after) {
      const pid_t victim = find_worker(tag, 3);
      if (victim > 0 && ::kill(victim, SIGKILL) == 0) killed = Clock::now();
    }
    if (const size_t f = l.find("gpt: restart 1: from step "); f != std::string::npos) {
      r.resumed_from = std::atoll(l.c_str() + f + 26);
      restarted = true;
    }
    if (progress && restarted && killed && !r.restart_s) {
      r.restart_s = std::chrono::duration<double>(Clock::now() - *killed).count();
    }
    if (const size_t f = l.find("final step "); f != std::string::npos) {
      const size_t k = l.find(" loss ", f);
      if (k != std::string::npos) r.final_loss = std::atof(l.c_str() + k + 6);
    }
    if (const size_t f = l.find("a save held its step "); f != std::string::npos) {
      r.stall_ms = std::atof(l.c_str() + f + 21);
      const std::string copying = "copying the state to host memory ";
      const size_t c = l.find(copying, f);
      if (c != std::string::npos) r.copy_ms = std::atof(l.c_str() + c + copying.size());
    }
  }
  r.status = ::pclose(out);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 60, every = 10, kill_after = 35;
  tandem::bench::Flags flags("restart_bench");
  flags.add("--steps", &steps, 2).add("--every", &every, 1).add("--kill-after", &kill_after, 1);
  if (!flags.parse(argc, argv)) return 2;
  if (kill_after >= steps) {
    std::fprintf(stderr, "restart_bench: --kill-after must come before --steps\n");
    return 2;
  }
  char tmpl[] = "/tmp/tandem-restart-bench-XXXXXX";
  const std::string tmp = ::mkdtemp(tmpl);
  const std::string common = "--steps " + std::to_string(steps) + " --checkpoint-every " +
                             std::to_string(every) + " --log-every 1 --sample 0 --checkpoint ";
  const std::string tag = std::to_string(::getpid());
  const Run plain = run_job(common + tmp + "/a", 0, tag + "a");
  const Run sync = run_job(common + tmp + "/s --checkpoint-sync", 0, tag + "s");
  const Run killed = run_job(common + tmp + "/k", kill_after, tag + "k");
  std::system(("rm -rf " + tmp).c_str());
  if (plain.status != 0 || sync.status != 0 || killed.status != 0 || !plain.final_loss ||
      !killed.final_loss || !killed.restart_s) {
    std::fprintf(stderr,
                 "restart_bench: a run failed (exit %d, %d, %d) or said too little (restart "
                 "%s)\n",
                 plain.status, sync.status, killed.status, killed.restart_s ? "seen" : "not seen");
    return 1;
  }
  std::printf(
      "{\"bench\":\"restart\",\"impl\":\"tandem\",\"workers\":4,\"restart_s\":%.3f,"
      "\"steps_lost\":%lld,\"checkpoint_every\":%lld,\"final_loss\":%.6f,"
      "\"uninterrupted_loss\":%.6f,\"async_stall_ms\":%.2f,\"sync_stall_ms\":%.2f,"
      "\"copy_ms\":%.2f}\n",
      *killed.restart_s, static_cast<long long>(killed.last_before_kill - killed.resumed_from),
      static_cast<long long>(every), *killed.final_loss, *plain.final_loss, plain.stall_ms,
      sync.stall_ms, plain.copy_ms);
  return 0;
}
