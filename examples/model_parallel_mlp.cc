// model_parallel_mlp: the model of bench/anchors/model_parallel.py
// trained across two workers, then checked against the same training in
// one process.
//
//   build/bin/tandem-run --nproc-per-node 2 build/bin/model_parallel_mlp [--steps 200] [--seed 0]
//   build/bin/model_parallel_mlp [--steps 200] [--seed 0]   (starts its two workers itself)
//
// worker0 (the trainer) holds Linear(256, 1024) and the ReLUs; worker1 holds
// Linear(1024, 1024) and Linear(1024, 10) as RemoteModules and only serves:
//
//   x -> Linear(256,1024) -> ReLU -> [worker1] Linear(1024,1024) -> ReLU
//     -> [worker1] Linear(1024,10) -> cross-entropy
//
// Each step is a distributed autograd context: forward, backward() through
// both workers, DistributedOptimizer (SGD, lr 0.01) steps the parameters
// where they live. The task is fixed and synthetic: 1024 random inputs
// labelled by a random linear "teacher", taken 64 at a time in order.
//
// Afterwards the same three layers, initialised from the same seed, train in
// this process with torch::optim::SGD on the same batches; the program says
// whether every final parameter agrees with the distributed run's (to 1e-4
// relative to the parameter's largest entry) and exits 1 if one does not.
#include <ATen/ops/argmax.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdio>

#include "examples/flags.h"
#include "examples/launch.h"
#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/remote_module/remote_module.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rref.h"

