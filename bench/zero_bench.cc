// zero_bench: what sharded data parallelism saves in bytes and costs in time.
// An MLP of about 50 M parameters (--width 2048, --layers 12: twelve
// 2048 x 2048 layers and their biases, so that whole parameters share out
// evenly over 2 and 4 ranks, as ZeRO's partition shares them), Adam, fp32, trained by N processes
// on this host (each a job of its own started by tandem::spawn, one intra-op thread a process),
// each rank its own batch of --batch rows:
//   ddp    DDP and LibTorch's Adam on every rank (the state whole everywhere);
//   zero1  DDP and ZeroRedundancyOptimizer (the state sharded);
//   zero2  that, DDP's gradients sharded too (DDPOptions::gradient_owner);
//   zero3  FullyShardedDataParallel, each Linear a unit, LibTorch's Adam
//          over the shards.
//
// Prints per mode and world size:
//   {"bench":"zero","mode":"ddp|zero1|zero2","world":N,"params":P,
//    "bytes_per_rank":..,"largest_unit_bytes":..,"rss_mb":..,"ms":..,"ms_per_ddp":..}
// params: the model's parameter count; bytes_per_rank: rank 0's parameters,
// gradients and optimizer state after a step, counted from the tensors it
// holds (a gradient view counts its own elements; for zero3 the shards,
// their gradients and Adam's state over them, and no whole parameter, all
// freed after backward); largest_unit_bytes: zero3's largest unit gathered
// whole (a rank holds at most two at once during a step), 0 for the
// others; rss_mb: rank
// 0's peak resident memory (getrusage), which also holds LibTorch, the
// buckets and what the collectives allocate; ms: the median step (forward,
// backward, optimizer step) over --steps after --warmup; ms_per_ddp: ms
// over the ddp line's of the same world size in this run (when measured).
//
// Usage: zero_bench [--steps 3] [--warmup 1] [--batch 16] [--width 2048] [--layers 12]
//        [--worlds 2,4] [--modes ddp,zero1,zero2,zero3]
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randn.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "bench/bench_util.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/ddp/fully_sharded.h"
#include "tandem/optim/zero_redundancy_optimizer.h"
#include "tandem/rpc/common/host.h"
#include "tandem/rpc/spawn.h"

namespace {

namespace ddp = tandem::ddp;
namespace optim = tandem::optim;
using Clock = std::chrono::steady_clock;
using tandem::bench::ms_since;

struct Config {
  int steps = 3, warmup = 1, batch = 16, width = 2048, layers = 12;
  std::string worlds = "2,4", modes = "ddp,zero1,zero2,zero3";
};

struct Result {
  int64_t params = 0, bytes = 0, largest_unit = 0;
  double rss_mb = 0, ms = 0;
};

torch::nn::Sequential make_model(const Config& c) {
  at::manual_seed(0);
  torch::nn::Sequential m;
  for (int i = 0; i < c.layers; ++i) {
    m->push_back(torch::nn::Linear(c.width, c.width));
    if (i + 1 < c.layers) m->push_back(torch::nn::ReLU());
  }
  return m;
}

int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

int64_t adam_state_bytes(const torch::optim::Adam& adam) {
  int64_t bytes = 0;
  for (const auto& entry : adam.state()) {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*entry.second);
    bytes += bytes_of(s.exp_avg()) + bytes_of(s.exp_avg_sq());
  }
  return bytes;
}

// zero3: the model sharded unit by unit.
Result train_sharded(const Config& c, const at::Tensor& x, const at::Tensor& y,
                     std::vector<double>& ms) {
  auto model = make_model(c);
  Result r;
  for (const auto& p : model->parameters()) r.params += p.numel();
  ddp::FullyShardedDataParallel fsdp(model);
  torch::optim::Adam adam(fsdp.parameters(), torch::optim::AdamOptions(1e-4));
  for (int i = 0; i < c.warmup + c.steps; ++i) {
    const auto t0 = Clock::now();
    torch::nn::functional::mse_loss(fsdp(x), y).backward();
    adam.step();
    if (i >= c.warmup) ms.push_back(ms_since(t0));
    if (i + 1 == c.warmup + c.steps) {
      for (const auto& p : model->parameters()) r.bytes += bytes_of(p) + bytes_of(p.grad());
      r.bytes += fsdp.stats().shard_bytes + adam_state_bytes(adam);
      r.largest_unit = fsdp.stats().largest_unit_bytes;
    }
    adam.zero_grad();
  }
  return r;
}

