// tp_bench: one transformer block split over tp ranks (parallel/transformer.h),
// forward and backward, each rank a process of its own on this host (started
// by tandem::spawn, one intra-op thread a process): what a rank holds, what
// it sends, and how long a step takes, with and without sequence parallelism
// and activation recomputation.
//
// The block: --width (1024) with --heads (16), an MLP 4x wide, causal
// attention over --seq (64) positions of --batch (4) sequences, fp32; the
// loss the sum of the output's squares.
//
// Prints a line per (tp, sp, recompute):
//   {"bench":"tp","impl":"tandem","tp":N,"sp":bool,"recompute":bool,"ms":..,
//    "param_bytes_per_rank":..,"whole_param_bytes":..,"activation_bytes_per_rank":..,
//    "sent_bytes_per_rank":..,"expected_sent_bytes":..,"ms_per_tp1":..}
// ms: rank 0's median step over --steps after --warmup. param_bytes_per_rank:
// the block's parameters rank 0 holds. activation_bytes_per_rank: what rank
// 0's forward left allocated for backward (malloc's bytes in use after the
// forward, once the group is quiet, less before it: the saved activations
// and the output; the median over the steps, as a backend thread's scratch
// buffers come and go).
// sent_bytes_per_rank: bytes rank 0 wrote to its sockets in a step
// (/proc/self/io wchar; nothing else writes meanwhile). expected_sent_bytes:
// Megatron's count for a block, two all-reduces of the activation forward and
// two backward, each sending 2 (tp - 1) / tp of it; with sequence parallelism
// two all-gathers and two reduce-scatters forward, each (tp - 1) / tp of it,
// and backward their adjoints plus the two column-parallel inputs gathered
// again (Megatron's way of holding only a piece of them: 1.25x the bytes
// without it); recomputation's forward again on top. ms_per_tp1: ms over the tp 1 line's (same recompute) in this
// run: the step's share of one process's time.
//
// Usage: tp_bench [--steps 8] [--warmup 1] [--width 1024] [--heads 16] [--seq 64]
//        [--batch 4] [--tps 1,2,4]
#include <ATen/ops/randn.h>
#include <ATen/ops/sum.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "bench/bench_util.h"
#include "tandem/ddp/process_group.h"
#include "tandem/parallel/recompute.h"
#include "tandem/parallel/transformer.h"
#include "tandem/rpc/common/host.h"
#include "tandem/rpc/spawn.h"

