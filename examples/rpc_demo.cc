// rpc_demo: a parameter service and a distributed reduction over Tandem RPC.
//
// Run it with the launcher (any number of workers):
//   build/bin/tandem-run --nproc-per-node 2 build/bin/rpc_demo
//
// Every worker holds one shard of an embedding table (rows r with
// r % world == rank). Worker 0 then
//   1. looks rows up wherever they live ("lookup", asynchronous fan-out),
//   2. asks every worker for the column sums of its shard ("shard_sum") and
//      reduces them, and checks both against the table built locally,
//   3. keeps a result on the last worker behind a remote reference and asks
//      that worker about it (a method proxy),
//   4. shows a typed remote error,
//   5. trains a small model split over all workers (worker r owns layer r)
//      with distributed autograd: the forward pass hops from worker to
//      worker, backward() runs back through all of them, and each worker
//      steps its own layer with the gradients of the step's context. The
//      first step's gradients are checked against the same model run
//      locally.
#include <ATen/TensorOperators.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/max.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/tanh.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>

#include "examples/launch.h"
#include "tandem/autograd/autograd.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rref.h"

namespace rpc = tandem::rpc;
namespace dist = tandem::autograd;

namespace {

constexpr int64_t kRows = 1000;
constexpr int64_t kDim = 16;

// The whole table, as a formula: each worker materialises only its rows.
at::Tensor table_rows(const at::Tensor& ids) {
  auto f = ids.to(at::kFloat).unsqueeze(1);
  auto cols = at::arange(kDim, at::TensorOptions().dtype(at::kFloat)).unsqueeze(0);
  return f * 0.01 + cols;
}

// Layer r of the model lives on worker r.
at::Tensor layer(const at::Tensor& x, const at::Tensor& w) { return at::tanh(at::mm(x, w)); }

// Step 5, on worker 0: the model is x -> layer 0 -> layer 1 -> ... -> the
// last layer, each on its own worker; the loss is the distance to a target.
bool train(rpc::Agent& agent, at::Tensor& w0) {
  const int world = agent.world_size();
  at::Tensor x = table_rows(at::arange(0, 64)) * 0.05;
  at::Tensor target = at::tanh(x.narrow(1, 0, kDim).flip({1}));
  auto forward = [&](const at::Tensor& in) {
    at::Tensor h = layer(in, w0);
    for (int r = 1; r < world; ++r)
      h = rpc::rpc_sync<at::Tensor>("worker" + std::to_string(r), "layer", h);
    return (h - target).pow(2).mean();
  };
  bool grads_ok = true;
  double first = 0, last = 0;
  const double lr = 0.5;
  for (int step = 0; step < 30; ++step) {
    dist::Context ctx(agent);
    at::Tensor loss = forward(x);
    dist::backward(ctx.id(), {loss});
    at::Tensor g0 = dist::get_gradients(ctx.id()).at(w0);
    if (step == 0) {
      // The same model in this process, with every layer's weight fetched.
      std::vector<at::Tensor> ws = {w0};
      for (int r = 1; r < world; ++r) {
        ws.push_back(
            rpc::rpc_sync<at::Tensor>("worker" + std::to_string(r), "weight").requires_grad_());
      }
      at::Tensor h = x;
      for (auto& w : ws) h = layer(h, w);
      auto local = torch::autograd::grad({(h - target).pow(2).mean()}, ws);
      grads_ok = at::allclose(g0, local[0], 1e-5, 1e-7);
      for (int r = 1; r < world; ++r) {
        at::Tensor remote = rpc::rpc_sync<at::Tensor>(
            "worker" + std::to_string(r), "grad_of_weight", static_cast<int64_t>(ctx.id()));
        grads_ok = grads_ok && at::allclose(remote, local[r], 1e-5, 1e-7);
      }
      first = loss.item<double>();
    }
    last = loss.item<double>();
    // Every worker steps its own layer with this context's gradients.
    for (int r = 1; r < world; ++r) {
      rpc::rpc_sync("worker" + std::to_string(r), "sgd_step", static_cast<int64_t>(ctx.id()), lr);
    }
    c10::NoGradGuard no_grad;
    w0.sub_(g0 * lr);
  }
  std::printf("model over %d workers: distributed gradients %s local autograd; loss %.4f -> %.4f\n",
              world, grads_ok ? "equal" : "DIFFER FROM", first, last);
  return grads_ok && last < first;
}

}  // namespace