// ddp, zero1, zero2: the model whole on every rank under DDP.
Result train_replicated(const Config& c, const std::string& mode, const at::Tensor& x,
                        const at::Tensor& y, std::vector<double>& ms) {
  auto model = make_model(c);
  std::unique_ptr<optim::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<torch::optim::Adam> adam;
  ddp::DDPOptions d;
  if (mode == "ddp") {
    adam =
        std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-4));
  } else {
    optim::Options o;
    o.lr = 1e-4;
    zero = std::make_unique<optim::ZeroRedundancyOptimizer>(model->parameters(), optim::Kind::kAdam,
                                                            o);
    if (mode == "zero2") d.gradient_owner = zero->gradient_owner();
  }
  ddp::DistributedDataParallel net(model, d);
  Result r;
  for (int i = 0; i < c.warmup + c.steps; ++i) {
    const auto t0 = Clock::now();
    torch::nn::functional::mse_loss(net(x), y).backward();
    if (zero) {
      zero->step();
    } else {
      adam->step();
    }
    if (i >= c.warmup) ms.push_back(ms_since(t0));
    if (i + 1 == c.warmup + c.steps) {
      // What this rank holds after a step, before the gradients are dropped.
      for (const auto& p : model->parameters()) {
        r.params += p.numel();
        r.bytes += bytes_of(p) + bytes_of(p.grad());
      }
      r.bytes += zero ? zero->state_bytes() : adam_state_bytes(*adam);
    }
    if (zero) {
      zero->zero_grad();
    } else {
      adam->zero_grad();
    }
  }
  return r;
}

// One rank of a job: trains, and rank 0 writes what it measured to `out`.
void worker(const Config& c, const std::string& mode, const std::string& out) {
  tandem::rpc::set_num_threads(1);
  ddp::init_process_group("gloo");
  const int rank = ddp::get_rank();
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100 + rank));
  const at::Tensor x = at::randn({c.batch, c.width}, gen);
  const at::Tensor y = at::randn({c.batch, c.width}, gen);
  std::vector<double> ms;
  const Result r =
      mode == "zero3" ? train_sharded(c, x, y, ms) : train_replicated(c, mode, x, y, ms);
  if (rank == 0) {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    std::ofstream f(out);
    f << r.params << " " << r.bytes << " " << static_cast<double>(u.ru_maxrss) / 1024.0 << " "
      << tandem::bench::median(ms) << " " << r.largest_unit << "\n";
  }
  ddp::destroy_process_group();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config c;
    tandem::bench::Flags flags("zero_bench");
    flags.add("--steps", &c.steps, 1).add("--warmup", &c.warmup, 0);
    flags.add("--batch", &c.batch, 1).add("--width", &c.width, 1).add("--layers", &c.layers, 1);
    flags.add("--worlds", &c.worlds).add("--modes", &c.modes);
    if (!flags.parse(argc, argv)) return 2;

    // A worker of one job (TANDEM_ZERO=MODE,WORLD,OUT set by the caller
    // below): spawn() runs its part and ends the process.
    if (const char* job = std::getenv("TANDEM_ZERO")) {
      const std::string s = job;
      const auto a = s.find(','), b = s.find(',', a + 1);
      if (a == std::string::npos || b == std::string::npos) return 2;
      const int world = std::atoi(s.substr(a + 1, b - a - 1).c_str());
      tandem::spawn(world, [&](int, int) { worker(c, s.substr(0, a), s.substr(b + 1)); });
      return 0;
    }
    for (const auto& world_text : tandem::bench::split_commas(c.worlds)) {
      const int world = std::atoi(world_text.c_str());
      if (world < 1) {
        std::fprintf(stderr, "zero_bench: --worlds takes counts of ranks, not '%s'\n",
                     world_text.c_str());
        return 2;
      }
      double ddp_ms = 0;
      for (const auto& mode : tandem::bench::split_commas(c.modes)) {
        if (mode != "ddp" && mode != "zero1" && mode != "zero2" && mode != "zero3") {
          std::fprintf(stderr, "zero_bench: --modes takes ddp, zero1, zero2 and zero3, not '%s'\n",
                       mode.c_str());
          return 2;
        }
        char path[] = "/tmp/zero_bench.XXXXXX";
        const int fd = ::mkstemp(path);
        if (fd < 0) throw std::runtime_error("cannot make a temporary file");
        ::close(fd);
        const std::string job = mode + "," + std::to_string(world) + "," + path;
        ::setenv("TANDEM_ZERO", job.c_str(), 1);
        tandem::spawn(world, [](int, int) {});  // (the caller: fn never runs here)
        ::unsetenv("TANDEM_ZERO");
        Result r;
        std::ifstream(path) >> r.params >> r.bytes >> r.rss_mb >> r.ms >> r.largest_unit;
        std::remove(path);
        if (mode == "ddp") ddp_ms = r.ms;
        std::printf(
            "{\"bench\":\"zero\",\"impl\":\"tandem\",\"mode\":\"%s\",\"world\":%d,"
            "\"params\":%lld,\"bytes_per_rank\":%lld,\"largest_unit_bytes\":%lld,"
            "\"rss_mb\":%.1f,\"ms\":%.1f%s}\n",
            mode.c_str(), world, static_cast<long long>(r.params), static_cast<long long>(r.bytes),
            static_cast<long long>(r.largest_unit), r.rss_mb, r.ms,
            ddp_ms > 0 ? (",\"ms_per_ddp\":" + std::to_string(r.ms / ddp_ms)).c_str() : "");
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_bench: %s\n", e.what());
    return 1;
  }
}
