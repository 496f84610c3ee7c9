// DDP inside distributed autograd: a data-parallel dense part on each
// trainer, a head of its own on a parameter server, one step of the
// distributed engine and the DistributedOptimizer (PyTorch's "DDP + RPC").
#include "ddp_support.h"

#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randint.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "tandem/autograd/autograd.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/mesh/mesh.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/remote_module/remote_module.h"

using namespace tandem;
using namespace std::chrono_literals;
using tandem::Mesh;
using tandem::MeshOptions;
using test::Groups;
using test::World;
namespace dist = tandem::autograd;

namespace {

struct Batch {
  at::Tensor x, y;
};
Batch batch(int trainer, int step) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(500 + 31 * trainer + step));
  return {at::randn({6, 5}, gen), at::randint(0, 3, {6}, gen, at::kLong)};
}

std::mutex g_seed_mu;
torch::nn::Linear linear(int in, int out, uint64_t seed) {
  std::lock_guard<std::mutex> lock(g_seed_mu);
  at::manual_seed(seed);
  return torch::nn::Linear(in, out);
}

std::map<std::string, at::Tensor> state_of(torch::nn::Linear& m) {
  return {{"weight", m->weight.detach().clone()}, {"bias", m->bias.detach().clone()}};
}

// With `mesh`, the trainers' group is the dp group of a Mesh over the
// trainers alone (MeshOptions::ranks), the parameter server outside it;
// without, a process group of the trainers made directly.
void expect_hybrid_trains_as_one_process(bool mesh) {
  CAPTURE(mesh);
  const int trainers = 2, steps = 3;
  const double lr = 0.1;
  // The reference: the dense part's gradient averaged over the trainers,
  // each head trained by its own trainer's.
  torch::nn::Linear dense = linear(5, 4, 0);
  std::vector<torch::nn::Linear> heads = {linear(4, 3, 1), linear(4, 3, 2)};
  std::vector<std::map<std::string, at::Tensor>> head_start = {state_of(heads[0]),
                                                               state_of(heads[1])};
  {
    std::vector<at::Tensor> all = dense->parameters();
    for (auto& h : heads) {
      for (auto& p : h->parameters()) all.push_back(p);
    }
    torch::optim::SGD ref(all, torch::optim::SGDOptions(lr));
    for (int s = 0; s < steps; ++s) {
      ref.zero_grad();
      for (int t = 0; t < trainers; ++t) {
        Batch b = batch(t, s);
        torch::nn::functional::cross_entropy(heads[t](dense(b.x)), b.y).backward();
      }
      // Each head saw only its own trainer; the dense part averages both.
      for (auto& p : dense->parameters()) p.mutable_grad().div_(trainers);
      ref.step();
    }
  }

  World w(1 + trainers);  // worker0 holds the heads
  std::optional<Groups> g;
  if (!mesh) g.emplace(trainers);
  std::vector<std::vector<at::Tensor>> dense_after(trainers);
  std::vector<std::map<std::string, at::Tensor>> head_after(trainers);
  test::on_ranks(trainers, [&](int t) {
    rpc::Agent& agent = w[1 + t];
    std::optional<Mesh> trainers_mesh;
    if (mesh) {
      MeshOptions mo;
      mo.agent = w.agents[1 + t];
      mo.store = support::store_client(w.port);
      mo.timeout = 20s;
      mo.ranks = {1, 2};  // worker0, the heads' server, is outside it
      trainers_mesh.emplace(Mesh::Shape{{"dp", trainers}}, mo);
      CHECK(trainers_mesh->rank() == 1 + t);
      CHECK(trainers_mesh->coordinate("dp") == t);
      CHECK(trainers_mesh->worker_at({1 - t}) == "worker" + std::to_string(2 - t));
    }
    torch::nn::Linear mine = linear(5, 4, 0);
    ddp::DistributedDataParallel model(mine, {}, mesh ? trainers_mesh->group("dp") : g->groups[t]);
    nn::RemoteModule head(agent, "worker0/cpu", "Linear", {4, 3});
    head.load_state_dict(head_start[t]);
    std::vector<rpc::RRef<at::Tensor>> params;
    for (auto& p : mine->parameters())
      params.push_back(rpc::RRef<at::Tensor>::make_local(agent, p));
    for (auto& p : head.remote_parameters()) params.push_back(p);
    optim::Options o;
    o.lr = lr;
    optim::DistributedOptimizer opt(agent, optim::Kind::kSGD, params, o);
    for (int s = 0; s < steps; ++s) {
      dist::Context ctx(agent);
      Batch b = batch(t, s);
      at::Tensor loss = torch::nn::functional::cross_entropy(head.forward(model(b.x)), b.y);
      dist::backward(agent, ctx.id(), {loss});
      // The context holds the averaged gradient; .grad is never touched.
      CHECK_FALSE(mine->weight.grad().defined());
      opt.step(ctx.id());
    }
    for (auto& p : mine->parameters()) dense_after[t].push_back(p.detach().clone());
    head_after[t] = head.state_dict();
    // (The mesh's group closes here, with its peer's: closing waits for it.)
  });
  for (int t = 0; t < trainers; ++t) {
    INFO("trainer " << t);
    auto want = dense->parameters();
    for (size_t i = 0; i < want.size(); ++i)
      CHECK(at::allclose(dense_after[t][i], want[i], 1e-5, 1e-6));
    CHECK(at::allclose(head_after[t].at("weight"), heads[t]->weight, 1e-5, 1e-6));
    CHECK(at::allclose(head_after[t].at("bias"), heads[t]->bias, 1e-5, 1e-6));
  }
  w.shutdown();
}

}  // namespace

TEST_CASE("ddp hybrid: DDP's dense part and remote heads train as in one process") {
  expect_hybrid_trains_as_one_process(false);
}

TEST_CASE("ddp hybrid: the same with a mesh over the trainers, the parameter server outside it") {
  expect_hybrid_trains_as_one_process(true);
}
