// pipeline_bench: a compute-bound MLP pipelined over two processes on this
// host (worker0 drives and holds the even stages, worker1 the odd ones), one
// intra-op thread each, against the same model trained whole in one process.
//
// Model: Linear(I, W) + ReLU, (N - 1) x (Linear(W, W) + ReLU), then
// Linear(W, 10); batch B, SGD. The stages are cut by
// pipeline::balance_by_time (each layer timed here on one micro-batch). The
// first Linear computes no input gradient (its input is the data), so with
// I = W it would cost two thirds of the others and no cut could make equal
// halves (N = 8: 11 and 12 GEMMs of W x W); I = 1.5 W makes it cost what the
// others do, and the halves even (12 and 12).
// Lines, each a Pipe over the same layers, M micro-batches of B / M rows:
//   gpipe, 1f1b, zero-bubble   2 stages, one per worker;
//   interleaved:2              4 stages, 2 per worker;
//   gpipe, 1 stage             the whole model on worker1, one micro-batch:
//                              the framework's own cost.
// Prints per line: {"bench":"pipeline","impl":"tandem","schedule":S,"stages":K,"chunks":M,
//   "samples_per_s":..,"single_worker_samples_per_s":..,"chunked_single_worker_samples_per_s":..,
//   "efficiency":..,"efficiency_vs_chunked":..,"bubble":..,"bubble_per_worker":[..]}
// efficiency: the speedup over one worker divided by GPipe's ideal
// K*M/(M+K-1), K counting workers (the one-stage line: the speedup itself).
// chunked_single_worker_samples_per_s: one worker running the same M
// micro-batches (gradients accumulated, one optimizer step), measured beside
// the whole batch; efficiency_vs_chunked divides by it instead, so it leaves
// out what smaller GEMMs cost this CPU and shows what the schedule and the
// framework lose.
// bubble: the last step's measured idle share, averaged over the workers;
// bubble_per_worker: each worker's.
//
// Usage: pipeline_bench [--steps 10] [--warmup 3] [--batch 2048] [--chunks 8] [--width 1024]
//        [--blocks 8] [--input 1536]
//        [--trace PATH]   (writes the 1F1B line's last step as a Chrome trace)

#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "bench/bench_util.h"
#include "bench/mlp.h"
#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/pipeline/partition.h"
#include "tandem/pipeline/pipe.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/common/host.h"

