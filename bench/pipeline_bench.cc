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
//   "samples_per_s":..,"single_worker_samples_per_s":..,"efficiency":..,"bubble":..,
//   "bubble_per_worker":[..]}
// efficiency: the speedup over one worker divided by GPipe's ideal
// K*M/(M+K-1), K counting workers (the one-stage line: the speedup itself).
// bubble: the last step's measured idle share, averaged over the workers;
// bubble_per_worker: each worker's.
//
// Usage: pipeline_bench [--steps 10] [--warmup 3] [--batch 2048] [--chunks 8] [--width 1024]
//        [--blocks 8] [--input 1536]
//        [--trace PATH]   (writes the 1F1B line's last step as a Chrome trace)
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>

#include "bench/bench_util.h"
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

constexpr int64_t kClasses = 10;

struct Config {
  int steps = 10, warmup = 3;
  int batch = 2048, chunks = 8, width = 1024, blocks = 8, input = 1536;
  std::string trace;
};

rpc::AgentOptions options(int rank) {
  rpc::AgentOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.rpc_timeout = std::chrono::minutes(5);
  return o;
}

// The model's layers: blocks x (Linear + ReLU), the first from the input's width,
// then the head.
std::vector<c10::IValue> layers(const Config& c) {
  std::vector<c10::IValue> out;
  for (int i = 0; i < c.blocks; ++i) {
    out.push_back(nn::spec("Linear", {int64_t{i == 0 ? c.input : c.width}, int64_t{c.width}}));
    out.push_back(nn::spec("ReLU"));
  }
  out.push_back(nn::spec("Linear", {int64_t{c.width}, kClasses}));
  return out;
}

struct Batch {
  at::Tensor x, y;
};
Batch batch(const Config& c) {
  at::manual_seed(1);
  return {at::randn({int64_t{c.batch}, int64_t{c.input}}),
          at::randint(0, kClasses, {int64_t{c.batch}}, at::kLong)};
}

// Samples per second of `step`: the batch over the median of c.steps step
// times after c.warmup (a median, so that one stall of this shared VM does
// not decide a line).
template <class Step>
double samples_per_s(const Config& c, Step step) {
  std::vector<double> ms;
  for (int i = 0; i < c.warmup + c.steps; ++i) {
    const auto start = Clock::now();
    step();
    if (i >= c.warmup) ms.push_back(ms_since(start));
  }
  return c.batch / (tandem::bench::median(ms) / 1e3);
}

double single_worker(const Config& c) {
  std::vector<torch::nn::Linear> layers;
  std::vector<at::Tensor> params;
  for (int i = 0; i < c.blocks; ++i) layers.emplace_back(i == 0 ? c.input : c.width, c.width);
  layers.emplace_back(c.width, kClasses);
  for (auto& l : layers) {
    for (auto& p : l->parameters()) params.push_back(p);
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.01));
  Batch b = batch(c);
  return samples_per_s(c, [&] {
    opt.zero_grad();
    at::Tensor h = b.x;
    for (size_t i = 0; i < layers.size(); ++i) {
      h = layers[i](h);
      if (i + 1 < layers.size()) h = at::relu(h);
    }
    torch::nn::functional::cross_entropy(h, b.y).backward();
    opt.step();
  });
}

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
  Batch b = batch(c);
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

void print(const Line& l, double single) {
  std::string per_worker;
  for (double b : l.bubbles) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%.3f", b);
    per_worker += (per_worker.empty() ? "" : ",") + std::string(buf);
  }
  const double ideal = static_cast<double>(l.workers * l.chunks) / (l.chunks + l.workers - 1);
  std::printf(
      "{\"bench\":\"pipeline\",\"impl\":\"tandem\",\"schedule\":\"%s\",\"stages\":%d,"
      "\"chunks\":%lld,\"samples_per_s\":%.1f,\"single_worker_samples_per_s\":%.1f,"
      "\"efficiency\":%.3f,\"bubble\":%.3f,\"bubble_per_worker\":[%s]}\n",
      l.schedule.c_str(), l.stages, static_cast<long long>(l.chunks), l.sps, single,
      l.sps / single / ideal, l.bubble, per_worker.c_str());
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

    // The single-worker baseline is measured before the pipelines and after
    // (with worker1 gone), and the faster of the two is used.
    double single = single_worker(c);
    pid_t child = tandem::bench::spawn_peer("worker1");
    rpc::init(std::make_shared<rpc::Registry>(), options(0));
    std::vector<Line> lines;
    {
      // Stages of even measured time, each layer timed here on one micro-batch.
      const auto all = layers(c);
      const at::Tensor sample = batch(c).x.narrow(0, 0, std::max(1, c.batch / c.chunks));
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
    single = std::max(single, single_worker(c));
    for (const auto& l : lines) print(l, single);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_bench: %s\n", e.what());
    return 1;
  }
}
