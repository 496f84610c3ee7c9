// ddp_bench: one DistributedDataParallel training step over Gloo, two
// processes on this host, like bench/anchors/ddp.py (PyTorch's side).
//
// Model: MLP 512-2048-2048-512-10 (ReLU), batch 64 per process, SGD lr=0.01,
// seed 0, rank r's data from a generator seeded 100 + r; one intra-op thread
// per process. The same step in one process without DDP is timed too
// (local_ms), after the peer has gone. `overlap` is the share of the
// all-reduce time hidden behind backward: 1 - (time backward still waited
// for buckets after its own work) / (the same buckets all-reduced alone).
//
// Prints:
// {"bench":"ddp_step","impl":"tandem","world":2,"ms":..,"local_ms":..,"overlap":..,"loss":..}
//
// Usage: ddp_bench [--steps 30] [--warmup 5] [--rounds 3]
// Env: TANDEM_BENCH_BUCKET_MB=N sets bucket_cap_mb (default 25);
//      TANDEM_BENCH_HOOK=fp16 averages in float16 (fp16_compress_hook);
//      TANDEM_BENCH_VERBOSE=1 prints each rank's phases and buckets on stderr, and how
//      many cores the buckets kept busy when all-reduced alone.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstring>

#include "bench/bench_util.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/rpc/common/host.h"

namespace {

namespace ddp = tandem::ddp;
using Clock = std::chrono::steady_clock;
using tandem::bench::median;
using tandem::bench::ms_since;

torch::nn::Sequential make_model() {
  at::manual_seed(0);
  // One statement per layer: the weights come from the generator in
  // PyTorch's order (a function's arguments are made in no fixed order).
  torch::nn::Linear fc1(512, 2048);
  torch::nn::Linear fc2(2048, 2048);
  torch::nn::Linear fc3(2048, 512);
  torch::nn::Linear fc4(512, 10);
  return torch::nn::Sequential(fc1, torch::nn::ReLU(), fc2, torch::nn::ReLU(), fc3,
                               torch::nn::ReLU(), fc4);
}

struct Batch {
  at::Tensor x, y;
};
Batch batch(int rank) {
  auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(100 + rank));
  at::Tensor x = at::randn({64, 512}, g);
  return {x, at::randint(0, 10, {64}, g, at::kLong)};
}

// This process's CPU time so far (user + system), in ms.
double cpu_ms() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto ms = [](const timeval& t) { return t.tv_sec * 1e3 + t.tv_usec / 1e3; };
  return ms(u.ru_utime) + ms(u.ru_stime);
}

// Mean step time of `step` over `steps` after `warmup`; the last loss.
template <class Step>
double timed(int steps, int warmup, Step step) {
  Clock::time_point start;
  for (int it = 0; it < warmup + steps; ++it) {
    if (it == warmup) start = Clock::now();
    step(it >= warmup);
  }
  return ms_since(start) / steps;
}

struct Figures {
  double ms = 0, local_ms = 0, overlap = 0, loss = 0;
};

