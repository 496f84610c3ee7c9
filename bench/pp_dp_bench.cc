// pp_dp_bench: pipeline x data parallelism on this host. The MLP of
// pipeline_bench (blocks x (Linear + ReLU), then a head; SGD) trained on one
// global batch of B rows by a job of pp x dp processes laid out by a Mesh:
// each replica's pipe of pp stages (cut by measured layer times) runs its
// B / dp rows in M micro-batches by 1F1B, and each stage's gradients are
// averaged over its dp replicas (PipeOptions::data_parallel_group). One
// intra-op thread a process. Layouts 1 x 1, 1 x 2, 2 x 1 and 2 x 2; each a
// job of its own, started by tandem::spawn.
//
// Prints per layout: {"bench":"pp_dp","impl":"tandem","pp":K,"dp":D,"schedule":"1f1b",
//   "chunks":M,"batch":B,"samples_per_s":..,"speedup":..,"ideal":..,"efficiency":..,
//   "allreduce_ms":..,"allreduce_hidden":..,"local_samples_per_s":..}
// speedup: samples/s over the 1 x 1 job's (the same framework, one
// process); ideal: dp * pp*M / (M + pp - 1) (GPipe's bubble, dp replicas);
// efficiency: speedup / ideal; allreduce_ms: a step's stage averages, from
// the first launch to the last end, per stage, mean over the measured
// steps; allreduce_hidden: the share of their time spent while passes still
// ran (StepStats::allreduce_hidden, mean over the measured steps);
// local_samples_per_s: the same model trained whole in plain LibTorch here.
//
// Usage: pp_dp_bench [--steps 10] [--warmup 3] [--batch 1024] [--chunks 4] [--width 1024]
//        [--blocks 8] [--input 1536] [--layouts 11,12,21,22]
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "bench/bench_util.h"
#include "bench/mlp.h"
#include "tandem/autograd/autograd.h"
#include "tandem/mesh/mesh.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/pipeline/partition.h"
#include "tandem/pipeline/pipe.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/common/host.h"
#include "tandem/rpc/spawn.h"

