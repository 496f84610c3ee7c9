// ddp_mlp: data-parallel training of the model of bench/anchors/ddp.py
// (MLP 512-2048-2048-512-10) with DistributedDataParallel over Gloo and a
// DistributedSampler, one process per rank:
//
//   build/bin/tandem-run --nproc-per-node 2 build/bin/ddp_mlp [--epochs 2]
//
// or as two "nodes" on one machine (the same command on each node of a real
// cluster, with its master address):
//
//   build/bin/tandem-run --nnodes 2 --node-rank 0 --master-addr 127.0.0.1
//       --master-port 29500 --nproc-per-node 1 build/bin/ddp_mlp &
//   build/bin/tandem-run --nnodes 2 --node-rank 1 --master-addr 127.0.0.1
//       --master-port 29500 --nproc-per-node 1 build/bin/ddp_mlp
// (each command on one line)
//
// On GPUs (one per process): --backend nccl puts rank r's replica on
// cuda:LOCAL_RANK, as PyTorch's DDP(model, device_ids=[local_rank]).
//
// The task is synthetic but learnable: --samples random inputs labelled by
// a random linear "teacher", the same on every rank (made from --seed).
// Each epoch the sampler hands every rank its own share of the samples in
// a fresh order; rank 0 prints progress (mean loss of the last steps, the
// job's samples per second), and at the end every rank checks that its
// parameters equal rank 0's (exit 1 if not).
#include <ATen/ops/argmax.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "examples/flags.h"
#include "examples/launch.h"
#include "examples/replicas.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/ddp/sampler.h"
#include "tandem/rpc/rendezvous.h"

namespace {

namespace ddp = tandem::ddp;
using Clock = std::chrono::steady_clock;

struct Data {
  at::Tensor x, y;
};

Data make_data(int64_t samples, int64_t seed) {
  at::manual_seed(static_cast<uint64_t>(seed) + 1);
  at::Tensor x = at::randn({samples, 512});
  at::Tensor teacher = at::randn({512, 10});
  return {x, at::argmax(at::mm(x, teacher), 1)};
}

torch::nn::Sequential make_model(int64_t seed) {
  at::manual_seed(static_cast<uint64_t>(seed));
  torch::nn::Linear fc1(512, 2048);  // one statement each: a fixed order of weights
  torch::nn::Linear fc2(2048, 2048);
  torch::nn::Linear fc3(2048, 512);
  torch::nn::Linear fc4(512, 10);
  return torch::nn::Sequential(fc1, torch::nn::ReLU(), fc2, torch::nn::ReLU(), fc3,
                               torch::nn::ReLU(), fc4);
}

int train(int64_t epochs, int64_t samples, int64_t batch, double lr, int64_t log_every,
          int64_t seed, bool gpu) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  Data data = make_data(samples, seed);
  auto model = make_model(seed);
  ddp::DDPOptions options;
  c10::Device device(c10::kCPU);
  if (gpu) {  // one GPU per process: this node's rank picks it
    const int local_rank = std::max(tandem::rpc::world_from_env().local_rank, 0);
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
    model->to(device);
    options.device_ids = {local_rank};
  }
  ddp::DistributedDataParallel net(model, options);
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
  ddp::DistributedSampler sampler(static_cast<size_t>(samples));
  const int64_t steps_per_epoch = static_cast<int64_t>(sampler.num_samples()) / batch;
  if (steps_per_epoch == 0) {
    throw examples::UsageError("--samples " + std::to_string(samples) + " gives each of " +
                               std::to_string(world) + " ranks fewer than one --batch");
  }
  if (rank == 0) {
    std::printf(
        "ddp_mlp: %d ranks, %lld samples (%zu per rank), batch %lld per rank, %lld steps "
        "per epoch\n",
        world, static_cast<long long>(samples), sampler.num_samples(),
        static_cast<long long>(batch), static_cast<long long>(steps_per_epoch));
  }
  double first_loss = -1, last_loss = 0, window = 0;
  int64_t in_window = 0;
  auto t0 = Clock::now();
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    sampler.set_epoch(epoch);
    auto order = sampler.indices();
    std::vector<int64_t> idx(order.begin(), order.end());
    at::Tensor all = at::tensor(idx, at::kLong);
    for (int64_t s = 0; s < steps_per_epoch; ++s) {
      at::Tensor pick = all.narrow(0, s * batch, batch);
      at::Tensor x = at::index_select(data.x, 0, pick), y = at::index_select(data.y, 0, pick);
      opt.zero_grad();
      at::Tensor loss = torch::nn::functional::cross_entropy(net(x), y.to(device));
      loss.backward();
      opt.step();
      double l = loss.item<double>();
      if (first_loss < 0) first_loss = l;
      window += l;
      ++in_window;
      const int64_t step = epoch * steps_per_epoch + s + 1;
      if (rank == 0 && (step % log_every == 0 || s + 1 == steps_per_epoch)) {
        double secs = std::chrono::duration<double>(Clock::now() - t0).count();
        std::printf("epoch %lld step %lld/%lld  loss %.4f  %.0f samples/s\n",
                    static_cast<long long>(epoch), static_cast<long long>(step),
                    static_cast<long long>(epochs * steps_per_epoch), window / in_window,
                    static_cast<double>(step * batch * world) / secs);
        std::fflush(stdout);
        last_loss = window / in_window;
        window = 0;
        in_window = 0;
      }
    }
  }
  // Every replica must hold rank 0's parameters.
  const bool same = examples::same_on_every_rank(model->parameters(), ddp::default_group());
  if (rank == 0) {
    std::printf("final loss %.4f (first step %.4f); replicas %s\n", last_loss, first_loss,
                same ? "identical" : "DIFFER");
  }
  return same ? 0 : 1;
}

}  // namespace