namespace {

namespace ddp = tandem::ddp;
namespace par = tandem::parallel;
namespace tnn = torch::nn;
using Clock = std::chrono::steady_clock;
using tandem::bench::ms_since;

struct Config {
  int steps = 8, warmup = 1, width = 1024, heads = 16, seq = 64, batch = 4;
  std::string tps = "1,2,4";
};

struct Result {
  int64_t params = 0, whole_params = 0, activations = 0, sent = 0;
  double ms = 0;
};

int64_t in_use() {
  const struct mallinfo2 m = ::mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

int64_t written() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  return 0;
}

// One rank of a job: rank 0 writes what it measured to `out`.
void worker(const Config& c, bool sp, bool again, const std::string& out) {
  // glibc keeps the block's buffers for the next step instead of giving
  // them back to the kernel and faulting them in again (as a GPU's caching
  // allocator keeps them): otherwise recomputation, which frees the
  // forward's activations at once and makes them again in backward, pays
  // about a tenth of a step more in page faults.
  ::mallopt(M_MMAP_THRESHOLD, 256 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  tandem::rpc::set_num_threads(1);
  ddp::init_process_group("gloo");
  auto tp = ddp::default_group_ptr();
  // The whole block, drawn alike on every rank, then split.
  at::manual_seed(0);
  tnn::LayerNorm ln1(tnn::LayerNormOptions({c.width})), ln2(tnn::LayerNormOptions({c.width}));
  tnn::Linear qkv(c.width, 3 * c.width), proj(c.width, c.width), fc(c.width, 4 * c.width),
      down(4 * c.width, c.width);
  Result r;
  for (tnn::Module* m : std::vector<tnn::Module*>{ln1.get(), ln2.get(), qkv.get(), proj.get(),
                                                  fc.get(), down.get()}) {
    for (const auto& p : m->parameters()) r.whole_params += p.numel() * 4;
  }
  par::BlockOptions o;
  o.sequence_parallel = sp;
  par::ParallelBlock block(ln1, qkv, proj, ln2, fc, down, c.heads, tp, o);
  for (const auto& p : block->parameters()) r.params += p.numel() * p.element_size();
  // Each rank's input: the whole sequence, or its piece of it.
  const int64_t seq = sp ? c.seq / tp->size() : c.seq;
  const at::Tensor x0 = at::randn({c.batch, seq, c.width});
  std::vector<double> ms, held_bytes;
  for (int i = 0; i < c.warmup + c.steps; ++i) {
    block->zero_grad();
    at::Tensor x = x0.clone().requires_grad_();
    auto fn = [&](const at::Tensor& h) { return block(h); };
    tp->barrier();
    const int64_t sent0 = written(), held0 = in_use();
    const auto t0 = Clock::now();
    at::Tensor y = again ? tandem::nn::recompute(fn, x, block->parameters()) : fn(x);
    // (the group quiet first, untimed: Gloo's thread lets a collective's
    // buffers go a moment after the collective returns, and the forward's
    // last one, a reduce-scatter under sequence parallelism, would count)
    const auto paused = Clock::now();
    if (tp->size() > 1) tp->barrier();
    const int64_t held = in_use() - held0;
    const double pause_ms = ms_since(paused);
    at::sum(y * y).backward();
    if (sp) par::all_reduce_partial_grads(*block, tp);
    const double step_ms = ms_since(t0) - pause_ms;
    const int64_t sent = written() - sent0;
    if (i >= c.warmup) {
      ms.push_back(step_ms);
      held_bytes.push_back(static_cast<double>(held));
      r.sent = sent;
    }
  }
  r.ms = tandem::bench::median(ms);
  r.activations = static_cast<int64_t>(tandem::bench::median(held_bytes));
  if (tp->rank() == 0) {
    std::ofstream f(out);
    f << r.params << " " << r.whole_params << " " << r.activations << " " << r.sent << " " << r.ms
      << "\n";
  }
  ddp::destroy_process_group();
}

// Megatron's count of what a rank sends for the block in a step (see the top).
int64_t expected_sent(const Config& c, int tp, bool sp, bool again) {
  if (tp == 1) return 0;
  const double activation = static_cast<double>(c.batch) * c.seq * c.width * 4;
  const double per_half = (tp - 1.0) / tp * activation;  // an all-gather or a reduce-scatter
  const double forwards = again ? 2 : 1;  // recomputation runs the forward twice
  // Without sequence parallelism: 2 all-reduces (2 halves each) a forward and 2
  // backward. With it: 2 all-gathers and 2 reduce-scatters a forward; backward
  // their adjoints and, as Megatron, the 2 column-parallel inputs gathered again.
  return static_cast<int64_t>(sp ? (4 * forwards + 6) * per_half
                                 : (2 * forwards + 2) * 2 * per_half);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config c;
    tandem::bench::Flags flags("tp_bench");
    flags.add("--steps", &c.steps, 1).add("--warmup", &c.warmup, 0);
    flags.add("--width", &c.width, 1).add("--heads", &c.heads, 1).add("--seq", &c.seq, 1);
    flags.add("--batch", &c.batch, 1).add("--tps", &c.tps);
    if (!flags.parse(argc, argv)) return 2;

    // A worker of one job (TANDEM_TP=SP,RECOMPUTE,TP,OUT set by the caller
    // below): spawn() runs its part and ends the process.
    if (const char* job = std::getenv("TANDEM_TP")) {
      std::vector<std::string> f = tandem::bench::split_commas(job);
      if (f.size() != 4) return 2;
      tandem::spawn(std::atoi(f[2].c_str()),
                    [&](int, int) { worker(c, f[0] == "1", f[1] == "1", f[3]); });
      return 0;
    }
    std::map<bool, double> tp1_ms;  // by recompute
    for (const auto& tp_text : tandem::bench::split_commas(c.tps)) {
      const int tp = std::atoi(tp_text.c_str());
      if (tp < 1 || c.heads % tp != 0 || c.seq % tp != 0) {
        std::fprintf(stderr,
                     "tp_bench: --tps takes group sizes that divide --heads and --seq, not '%s'\n",
                     tp_text.c_str());
        return 2;
      }
      for (bool sp : {false, true}) {
        if (sp && tp == 1) continue;  // (nothing to split the sequence over)
        for (bool again : {false, true}) {
          char path[] = "/tmp/tp_bench.XXXXXX";
          const int fd = ::mkstemp(path);
          if (fd < 0) throw std::runtime_error("cannot make a temporary file");
          ::close(fd);
          const std::string job = std::string(sp ? "1" : "0") + "," + (again ? "1" : "0") + "," +
                                  std::to_string(tp) + "," + path;
          ::setenv("TANDEM_TP", job.c_str(), 1);
          tandem::spawn(tp, [](int, int) {});  // (the caller: fn never runs here)
          ::unsetenv("TANDEM_TP");
          Result r;
          std::ifstream(path) >> r.params >> r.whole_params >> r.activations >> r.sent >> r.ms;
          std::remove(path);
          if (tp == 1) tp1_ms[again] = r.ms;
          std::printf(
              "{\"bench\":\"tp\",\"impl\":\"tandem\",\"tp\":%d,\"sp\":%s,\"recompute\":%s,"
              "\"ms\":%.1f,\"param_bytes_per_rank\":%lld,\"whole_param_bytes\":%lld,"
              "\"activation_bytes_per_rank\":%lld,\"sent_bytes_per_rank\":%lld,"
              "\"expected_sent_bytes\":%lld%s}\n",
              tp, sp ? "true" : "false", again ? "true" : "false", r.ms,
              static_cast<long long>(r.params), static_cast<long long>(r.whole_params),
              static_cast<long long>(r.activations), static_cast<long long>(r.sent),
              static_cast<long long>(expected_sent(c, tp, sp, again)),
              tp1_ms.count(again)
                  ? (",\"ms_per_tp1\":" + std::to_string(r.ms / tp1_ms[again])).c_str()
                  : "");
          std::fflush(stdout);
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_bench: %s\n", e.what());
    return 1;
  }
}