namespace {

namespace rpc = tandem::rpc;
namespace pipeline = tandem::pipeline;
namespace dist = tandem::autograd;
namespace optim = tandem::optim;
using Clock = std::chrono::steady_clock;
using tandem::bench::ms_since;

struct Config : tandem::bench::Mlp {
  Config() { batch = 1024; }
  int steps = 10, warmup = 3;
  int chunks = 4;
  std::string layouts = "11,12,21,22";
};

struct Result {
  double samples_per_s = 0, allreduce_ms = 0, hidden = 0;
};

// One rank of a pp x dp job: drivers (pp = 0) train their replica; rank 0
// writes the result to `out`.
void worker(const Config& c, int pp, int dp, const std::string& out) {
  rpc::set_num_threads(1);
  rpc::init(std::make_shared<rpc::Registry>());
  {
    tandem::Mesh mesh({{"pp", pp}, {"dp", dp}});
    if (mesh.coordinate("pp") == 0) {
      const auto all = tandem::bench::mlp_layers(c);
      const int per_replica = c.batch / dp;
      // Every replica cuts alike: rank 0 measures, the drivers take its counts.
      at::Tensor counts = at::zeros({pp}, at::kLong);
      if (mesh.rank() == 0) {
        const at::Tensor sample =
            tandem::bench::mlp_batch(c).x.narrow(0, 0, std::max(1, per_replica / c.chunks));
        const auto n = pipeline::balance(pipeline::layer_times(all, sample), pp);
        for (int s = 0; s < pp; ++s) counts[s] = n[static_cast<size_t>(s)];
      }
      if (dp > 1) mesh.group("dp")->broadcast(counts, 0);
      std::vector<std::string> devices;
      std::vector<int> per_stage;
      for (int s = 0; s < pp; ++s) {
        devices.push_back(mesh.worker_at({{"pp", s}}) + "/cpu");
        per_stage.push_back(static_cast<int>(counts[s].item<int64_t>()));
      }
      pipeline::PipeOptions o;
      o.chunks = c.chunks;
      o.schedule = "1f1b";
      o.data_parallel_group = mesh.group_name("dp");
      pipeline::Pipe pipe(pipeline::partition(all, devices, per_stage), o);
      optim::Options so;
      so.lr = 0.01;
      optim::DistributedOptimizer opt(optim::Kind::kSGD, pipe.parameters(), so);
      const tandem::bench::MlpBatch b = tandem::bench::mlp_batch(c);
      const int d = mesh.coordinate("dp");
      const at::Tensor x = b.x.narrow(0, d * per_replica, per_replica);
      const at::Tensor y = b.y.narrow(0, d * per_replica, per_replica);
      std::vector<double> ms;
      double allreduce = 0, hidden = 0;
      for (int i = 0; i < c.warmup + c.steps; ++i) {
        const auto t0 = Clock::now();
        {
          dist::Context ctx;
          pipe.step(ctx.id(), x, y);
          opt.step(ctx.id());
        }
        if (i < c.warmup) continue;
        ms.push_back(ms_since(t0));
        const auto& last = pipe.last_step();
        hidden += last.allreduce_hidden;
        for (const auto& a : last.allreduces) {
          allreduce +=
              (a.done_us - a.launch_us) / 1e3 / static_cast<double>(last.allreduces.size());
        }
      }
      if (mesh.rank() == 0) {
        std::ofstream f(out);
        f << c.batch / (tandem::bench::median(ms) / 1e3) << " " << allreduce / c.steps << " "
          << hidden / c.steps << "\n";
      }
    }
    rpc::shutdown();
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config c;
    tandem::bench::Flags flags("pp_dp_bench");
    flags.add("--steps", &c.steps, 1).add("--warmup", &c.warmup, 0);
    flags.add("--batch", &c.batch, 1).add("--chunks", &c.chunks, 1).add("--width", &c.width, 1);
    flags.add("--blocks", &c.blocks, 1).add("--input", &c.input, 1);
    flags.add("--layouts", &c.layouts);
    if (!flags.parse(argc, argv)) return 2;

    // A worker of one layout's job (TANDEM_PP_DP=K,D,OUT set by the caller
    // below): spawn() runs its part and ends the process.
    if (const char* job = std::getenv("TANDEM_PP_DP")) {
      int pp = 0, dp = 0;
      char out[4096] = {};
      if (std::sscanf(job, "%d,%d,%4095s", &pp, &dp, out) != 3) return 2;
      tandem::spawn(pp * dp, [&](int, int) { worker(c, pp, dp, out); });
      return 0;
    }
    rpc::set_num_threads(1);
    const double local = tandem::bench::local_samples_per_s(c, c.warmup, c.steps);
    std::stringstream list(c.layouts);
    std::string item;
    double base = 0;
    while (std::getline(list, item, ',')) {
      if (item.size() != 2) {
        std::fprintf(stderr, "pp_dp_bench: --layouts takes pairs of digits (11,12,21,22)\n");
        return 2;
      }
      const int pp = item[0] - '0', dp = item[1] - '0';
      if (pp < 1 || dp < 1 || c.batch % dp != 0) {
        std::fprintf(stderr, "pp_dp_bench: bad layout %s for a batch of %d\n", item.c_str(),
                     c.batch);
        return 2;
      }
      char path[] = "/tmp/pp_dp_bench.XXXXXX";
      const int fd = ::mkstemp(path);
      if (fd < 0) throw std::runtime_error("cannot make a temporary file");
      ::close(fd);
      const std::string job = std::to_string(pp) + "," + std::to_string(dp) + "," + path;
      ::setenv("TANDEM_PP_DP", job.c_str(), 1);
      tandem::spawn(pp * dp, [](int, int) {});  // (this process is the caller: fn never runs here)
      ::unsetenv("TANDEM_PP_DP");
      Result r;
      std::ifstream(path) >> r.samples_per_s >> r.allreduce_ms >> r.hidden;
      std::remove(path);
      if (pp == 1 && dp == 1) base = r.samples_per_s;
      const double ideal =
          dp * (pp == 1 ? 1.0 : static_cast<double>(pp * c.chunks) / (c.chunks + pp - 1));
      const double speedup = base > 0 ? r.samples_per_s / base : 0;
      std::printf(
          "{\"bench\":\"pp_dp\",\"impl\":\"tandem\",\"pp\":%d,\"dp\":%d,\"schedule\":\"1f1b\","
          "\"chunks\":%d,\"batch\":%d,\"samples_per_s\":%.1f,\"speedup\":%.3f,\"ideal\":%.3f,"
          "\"efficiency\":%.3f,\"allreduce_ms\":%.2f,\"allreduce_hidden\":%.3f,"
          "\"local_samples_per_s\":%.1f}\n",
          pp, dp, c.chunks, c.batch, r.samples_per_s, speedup, ideal, speedup / ideal,
          r.allreduce_ms, r.hidden, local);
      std::fflush(stdout);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pp_dp_bench: %s\n", e.what());
    return 1;
  }
}