// One rank's part; rank 0 returns the figures.
Figures run_rank(int steps, int warmup) {
  tandem::rpc::set_num_threads(1);
  ddp::init_process_group("gloo");
  Figures f;
  {
    auto model = make_model();
    ddp::DDPOptions o;
    if (const char* mb = std::getenv("TANDEM_BENCH_BUCKET_MB")) o.bucket_cap_mb = std::atof(mb);
    if (const char* hook = std::getenv("TANDEM_BENCH_HOOK");
        hook && std::strcmp(hook, "fp16") == 0) {
      o.comm_hook = ddp::fp16_compress_hook();
    }
    ddp::DistributedDataParallel net(model, o);
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01));
    Batch b = batch(ddp::get_rank());
    at::Tensor loss;
    double tail = 0, phase[3] = {0, 0, 0};
    f.ms = timed(steps, warmup, [&](bool measured) {
      auto t0 = Clock::now();
      opt.zero_grad();
      loss = torch::nn::functional::cross_entropy(net(b.x), b.y);
      auto t1 = Clock::now();
      loss.backward();
      auto t2 = Clock::now();
      opt.step();
      if (measured) {
        tail += net.reducer().stats().tail_wait_ms;
        phase[0] += std::chrono::duration<double, std::milli>(t1 - t0).count();
        phase[1] += std::chrono::duration<double, std::milli>(t2 - t1).count();
        phase[2] += ms_since(t2);
      }
    });
    f.loss = loss.item<double>();
    // The same buckets all-reduced with nothing else running.
    auto stats = net.reducer().stats();
    std::vector<at::Tensor> buckets;
    for (size_t bytes : stats.bucket_bytes)
      buckets.push_back(at::zeros({static_cast<int64_t>(bytes / 4)}));
    const double cpu_before = cpu_ms();
    const auto wall_before = Clock::now();
    double alone = timed(steps / 2 + 1, 2, [&](bool) {
      std::vector<ddp::ProcessGroup::Pending> works;
      for (auto& t : buckets) works.push_back(ddp::default_group().all_reduce_async(t));
      for (auto& w : works) w.wait();
    });
    // Cores this process kept busy while the buckets were all-reduced alone.
    const double busy = (cpu_ms() - cpu_before) / ms_since(wall_before);
    f.overlap = std::max(0.0, std::min(1.0, 1.0 - (tail / steps) / alone));
    if (std::getenv("TANDEM_BENCH_VERBOSE")) {
      std::fprintf(stderr,
                   "ddp_bench rank %d: step %.2f ms (forward %.2f, backward %.2f, step %.2f), tail "
                   "wait %.2f ms, buckets alone %.2f ms (%.2f cores busy), %zu buckets:",
                   ddp::get_rank(), f.ms, phase[0] / steps, phase[1] / steps, phase[2] / steps,
                   tail / steps, alone, busy, stats.buckets);
      for (size_t b : stats.bucket_bytes) std::fprintf(stderr, " %zu", b);
      std::fprintf(stderr, "\n");
    }
    ddp::barrier();
  }
  ddp::destroy_process_group();
  return f;
}

double local_step_ms(int steps, int warmup) {
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  Batch b = batch(0);
  return timed(steps, warmup, [&](bool) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
    opt.step();
  });
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int steps = 30, warmup = 5, rounds = 3;
    if (const char* role = std::getenv("TANDEM_BENCH_ROLE")) {
      unsetenv("TANDEM_BENCH_ROLE");
      if (std::strcmp(role, "rank1") != 0) return 2;
      int s = std::atoi(std::getenv("TANDEM_BENCH_STEPS"));
      int w = std::atoi(std::getenv("TANDEM_BENCH_WARMUP"));
      run_rank(s, w);
      return 0;
    }
    tandem::bench::Flags flags("ddp_bench");
    flags.add("--steps", &steps, 1).add("--warmup", &warmup, 0).add("--rounds", &rounds, 1);
    if (!flags.parse(argc, argv)) return 2;
    setenv("TANDEM_BENCH_STEPS", std::to_string(steps).c_str(), 1);
    setenv("TANDEM_BENCH_WARMUP", std::to_string(warmup).c_str(), 1);
    std::vector<double> ms, local_ms, overlap;
    double loss = 0;
    for (int r = 0; r < rounds; ++r) {
      pid_t child = tandem::bench::spawn_peer("rank1");
      setenv("RANK", "0", 1);
      setenv("WORLD_SIZE", "2", 1);
      Figures f = run_rank(steps, warmup);
      tandem::support::wait_exit(child);
      ms.push_back(f.ms);
      overlap.push_back(f.overlap);
      local_ms.push_back(local_step_ms(steps, warmup));
      loss = f.loss;
    }
    std::printf(
        "{\"bench\":\"ddp_step\",\"impl\":\"tandem\",\"world\":2,\"ms\":%.3f,\"local_ms\":%.3f,"
        "\"overlap\":%.2f,\"loss\":%.4f,\"rounds\":%d}\n",
        median(ms), median(local_ms), median(overlap), loss, rounds);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench: %s\n", e.what());
    return 1;
  }
}