static int job_main(int, char**) {
  try {
    auto registry = std::make_shared<rpc::Registry>();
    at::Tensor shard;  // this worker's rows, filled once we know our rank
    registry->def("lookup", [&shard](std::vector<int64_t> rows) {
      const int64_t world = rpc::current_agent()->world_size();
      std::vector<int64_t> local;
      for (int64_t r : rows) local.push_back(r / world);
      return at::index_select(shard, 0, at::tensor(local));
    });
    registry->def("shard_sum", [&shard]() { return at::sum(shard, 0); });
    registry->def("max_of", [](at::Tensor t) { return t.max().item<double>(); });
    // This worker's layer of the model trained in step 5.
    at::Tensor weight;
    registry->def("layer", [&weight](at::Tensor x) { return layer(x, weight); });
    registry->def("weight", [&weight]() { return weight.detach(); });
    registry->def("grad_of_weight", [&weight](int64_t ctx) {
      return dist::get_gradients(static_cast<uint64_t>(ctx)).at(weight);
    });
    registry->def("sgd_step", [&weight](int64_t ctx, double lr) {
      at::Tensor g = dist::get_gradients(static_cast<uint64_t>(ctx)).at(weight);
      c10::NoGradGuard no_grad;
      weight.sub_(g * lr);
    });
    registry->def("check_row", [](int64_t row) -> int64_t {
      if (row < 0 || row >= kRows)
        throw std::out_of_range("row " + std::to_string(row) + " does not exist");
      return row;
    });

    // Listen and meet the others only after the shard exists: calls can
    // arrive as soon as init returns on any worker.
    rpc::WorldEnv env = rpc::world_from_env();
    if (env.rank < 0 || env.world_size < 1) {
      std::fprintf(stderr, "rpc_demo: start me with tandem-run (RANK/WORLD_SIZE unset)\n");
      return 2;
    }
    shard = table_rows(at::arange(env.rank, kRows, env.world_size));
    at::manual_seed(env.rank);
    weight = (at::randn({kDim, kDim}) * 0.5).requires_grad_();
    auto agent = rpc::init(registry);
    const int world = agent->world_size();
    std::printf("%s up: %d rows of %d workers\n", agent->name().c_str(),
                static_cast<int>(shard.size(0)), world);

    if (agent->rank() == 0) {
      // 1. Lookups fan out to the owners concurrently.
      std::vector<int64_t> wanted = {3, 141, 592, 653, 999};
      std::vector<rpc::Future<at::Tensor>> parts;
      for (int64_t id : wanted) {
        parts.push_back(rpc::rpc_async<at::Tensor>("worker" + std::to_string(id % world), "lookup",
                                                   std::vector<int64_t>{id}));
      }
      std::vector<at::Tensor> rows;
      for (auto& p : parts) rows.push_back(p.wait()[0]);
      bool lookups_ok = at::allclose(at::stack(rows), table_rows(at::tensor(wanted)));
      std::printf("lookup of %zu rows from their owners: %s\n", wanted.size(),
                  lookups_ok ? "matches" : "WRONG");

      // 2. A reduction: each worker sums its shard, worker 0 adds them up.
      std::vector<rpc::Future<at::Tensor>> sums;
      for (int r = 0; r < world; ++r) {
        sums.push_back(rpc::rpc_async<at::Tensor>("worker" + std::to_string(r), "shard_sum"));
      }
      at::Tensor total = sums[0].wait();
      for (int r = 1; r < world; ++r) total = total + sums[r].wait();
      at::Tensor expect = at::sum(table_rows(at::arange(kRows)), 0);
      bool sum_ok = at::allclose(total, expect, 1e-4);
      std::printf("column sums reduced over %d workers: %s (first: %.2f)\n", world,
                  sum_ok ? "matches" : "WRONG", total[0].item<float>());

      // 3. A value that stays where it was made, used through a reference.
      const std::string last = "worker" + std::to_string(world - 1);
      rpc::RRef<at::Tensor> remote_sum = rpc::remote<at::Tensor>(last, "shard_sum");
      double remote_max = remote_sum.rpc_sync<double>("max_of");
      bool rref_ok = remote_max == sums[world - 1].wait().max().item<double>();
      std::printf("max of %s's column sums, computed where they live: %.2f (%s)\n",
                  remote_sum.owner_name().c_str(), remote_max, rref_ok ? "matches" : "WRONG");
      remote_sum = rpc::RRef<at::Tensor>();  // let the owner free it

      // 4. Errors come back typed, naming the worker.
      try {
        rpc::rpc_sync("worker" + std::to_string(world - 1), "check_row", 5000);
      } catch (const rpc::RemoteError& e) {
        std::printf("remote error, as expected: %s\n", e.what());
      }
      // 5. Model parallelism with distributed autograd.
      bool train_ok = train(*agent, weight);
      rpc::shutdown();
      return lookups_ok && sum_ok && rref_ok && train_ok ? 0 : 1;
    }
    rpc::shutdown();  // serve until everyone is done
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rpc_demo: %s\n", e.what());
    return 1;
  }
}

// examples/launch.h: under tandem-run, or started alone (2 workers).
int main(int argc, char** argv) { return examples::launch("rpc_demo", 2, argc, argv, job_main); }