namespace {

namespace rpc = tandem::rpc;
namespace nn = tandem::nn;
namespace pipeline = tandem::pipeline;
namespace dist = tandem::autograd;
namespace optim = tandem::optim;
using Clock = std::chrono::steady_clock;
using tandem::bench::ms_since;

struct Config : tandem::bench::Mlp {
  int steps = 10, warmup = 3;
  int chunks = 8;
  std::string trace;
};

rpc::AgentOptions options(int rank) {
  rpc::AgentOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.rpc_timeout = std::chrono::minutes(5);
  return o;
}

template <class Step>
double samples_per_s(const Config& c, Step step) {
  return tandem::bench::samples_per_s(c.batch, c.warmup, c.steps, step);
}

// One worker's samples per second, the whole batch at once (chunks 1) or in
// `chunks` micro-batches.
double single_worker(const Config& c, int chunks) {
  return tandem::bench::local_samples_per_s(c, c.warmup, c.steps, chunks);
}

struct Single {
  double whole = 0, chunked = 0;
  // The faster of two measurements of each, taken alternately.
  void measure(const Config& c) {
    whole = std::max(whole, single_worker(c, 1));
    chunked = std::max(chunked, single_worker(c, c.chunks));
  }
  double of(int chunks) const { return chunks == 1 ? whole : chunked; }
};

struct Line {
  std::string schedule;
  int stages, workers;
  int chunks;
  double sps, bubble;
  std::vector<double> bubbles;  // per worker
};

Line run_pipe(const Config& c, const std::string& schedule, std::vector<nn::RemoteModule> stages,
              int chunks, bool trace) {
  pipeline::PipeOptions o;
  o.chunks = chunks;
  o.schedule = schedule;
  pipeline::Pipe pipe(stages, o);
  optim::Options so;
  so.lr = 0.01;
  optim::DistributedOptimizer opt(optim::Kind::kSGD, pipe.parameters(), so);
  const tandem::bench::MlpBatch b = tandem::bench::mlp_batch(c);
  double phase[3] = {0, 0, 0};
  const double sps = samples_per_s(c, [&] {
    auto t0 = Clock::now();
    {
      dist::Context ctx;
      pipe.step(ctx.id(), b.x, b.y);
      phase[0] += ms_since(t0);
      t0 = Clock::now();
      opt.step(ctx.id());
      phase[1] += ms_since(t0);
      t0 = Clock::now();
    }
    phase[2] += ms_since(t0);
  });
  if (std::getenv("TANDEM_BENCH_VERBOSE")) {
    const int n = c.warmup + c.steps;
    std::fprintf(stderr,
                 "pipeline_bench %s: pipe.step %.2f ms, optimizer %.2f ms, release %.2f ms\n",
                 schedule.c_str(), phase[0] / n, phase[1] / n, phase[2] / n);
  }
  const auto& bubble = pipe.last_step().bubble;
  if (trace && !c.trace.empty()) pipe.write_trace(c.trace);
  return {schedule,
          static_cast<int>(stages.size()),
          pipe.workers(),
          chunks,
          sps,
          std::accumulate(bubble.begin(), bubble.end(), 0.0) / bubble.size(),
          bubble};
}

void print(const Line& l, const Single& single) {
  std::string per_worker;
  for (double b : l.bubbles) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%.3f", b);
    per_worker += (per_worker.empty() ? "" : ",") + std::string(buf);
  }
  const double ideal = static_cast<double>(l.workers * l.chunks) / (l.chunks + l.workers - 1);
  const double chunked = single.of(l.chunks);
  std::printf(
      "{\"bench\":\"pipeline\",\"impl\":\"tandem\",\"schedule\":\"%s\",\"stages\":%d,"
      "\"chunks\":%lld,\"samples_per_s\":%.1f,\"single_worker_samples_per_s\":%.1f,"
      "\"chunked_single_worker_samples_per_s\":%.1f,\"efficiency\":%.3f,"
      "\"efficiency_vs_chunked\":%.3f,\"bubble\":%.3f,\"bubble_per_worker\":[%s]}\n",
      l.schedule.c_str(), l.stages, static_cast<long long>(l.chunks), l.sps, single.whole, chunked,
      l.sps / single.whole / ideal, l.sps / chunked / ideal, l.bubble, per_worker.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    tandem::rpc::set_num_threads(1);
    // As rpc::init does, but before the first single-worker run.
    tandem::rpc::retain_freed_memory();
    if (int rc = tandem::bench::serve_as_peer("worker1", options(1)); rc >= 0) return rc;
    Config c;
    tandem::bench::Flags flags("pipeline_bench");
    flags.add("--steps", &c.steps, 1).add("--warmup", &c.warmup, 0);
    flags.add("--batch", &c.batch, 1).add("--chunks", &c.chunks, 1).add("--width", &c.width, 1);
    flags.add("--blocks", &c.blocks, 1).add("--input", &c.input, 1);
    flags.add("--trace", &c.trace);
    if (!flags.parse(argc, argv)) return 2;

    // The single-worker baselines are measured before the pipelines and after
    // (with worker1 gone), and the faster of the two is used.
    Single single;
    single.measure(c);
    pid_t child = tandem::bench::spawn_peer("worker1");
    rpc::init(std::make_shared<rpc::Registry>(), options(0));
    std::vector<Line> lines;
    {
      // Stages of even measured time, each layer timed here on one micro-batch.
      const auto all = tandem::bench::mlp_layers(c);
      const at::Tensor sample =
          tandem::bench::mlp_batch(c).x.narrow(0, 0, std::max(1, c.batch / c.chunks));
      const auto times = pipeline::layer_times(all, sample);
      auto counts = [&](int stages) {
        auto n = pipeline::balance(times, stages);
        if (std::getenv("TANDEM_BENCH_VERBOSE")) {
          std::string text;
          for (int k : n) text += " " + std::to_string(k);
          std::fprintf(stderr, "pipeline_bench: %d stages of%s layers\n", stages, text.c_str());
        }
        return n;
      };
      const auto two_counts = counts(2);
      auto two = [&] {
        return pipeline::partition(all, {"worker0/cpu", "worker1/cpu"}, two_counts);
      };
      lines.push_back(run_pipe(c, "gpipe", two(), c.chunks, false));
      lines.push_back(run_pipe(c, "1f1b", two(), c.chunks, true));
      lines.push_back(run_pipe(c, "zero-bubble", two(), c.chunks, false));
      if (c.chunks % 2 == 0 && all.size() >= 4) {
        auto four = pipeline::partition(
            all, {"worker0/cpu", "worker1/cpu", "worker0/cpu", "worker1/cpu"}, counts(4));
        lines.push_back(run_pipe(c, "interleaved", four, c.chunks, false));
      }
      lines.push_back(run_pipe(
          c, "gpipe", pipeline::partition(all, {"worker1/cpu"}, {static_cast<int>(all.size())}), 1,
          false));
    }
    rpc::shutdown(true);
    tandem::support::wait_exit(child);
    single.measure(c);
    for (const auto& l : lines) print(l, single);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_bench: %s\n", e.what());
    return 1;
  }
}
