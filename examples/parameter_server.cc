// parameter_server: trainers sharing one embedding table that lives on a
// parameter server, as in PyTorch's parameter-server tutorial.
//
//   build/bin/tandem-run --nproc-per-node 3 build/bin/parameter_server [--steps 200] [--lr 1.0]
//
// worker0 is the parameter server: it builds EmbeddingBag(1000, 16, "sum")
// as a RemoteModule on itself and hands the module's reference to whoever
// asks ("table"); then it only serves, until every trainer said it is done.
// Ranks 1..N-1 are trainers (one is enough: --nproc-per-node 2). Each wraps
// the shared reference in its own RemoteModule, keeps a local Linear(16, 4)
// head, and trains both with distributed autograd and its own
// DistributedOptimizer (SGD). As in the tutorial, the trainers step the
// shared table without locking each other out (Hogwild style).
//
// The task is synthetic: each of the 1000 items belongs to one of 4
// classes; a bag is 8 random items, labelled with the class most of them
// belong to. Every trainer prints its mean loss every 20 steps.
//
// With --ddp (PyTorch's "DDP + distributed RPC" tutorial) the trainers'
// heads are one data-parallel head: DistributedDataParallel over a process
// group of the trainers alone, inside the same distributed autograd step,
// so the head's gradients are averaged while the table's go to the server.
// At the end the trainers check that their heads are identical.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/one_hot.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>

#include "examples/flags.h"
#include "examples/launch.h"
#include "examples/replicas.h"
#include "tandem/autograd/autograd.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/remote_module/remote_module.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rref.h"

namespace {

namespace rpc = tandem::rpc;
namespace dist = tandem::autograd;
namespace optim = tandem::optim;
using ModuleRef = rpc::RRef<c10::IValue>;

constexpr int64_t kItems = 1000;
constexpr int64_t kDim = 16;
constexpr int64_t kClasses = 4;
constexpr int64_t kBag = 8;
constexpr int64_t kBatch = 32;

// The parameter server's side: the table, and how many trainers are done.
struct Server {
  std::mutex mu;
  std::condition_variable cv;
  // Completed once the module exists: a trainer's "table" call waits for it.
  std::optional<rpc::Promise<ModuleRef>> table{rpc::Promise<ModuleRef>()};
  int done = 0;
};

int serve(Server& s, int trainers) {
  at::manual_seed(0);
  {
    // On this worker itself: the RemoteModule is how its reference is made.
    tandem::nn::RemoteModule table("worker0/cpu", "EmbeddingBag",
                                   {kItems, kDim, std::string("sum")});
    // Small rows to start with: a sum of 8 rows drawn from N(0, 1) (the
    // default) drowns what SGD learns about each item for hundreds of steps.
    table.load_state_dict({{"weight", at::randn({kItems, kDim}) * 0.1}});
    s.table->set_value(table.get_module_rref());
    std::printf("parameter server: EmbeddingBag(%lld, %lld, sum) ready for %d trainer(s)\n",
                static_cast<long long>(kItems), static_cast<long long>(kDim), trainers);
    std::fflush(stdout);
    std::unique_lock<std::mutex> lock(s.mu);
    s.cv.wait(lock, [&] { return s.done == trainers; });
    s.table.reset();
  }
  std::printf("parameter server: all %d trainer(s) done\n", trainers);
  return 0;
}

int train(int rank, int trainers, int64_t steps, double lr, bool data_parallel) {
  // Answered once the server has built the table (it starts with us).
  tandem::nn::RemoteModule table(rpc::rpc_sync<ModuleRef>("worker0", "table"));

  at::manual_seed(static_cast<uint64_t>(rank));
  torch::nn::Linear head(kDim, kClasses);
  // --ddp: the trainers' heads are one, averaged over a group of the trainers.
  std::shared_ptr<tandem::ddp::ProcessGroup> group;
  std::optional<tandem::ddp::DistributedDataParallel<torch::nn::LinearImpl>> ddp_head;
  if (data_parallel) {
    tandem::ddp::ProcessGroupOptions g;
    g.rank = rank - 1;
    g.world_size = trainers;
    g.group_name = "trainers";
    group = tandem::ddp::ProcessGroup::create(g);
    ddp_head.emplace(head, tandem::ddp::DDPOptions{}, group);
  }
  std::vector<rpc::RRef<at::Tensor>> params = table.remote_parameters();
  for (auto& p : head->parameters()) params.emplace_back(p);
  optim::Options o;
  o.lr = lr;
  optim::DistributedOptimizer opt(optim::Kind::kSGD, params, o);

  // The classes are the same on every trainer; the bags are each trainer's own.
  at::Generator task = at::make_generator<at::CPUGeneratorImpl>(1234);
  const at::Tensor class_of = at::randint(0, kClasses, {kItems}, task, at::kLong);
  at::Generator bags = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  const at::Tensor offsets = at::arange(0, kBatch * kBag, kBag, at::kLong);

  double sum = 0;
  int64_t since = 0;
  for (int64_t step = 0; step < steps; ++step) {
    at::Tensor items = at::randint(0, kItems, {kBatch * kBag}, bags, at::kLong);
    at::Tensor votes =
        at::one_hot(class_of.index_select(0, items), kClasses).view({kBatch, kBag, kClasses});
    at::Tensor labels = at::argmax(votes.sum(1), 1);

    dist::Context ctx;
    at::Tensor features = table.forward(items, offsets);
    at::Tensor logits = ddp_head ? (*ddp_head)(features) : head(features);
    at::Tensor loss = at::cross_entropy_loss(logits, labels);
    dist::backward(ctx.id(), {loss});
    opt.step(ctx.id());
    sum += loss.item<double>();
    ++since;
    if ((step + 1) % 20 == 0 || step + 1 == steps) {
      std::printf("trainer %d: step %lld/%lld  loss %.4f\n", rank, static_cast<long long>(step + 1),
                  static_cast<long long>(steps), sum / since);
      std::fflush(stdout);
      sum = 0;
      since = 0;
    }
  }
  if (data_parallel) {
    // Every trainer's head against the first trainer's.
    const bool same = examples::same_on_every_rank(head->parameters(), *group);
    if (rank == 1) std::printf("trainers' heads %s\n", same ? "identical" : "DIFFER");
    if (!same) return 1;
  }
  return 0;
}

}  // namespace

