// mp_bench: one model-parallel training step, like
// bench/anchors/model_parallel.py (PyTorch's side).
//
// The model is Linear(256,1024)-ReLU on the trainer (worker0) and two
// RemoteModules on worker1: Linear(1024,1024), then ReLU on the trainer, then
// Linear(1024,10); cross-entropy loss, SGD lr=0.01, batch 64, seed 0. A step
// is the forward in a distributed autograd context, backward and
// DistributedOptimizer::step. The same step on one process, with the same
// LibTorch layers and optimizer, is timed too (local_ms), so the distributed
// overhead reads as a ratio. Two processes on loopback: this one is worker0
// and starts itself again as worker1. Each figure is the median over
// --rounds fresh process pairs of the mean step time of --steps steps
// (after --warmup).
//
// Prints: {"bench":"mp_mlp_step","impl":"tandem","transport":..,"ms":..,"local_ms":..,"loss":..}
// ($TANDEM_TRANSPORT picks the transport; "transport" says which carried the calls)
//
// Usage: mp_bench [--steps 50] [--warmup 10] [--rounds 3] [--phases 1] [--local 0]
#include <ATen/Parallel.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdio>
#include <cstring>

#include "bench/bench_util.h"
#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/remote_module/remote_module.h"
#include "tandem/rpc/api.h"
#include "tests/support/local_job.h"

namespace {

namespace rpc = tandem::rpc;
namespace dist = tandem::autograd;
namespace support = tandem::support;
using Clock = std::chrono::steady_clock;
using tandem::bench::median;
using tandem::bench::ms_since;

rpc::AgentOptions options(int rank) {
  rpc::AgentOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.num_worker_threads = 4;
  return o;
}

struct Batch {
  at::Tensor x, y;
};
Batch batch() { return {at::randn({64, 256}), at::randint(0, 10, {64}, at::kLong)}; }

bool phases = false;     // --phases 1: each phase's mean time on stderr
bool with_local = true;  // --local 0: the distributed step alone (for profiling)

double local_step_ms(int steps, int warmup) {
  at::manual_seed(0);
  torch::nn::Linear first(256, 1024), mid(1024, 1024), last(1024, 10);
  std::vector<at::Tensor> params;
  for (auto* m : {first.get(), mid.get(), last.get()}) {
    for (auto& p : m->parameters()) params.push_back(p);
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.01));
  Batch b = batch();
  Clock::time_point start;
  double phase[3] = {0, 0, 0};  // forward, backward, step (ms, summed)
  for (int it = 0; it < warmup + steps; ++it) {
    if (it == warmup) {
      start = Clock::now();
      phase[0] = phase[1] = phase[2] = 0;
    }
    auto t0 = Clock::now();
    opt.zero_grad();
    at::Tensor out = last(at::relu(mid(at::relu(first(b.x)))));
    at::Tensor loss = torch::nn::functional::cross_entropy(out, b.y);
    phase[0] += ms_since(t0);
    t0 = Clock::now();
    loss.backward();
    phase[1] += ms_since(t0);
    t0 = Clock::now();
    opt.step();
    phase[2] += ms_since(t0);
  }
  if (phases) {
    std::fprintf(stderr, "mp_bench: local forward %.3f ms, backward %.3f ms, step %.3f ms\n",
                 phase[0] / steps, phase[1] / steps, phase[2] / steps);
  }
  return ms_since(start) / steps;
}

struct Figures {
  double ms, local_ms, loss;
};
std::string g_transport;  // what carried the calls: "tcp" or "shm"

Figures round(int steps, int warmup) {
  pid_t child = tandem::bench::spawn_peer("worker1");
  auto agent = rpc::init(std::make_shared<rpc::Registry>(), options(0));
  g_transport = tandem::bench::transport_to(*agent, "worker1");
  Figures f{};
  {
    at::manual_seed(0);
    torch::nn::Linear first(256, 1024);
    tandem::nn::RemoteModule mid("worker1/cpu", "Linear", {1024, 1024});
    tandem::nn::RemoteModule last("worker1/cpu", "Linear", {1024, 10});
    std::vector<rpc::RRef<at::Tensor>> params;
    for (auto& p : first->parameters()) params.push_back(rpc::RRef<at::Tensor>(p));
    for (auto* m : {&mid, &last}) {
      for (auto& p : m->remote_parameters()) params.push_back(p);
    }
    tandem::optim::Options o;
    o.lr = 0.01;
    tandem::optim::DistributedOptimizer opt(tandem::optim::Kind::kSGD, params, o);
    Batch b = batch();
    at::Tensor loss;
    Clock::time_point start;
    double phase[3] = {0, 0, 0};  // forward, backward, step (ms, summed)
    double fwd[3] = {0, 0, 0};    // the forward's three layers
    for (int it = 0; it < warmup + steps; ++it) {
      if (it == warmup) {
        start = Clock::now();
        phase[0] = phase[1] = phase[2] = 0;
        fwd[0] = fwd[1] = fwd[2] = 0;
      }
      dist::Context ctx;
      auto t0 = Clock::now();
      at::Tensor h = at::relu(first(b.x));
      fwd[0] += ms_since(t0);
      auto t1 = Clock::now();
      at::Tensor m = mid.forward(h);
      fwd[1] += ms_since(t1);
      t1 = Clock::now();
      at::Tensor out = last.forward(at::relu(m));
      fwd[2] += ms_since(t1);
      loss = torch::nn::functional::cross_entropy(out, b.y);
      phase[0] += ms_since(t0);
      t0 = Clock::now();
      dist::backward(ctx.id(), {loss});
      phase[1] += ms_since(t0);
      t0 = Clock::now();
      opt.step(ctx.id());
      phase[2] += ms_since(t0);
    }
    f.ms = ms_since(start) / steps;
    if (phases) {
      std::fprintf(stderr,
                   "mp_bench: forward %.3f ms (first %.3f, mid %.3f, last %.3f), backward %.3f ms, "
                   "step %.3f ms\n",
                   phase[0] / steps, fwd[0] / steps, fwd[1] / steps, fwd[2] / steps,
                   phase[1] / steps, phase[2] / steps);
    }
    f.loss = loss.item<double>();
  }
  rpc::shutdown(true);
  support::wait_exit(child);
  // With worker1 gone, so that it takes no CPU from the local run.
  f.local_ms = with_local ? local_step_ms(steps, warmup) : 0;
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (int rc = tandem::bench::serve_as_peer("worker1", options(1)); rc >= 0) return rc;
    int steps = 50, warmup = 10, rounds = 3, show_phases = 0, local = 1;
    tandem::bench::Flags flags("mp_bench");
    flags.add("--steps", &steps, 1).add("--warmup", &warmup, 0).add("--rounds", &rounds, 1);
    flags.add("--phases", &show_phases, 0).add("--local", &local, 0);
    if (!flags.parse(argc, argv)) return 2;
    phases = show_phases != 0;
    with_local = local != 0;
    std::vector<double> ms, local_ms;
    double loss = 0;
    for (int r = 0; r < rounds; ++r) {
      Figures f = round(steps, warmup);
      ms.push_back(f.ms);
      local_ms.push_back(f.local_ms);
      loss = f.loss;
    }
    std::printf(
        "{\"bench\":\"mp_mlp_step\",\"impl\":\"tandem\",\"transport\":\"%s\",\"ms\":%.3f,"
        "\"local_ms\":%.3f,\"loss\":%.4f,\"rounds\":%d}\n",
        g_transport.c_str(), median(ms), median(local_ms), loss, rounds);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mp_bench: %s\n", e.what());
    return 1;
  }
}