static int job_main(int argc, char** argv) {
  int64_t epochs = 2, samples = 4096, batch = 64, log_every = 10, seed = 0;
  double lr = 0.05;
  std::string backend = "gloo";
  examples::Flags flags("ddp_mlp");
  flags.add("--epochs", &epochs, 1, "passes over the data")
      .add("--samples", &samples, 1, "size of the synthetic dataset")
      .add("--batch", &batch, 1, "samples per step on each rank")
      .add("--lr", &lr, "SGD learning rate (momentum 0.9)")
      .add("--log-every", &log_every, 1, "steps between progress lines")
      .add("--seed", &seed, 0, "seed of the data and the initial weights")
      .add("--backend", &backend, "gloo (CPU) or nccl (one GPU per process)");
  std::string error = flags.parse(argc, argv);
  if (tandem::rpc::world_from_env().world_size < 1) {
    return examples::outside_world(
        flags, error, "start me with tandem-run, e.g. tandem-run --nproc-per-node 2 ddp_mlp");
  }
  // Every rank joins the group first, so that a flag error ends all of them alike.
  if (error.empty() && backend != "gloo" && backend != "nccl") {
    error = "--backend takes gloo or nccl, not '" + backend + "'";
  }
  if (!error.empty()) backend = "gloo";  // to meet the others and end alike
  try {
    ddp::init_process_group(backend);
  } catch (const std::invalid_argument& e) {  // nccl without CUDA: every rank alike
    std::fprintf(stderr, "ddp_mlp: %s\n", e.what());
    return 2;
  }
  int rc = examples::run_worker(flags, error, ddp::get_rank() == 0, [&] {
    return train(epochs, samples, batch, lr, log_every, seed, backend == "nccl");
  });
  ddp::destroy_process_group();
  return rc;
}

// examples/launch.h: under tandem-run, or started alone (2 workers).
int main(int argc, char** argv) { return examples::launch("ddp_mlp", 2, argc, argv, job_main); }
