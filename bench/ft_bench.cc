// What a failure costs a data-parallel job: per-step fault tolerance
// (tandem::ft, examples/ft_mlp under tandem-run --replace-failed) beside the
// restart-the-world way (ft_mlp --restart under --max-restarts, a checkpoint
// every 10 steps), in one run. Four replicas on this host; replica 3 is
// killed by SIGKILL right after step --kill-after is printed. A third mode,
// hsdp, runs the four processes as two HSDP replicas of two (ft_mlp
// --replica-size 2) and kills rank 3 (replica 1's second): its replica sits
// out until the replacement is healed, and the survivors are replica 0's.
// A fourth, pp_dp, is the same with each replica a pipeline row (ft_mlp
// --pipeline: a stage a rank, a Pipe over the row's own RPC agent).
// Prints a JSON line a mode:
//   {"bench":"ft","impl":"tandem","mode":"per_step|hsdp|pp_dp|restart","replicas":4,"step_ms":..,
//    "survivor_pause_ms":..,"steps_lost":..,"heal_ms":..,"heal_bytes":..,
//    "state_bytes":..,"rejoin_s":..,"final_loss":..,"reference_loss":..}
// step_ms: the median time between committed steps before the kill;
// survivor_pause_ms: the longest such time from the kill on, on a replica
// that was not killed; steps_lost: per_step, the steps committed by none;
// restart, the steps done again (the last printed before the kill minus the
// checkpoint's); heal_*: the replacement's healing (per_step; 0 for restart,
// which reads the state from disk); rejoin_s: from the replacement's process
// start (restart: the new round's first process) to its first committed
// step; reference_loss: ft_mlp --reference over the quorums the replicas
// printed (1e-5 relative is the target).
// --timeline PATH writes "mode,t_s,step" rows (t from the kill) for
// bench/plot.py's throughput picture.
// Usage: ft_bench [--steps 300] [--kill-after 105] [--width 256] [--step-ms 10]
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_util.h"