static int job_main(int argc, char** argv) {
  try {
    const rpc::WorldEnv env = rpc::world_from_env();
    Server server;
    auto registry = std::make_shared<rpc::Registry>();
    registry->def("table", [&server] {
      std::lock_guard<std::mutex> lock(server.mu);
      if (!server.table) throw std::logic_error("the table is gone: training is over");
      return server.table->future();
    });
    registry->def("trainer_done", [&server](int64_t) {
      std::lock_guard<std::mutex> lock(server.mu);
      ++server.done;
      server.cv.notify_all();
    });

    if (env.rank == 0 && env.world_size >= 2) {
      rpc::init(registry);
      int rc = serve(server, env.world_size - 1);
      rpc::shutdown();
      return rc;
    }

    int64_t steps = 200;
    double lr = 1.0;
    bool data_parallel = false;
    examples::Flags flags("parameter_server");
    flags.add("--steps", &steps, 1, "training steps of each trainer")
        .add("--lr", &lr, "SGD learning rate")
        .add_switch("--ddp", &data_parallel, "one DistributedDataParallel head for all trainers");
    const std::string error = flags.parse(argc, argv);
    if (env.rank < 0 || env.world_size < 2) {
      return examples::outside_world(flags, error,
                                     "start me with 2 or more workers: build/bin/tandem-run "
                                     "--nproc-per-node 3 build/bin/parameter_server");
    }
    rpc::init(registry);
    // Every trainer parses the same flags: the first one speaks for them.
    const int rc = examples::run_worker(flags, error, /*speak=*/env.rank == 1, [&] {
      try {
        return train(env.rank, env.world_size - 1, steps, lr, data_parallel);
      } catch (const std::exception& e) {
        throw std::runtime_error("trainer " + std::to_string(env.rank) + ": " + e.what());
      }
    });
    // Always, so that the server stops waiting for this trainer.
    rpc::rpc_sync("worker0", "trainer_done", static_cast<int64_t>(env.rank));
    rpc::shutdown();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parameter_server: %s\n", e.what());
    return 1;
  }
}

// examples/launch.h: under tandem-run, or started alone (3 workers).
int main(int argc, char** argv) {
  return examples::launch("parameter_server", 3, argc, argv, job_main);
}