namespace {

namespace rpc = tandem::rpc;
namespace dist = tandem::autograd;
namespace optim = tandem::optim;

constexpr int64_t kBatch = 64;
constexpr int64_t kSamples = 1024;
constexpr double kLr = 0.01;

struct Data {
  at::Tensor x, y;
};

// The inputs and the teacher's labels, from the seed alone.
Data make_data(int64_t seed) {
  at::manual_seed(static_cast<uint64_t>(seed) + 1);
  at::Tensor x = at::randn({kSamples, 256});
  at::Tensor teacher = at::randn({256, 10});
  return {x, at::argmax(at::mm(x, teacher), 1)};
}

Data batch(const Data& d, int64_t step) {
  const int64_t from = (step * kBatch) % kSamples;
  return {d.x.narrow(0, from, kBatch), d.y.narrow(0, from, kBatch)};
}

// The three layers with their initial parameters, from the seed alone: the
// distributed run and the local one start from the same numbers.
struct Layers {
  torch::nn::Linear first{nullptr}, mid{nullptr}, last{nullptr};
};
Layers make_layers(int64_t seed) {
  at::manual_seed(static_cast<uint64_t>(seed));
  return {torch::nn::Linear(256, 1024), torch::nn::Linear(1024, 1024), torch::nn::Linear(1024, 10)};
}

std::map<std::string, at::Tensor> state_of(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach();
  return out;
}

// max |a - b| / max |b| over one module's parameters (worst of them).
double rel_diff(const std::map<std::string, at::Tensor>& a,
                const std::map<std::string, at::Tensor>& b) {
  double worst = 0;
  for (const auto& [name, t] : b) {
    const double scale = std::max(t.abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (a.at(name) - t).abs().max().item<double>() / scale);
  }
  return worst;
}

int train(int64_t steps, int64_t seed) {
  const Data data = make_data(seed);
  Layers init = make_layers(seed);
  torch::nn::Linear first = init.first;
  tandem::nn::RemoteModule mid("worker1/cpu", "Linear", {1024, 1024});
  tandem::nn::RemoteModule last("worker1/cpu", "Linear", {1024, 10});
  mid.load_state_dict(state_of(*init.mid));
  last.load_state_dict(state_of(*init.last));

  std::vector<rpc::RRef<at::Tensor>> params;
  for (auto& p : first->parameters()) params.emplace_back(p);
  for (auto* m : {&mid, &last}) {
    for (auto& p : m->remote_parameters()) params.push_back(p);
  }
  optim::Options o;
  o.lr = kLr;
  optim::DistributedOptimizer opt(optim::Kind::kSGD, params, o);

  std::printf(
      "model_parallel_mlp: Linear(256,1024)-ReLU here, Linear(1024,1024)-ReLU-"
      "Linear(1024,10) on worker1; SGD lr %.2f, batch %lld, %lld steps\n",
      kLr, static_cast<long long>(kBatch), static_cast<long long>(steps));
  double sum = 0;
  int64_t since = 0;
  for (int64_t step = 0; step < steps; ++step) {
    Data b = batch(data, step);
    dist::Context ctx;
    at::Tensor out = last.forward(at::relu(mid.forward(at::relu(first(b.x)))));
    at::Tensor loss = at::cross_entropy_loss(out, b.y);
    dist::backward(ctx.id(), {loss});
    opt.step(ctx.id());
    sum += loss.item<double>();
    ++since;
    if ((step + 1) % 50 == 0 || step + 1 == steps) {
      std::printf("step %lld/%lld  loss %.4f\n", static_cast<long long>(step + 1),
                  static_cast<long long>(steps), sum / since);
      std::fflush(stdout);
      sum = 0;
      since = 0;
    }
  }

  // The twin: the same layers, batches and SGD, all in this process.
  Layers local = make_layers(seed);
  std::vector<at::Tensor> local_params;
  for (auto* m : {local.first.get(), local.mid.get(), local.last.get()}) {
    for (auto& p : m->parameters()) local_params.push_back(p);
  }
  torch::optim::SGD sgd(local_params, torch::optim::SGDOptions(kLr));
  for (int64_t step = 0; step < steps; ++step) {
    Data b = batch(data, step);
    sgd.zero_grad();
    at::Tensor out = local.last(at::relu(local.mid(at::relu(local.first(b.x)))));
    at::cross_entropy_loss(out, b.y).backward();
    sgd.step();
  }
  const double diff = std::max({rel_diff(state_of(*first), state_of(*local.first)),
                                rel_diff(mid.state_dict(), state_of(*local.mid)),
                                rel_diff(last.state_dict(), state_of(*local.last))});
  const bool ok = diff <= 1e-4;
  std::printf(
      "final parameters %s the same model trained locally with torch::optim::SGD "
      "(max relative difference %.2e, tolerance 1e-4)\n",
      ok ? "agree with" : "DIFFER FROM", diff);
  return ok ? 0 : 1;
}

}  // namespace

// One worker's part, under tandem-run (or torchrun) or started by spawn().
int worker(int argc, char** argv) {
  try {
    const rpc::WorldEnv env = rpc::world_from_env();
    if (env.rank > 0) {  // worker1 only serves the remote layers
      rpc::init(std::make_shared<rpc::Registry>());
      rpc::shutdown();
      return 0;
    }
    int64_t steps = 200, seed = 0;
    examples::Flags flags("model_parallel_mlp");
    flags.add("--steps", &steps, 1, "training steps").add("--seed", &seed, 0, "seed");
    const std::string error = flags.parse(argc, argv);
    if (env.world_size != 2) {
      return examples::outside_world(
          flags, error,
          "start me with 2 workers (build/bin/tandem-run --nproc-per-node 2 "
          "build/bin/model_parallel_mlp), or alone: I start them myself");
    }
    // Joined even on a bad flag, so that worker1's shutdown() returns.
    rpc::init(std::make_shared<rpc::Registry>());
    const int rc =
        examples::run_worker(flags, error, /*speak=*/true, [&] { return train(steps, seed); });
    rpc::shutdown();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_parallel_mlp: %s\n", e.what());
    return 1;
  }
}

// examples/launch.h: under tandem-run, or started alone (2 workers).
int main(int argc, char** argv) {
  return examples::launch("model_parallel_mlp", 2, argc, argv, worker);
}