namespace {

using Clock = std::chrono::steady_clock;

int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The pid of the job's worker `rank` (its environment has `tag`).
pid_t find_worker(const std::string& tag, int rank) {
  return tandem::bench::find_process("ft_mlp",
                                     {"FT_BENCH_TAG=" + tag, "RANK=" + std::to_string(rank)});
}

struct Step {
  int rank;
  int64_t step;
  int k;
  int64_t t;  // wall ms
};

struct Run {
  std::vector<Step> steps;
  std::vector<int64_t> failed;  // failed step numbers (any replica)
  int64_t kill_t = 0;
  int64_t last_before_kill = 0;
  int64_t resumed_from = -1;
  std::optional<double> final_loss;
  double heal_ms = 0;
  int64_t heal_bytes = 0, state_bytes = 0;
  int64_t replacement_start_t = 0;  // wall ms its process began
  int status = -1;
};

Run run_job(const std::string& args, bool per_step, int kill_after, const std::string& tag) {
  const std::string dir = tandem::bench::self_dir();
  const std::string cmd = "FT_BENCH_TAG=" + tag + " " + dir + "/tandem-run " +
                          (per_step ? "--replace-failed 1" : "--max-restarts 1") +
                          " --nproc-per-node 4 " + dir + "/ft_mlp " + args +
                          (per_step ? "" : " --restart") + " 2>&1";
  Run r;
  FILE* out = ::popen(cmd.c_str(), "r");
  if (!out) return r;
  char line[8192];
  bool killed = false;
  while (std::fgets(line, sizeof line, out)) {
    int rank = -1;
    char rest[8192];
    if (std::sscanf(line, "[%d]: %8191[^\n]", &rank, rest) != 2) continue;
    const std::string l(rest);
    long long s = 0, t = 0, a = 0, b = 0;
    int k = 0;
    double loss = 0, ms = 0;
    if (std::sscanf(l.c_str(), "step %lld k %d loss %lf t %lld", &s, &k, &loss, &t) == 4) {
      r.steps.push_back({rank, s, k, t});
      if (!killed) r.last_before_kill = std::max<int64_t>(r.last_before_kill, s);
      if (!killed && s == kill_after) {
        const pid_t victim = find_worker(tag, 3);
        if (victim > 0 && ::kill(victim, SIGKILL) == 0) {
          killed = true;
          r.kill_t = wall_ms();
        }
      }
    } else if (std::sscanf(l.c_str(), "failed step %lld t %lld", &s, &t) == 2) {
      r.failed.push_back(s);
    } else if (std::sscanf(l.c_str(), "healed bytes %lld state %lld ms %lf", &a, &b, &ms) == 3 &&
               killed && rank == 3) {
      r.heal_bytes = a;
      r.state_bytes = b;
      r.heal_ms = ms;
    } else if (std::sscanf(l.c_str(), "started age_ms %lld t %lld", &a, &t) == 2 && killed &&
               r.replacement_start_t == 0) {
      r.replacement_start_t = t - a;
    } else if (std::sscanf(l.c_str(), "resumed %lld", &s) == 1) {
      r.resumed_from = s;
    } else if (l.rfind("final step ", 0) == 0) {
      const size_t at = l.find(" loss ");
      if (at != std::string::npos) r.final_loss = std::atof(l.c_str() + at + 6);
    }
  }
  r.status = ::pclose(out);
  return r;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 300, kill_after = 105, width = 256, step_ms = 10;
  std::string timeline;
  tandem::bench::Flags flags("ft_bench");
  flags.add("--steps", &steps, 2)
      .add("--kill-after", &kill_after, 1)
      .add("--width", &width, 1)
      .add("--step-ms", &step_ms, 0)
      .add("--timeline", &timeline);
  if (!flags.parse(argc, argv)) return 2;
  if (kill_after >= steps) {
    std::fprintf(stderr, "ft_bench: --kill-after must come before --steps\n");
    return 2;
  }
  char tmpl[] = "/tmp/tandem-ft-bench-XXXXXX";
  if (!::mkdtemp(tmpl)) return 1;
  const std::string scratch = tmpl;
  const std::string common = "--steps " + std::to_string(steps) + " --width " +
                             std::to_string(width) + " --step-ms " + std::to_string(step_ms);
  std::ofstream rows;
  if (!timeline.empty()) {
    rows.open(timeline);
    rows << "mode,t_s,step\n";
  }
  int rc = 0;
  for (const std::string mode : {"per_step", "hsdp", "pp_dp", "restart"}) {
    // hsdp and pp_dp: two replicas of two processes
    const bool per_step = mode != "restart", pairs = mode == "hsdp" || mode == "pp_dp";
    const std::string args =
        common + (per_step ? "" : " --checkpoint " + scratch + "/ckpt --checkpoint-every 10") +
        (pairs ? " --replica-size 2" : "") + (mode == "pp_dp" ? " --pipeline" : "");
    Run r = run_job(args, per_step, kill_after, mode + std::to_string(::getpid()));
    if (r.status != 0 || !r.final_loss || r.kill_t == 0) {
      std::fprintf(stderr, "ft_bench: the %s run failed (status %d%s)\n", mode.c_str(), r.status,
                   r.kill_t == 0 ? ", replica 3 was never killed" : "");
      rc = 1;
      continue;
    }
    // Step times before the kill, and the longest gap after it, per survivor.
    std::map<int, std::vector<Step>> by_rank;
    for (const Step& s : r.steps) by_rank[s.rank].push_back(s);
    std::vector<double> before;
    double pause = 0;
    for (auto& [rank, list] : by_rank) {
      for (size_t i = 1; i < list.size(); ++i) {
        const double gap = static_cast<double>(list[i].t - list[i - 1].t);
        if (list[i].t <= r.kill_t) {
          if (i > 5) before.push_back(gap);  // (past the first steps' warm-up)
        } else if (!per_step || (rank != 3 && !(pairs && rank == 2))) {
          // a survivor's (restart: every worker's; pairs: replica 0's)
          pause = std::max(pause, gap);
        }
      }
    }
    // The quorums, by step, for the reference.
    std::map<int64_t, int> ks;
    for (const Step& s : r.steps) ks[s.step] = s.k;
    std::string list;
    for (const auto& [s, k] : ks) list += (list.empty() ? "" : ",") + std::to_string(k);
    // (the reference is the same for hsdp, each replica's batch split over
    // its ranks, and for pp_dp, in micro-batches: their mean is the batch's)
    const std::string ref_cmd =
        tandem::bench::self_dir() + "/ft_mlp " + common + " --reference " + list;
    std::optional<double> reference;
    if (FILE* ref = ::popen(ref_cmd.c_str(), "r")) {
      char line[1024];
      while (std::fgets(line, sizeof line, ref)) {
        const char* at = std::strstr(line, " loss ");
        if (std::strncmp(line, "final step", 10) == 0 && at) reference = std::atof(at + 6);
      }
      ::pclose(ref);
    }
    // Rejoin: from the replacement's (or the new round's) process start to
    // its first committed step.
    double rejoin_s = 0;
    for (const Step& s : r.steps) {
      if (r.replacement_start_t > 0 && s.t > r.replacement_start_t && (s.rank == 3 || !per_step)) {
        rejoin_s = static_cast<double>(s.t - r.replacement_start_t) / 1000.0;
        break;
      }
    }
    std::vector<int64_t> failed = r.failed;
    std::sort(failed.begin(), failed.end());
    failed.erase(std::unique(failed.begin(), failed.end()), failed.end());
    const int64_t lost = per_step ? static_cast<int64_t>(failed.size())
                                  : r.last_before_kill - std::max<int64_t>(r.resumed_from, 0);
    std::printf(
        "{\"bench\":\"ft\",\"impl\":\"tandem\",\"mode\":\"%s\",\"replicas\":%d,\"step_ms\":%.2f,"
        "\"survivor_pause_ms\":%.1f,\"steps_lost\":%lld,\"heal_ms\":%.1f,\"heal_bytes\":%lld,"
        "\"state_bytes\":%lld,\"rejoin_s\":%.2f,\"final_loss\":%.9g,\"reference_loss\":%.9g}\n",
        mode.c_str(), pairs ? 2 : 4, median(before), pause, static_cast<long long>(lost), r.heal_ms,
        static_cast<long long>(r.heal_bytes), static_cast<long long>(r.state_bytes), rejoin_s,
        *r.final_loss, reference.value_or(-1));
    std::fflush(stdout);
    if (rows.is_open() && !pairs) {
      for (const Step& s : r.steps) {
        if (s.rank != 0) continue;
        rows << mode << "," << static_cast<double>(s.t - r.kill_t) / 1000.0 << "," << s.step
             << "\n";
      }
    }
  }
  std::system(("rm -rf " + scratch).c_str());
  return rc;
}
