// hybrid_ddp_rpc: data parallelism and model parallelism in one step, set up
// as in PyTorch's "Combining DistributedDataParallel with the Distributed RPC
// Framework" tutorial.
//
//   build/bin/tandem-run --nproc-per-node 4 build/bin/hybrid_ddp_rpc [--epochs 40] [--lr 0.2]
//
// Four processes, named as in the tutorial:
//   rank 0  "master"    builds an EmbeddingBag(100, 16, sum) RemoteModule on
//                       "ps", hands its reference to every trainer with an
//                       RPC that runs the trainer's training loop, and waits
//                       for their answers (the final loss);
//   rank 1  "ps"        the parameter server: holds the table and only serves;
//   rank 2+ "trainer0", "trainer1", ...: a process group of the trainers
//                       alone; each wraps the table's reference in its own
//                       RemoteModule and keeps a Linear(16, 8) wrapped in
//                       DistributedDataParallel over that group.
// Each step runs in a distributed autograd context: the embedding lookup on
// "ps", the DDP layer here, backward() through both (DDP's buckets average
// the Linear's gradients over the trainers while the embedding's gradients
// go back to "ps"), and one DistributedOptimizer (SGD) steps both owners.
// More processes give more trainers (--nproc-per-node 3 gives one).
//
// The batches follow the tutorial's shape (20 to 50 indices, bags of 1 to
// 10 of them) but the labels can be learnt: every one of the 100 items
// belongs to one of 8 classes, and a bag's label is the class most of its
// items belong to (the tutorial's labels are random). Each trainer draws its
// own batches. At the end the trainers check that their Linear layers are
// identical, as data parallelism promises; the master prints each trainer's
// final loss.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <torch/nn/modules/linear.h>

#include <cstdio>
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
namespace ddp = tandem::ddp;
namespace dist = tandem::autograd;
namespace optim = tandem::optim;
using ModuleRef = rpc::RRef<c10::IValue>;

constexpr int64_t kEmbeddings = 100;
constexpr int64_t kDim = 16;
constexpr int64_t kClasses = 8;
constexpr int64_t kBatchesPerEpoch = 10;  // as in the tutorial

std::string name_of(int rank) {
  if (rank == 0) return "master";
  if (rank == 1) return "ps";
  return "trainer" + std::to_string(rank - 2);
}

// One batch in the tutorial's shape: indices, the offsets of the bags in
// them, and each bag's label (the class most of its items have; the lower
// class on a tie).
struct Batch {
  at::Tensor indices, offsets, labels;
};
Batch next_batch(at::Generator& gen, const at::Tensor& class_of) {
  auto draw = [&](int64_t lo, int64_t hi) {  // uniform in [lo, hi]
    return at::randint(lo, hi + 1, {1}, gen, at::kLong).item<int64_t>();
  };
  const int64_t n = draw(20, 50);
  Batch b;
  b.indices = at::randint(0, kEmbeddings, {n}, gen, at::kLong);
  const auto* item = b.indices.data_ptr<int64_t>();
  const auto* cls = class_of.data_ptr<int64_t>();
  std::vector<int64_t> offsets, labels;
  for (int64_t start = 0; start < n;) {
    const int64_t end = std::min(n, start + draw(1, 10));
    int64_t votes[kClasses] = {};
    for (int64_t i = start; i < end; ++i) ++votes[cls[item[i]]];
    offsets.push_back(start);
    labels.push_back(std::max_element(votes, votes + kClasses) - votes);
    start = end;
  }
  b.offsets = at::tensor(offsets);
  b.labels = at::tensor(labels);
  return b;
}

// The tutorial's _run_trainer: runs on trainer `trainer` (its rank in the
// trainers' group), called by the master with the table's reference.
// Returns the last epoch's mean loss; throws when the trainers' DDP layers
// ended different.
double run_trainer(const ModuleRef& table_ref, int64_t trainer, int64_t epochs, double lr) {
  tandem::nn::RemoteModule table(table_ref);
  // Every trainer starts from its own draw: DDP gives them rank 0's.
  at::manual_seed(static_cast<uint64_t>(trainer));
  torch::nn::Linear fc(kDim, kClasses);
  ddp::DistributedDataParallel model(fc);  // over the default group: the trainers

  std::vector<rpc::RRef<at::Tensor>> params = table.remote_parameters();
  for (auto& p : model.parameters()) params.emplace_back(p);
  optim::Options o;
  o.lr = lr;
  optim::DistributedOptimizer opt(optim::Kind::kSGD, params, o);

  // The classes are the same everywhere; the batches are each trainer's own.
  at::Generator classes = at::make_generator<at::CPUGeneratorImpl>(1234);
  const at::Tensor class_of = at::randint(0, kClasses, {kEmbeddings}, classes, at::kLong);
  at::Generator batches = at::make_generator<at::CPUGeneratorImpl>(1000 + trainer);

  const std::string me = name_of(static_cast<int>(trainer) + 2);
  const int64_t log_every = std::max<int64_t>(1, epochs / 8);
  double epoch_loss = 0;
  for (int64_t epoch = 1; epoch <= epochs; ++epoch) {
    epoch_loss = 0;
    for (int64_t i = 0; i < kBatchesPerEpoch; ++i) {
      Batch b = next_batch(batches, class_of);
      dist::Context ctx;
      at::Tensor features = table.forward(b.indices, b.offsets);
      at::Tensor loss = at::cross_entropy_loss(model(features), b.labels);
      dist::backward(ctx.id(), {loss});
      opt.step(ctx.id());
      epoch_loss += loss.item<double>() / kBatchesPerEpoch;
    }
    if (epoch == 1 || epoch % log_every == 0 || epoch == epochs) {
      std::printf("%s: epoch %lld/%lld  loss %.4f\n", me.c_str(), static_cast<long long>(epoch),
                  static_cast<long long>(epochs), epoch_loss);
      std::fflush(stdout);
    }
  }
  // Every trainer's layer against the first trainer's (all trainers call it).
  const bool same = examples::same_on_every_rank(fc->parameters(), ddp::default_group());
  if (!same) throw std::runtime_error(me + ": the trainers' DDP layers differ after training");
  if (trainer == 0) {
    std::printf("trainers' DDP layers identical\n");
    std::fflush(stdout);
  }
  return epoch_loss;
}

int run_master(int trainers, int64_t epochs, double lr) {
  at::manual_seed(0);
  tandem::nn::RemoteModule table("ps/cpu", "EmbeddingBag", {kEmbeddings, kDim, std::string("sum")});
  // Small rows to start with (a sum of rows drawn from N(0, 1), the default,
  // drowns what SGD learns about each item for a long while).
  table.load_state_dict({{"weight", at::randn({kEmbeddings, kDim}) * 0.1}});
  std::printf(
      "master: EmbeddingBag(%lld, %lld, sum) on ps; %d trainer(s), %lld epoch(s) of %lld "
      "batches\n",
      static_cast<long long>(kEmbeddings), static_cast<long long>(kDim), trainers,
      static_cast<long long>(epochs), static_cast<long long>(kBatchesPerEpoch));
  std::fflush(stdout);
  // Training takes longer than the default call timeout: this call has none.
  rpc::CallOptions untimed;
  untimed.timeout = rpc::kNoTimeout;
  std::vector<rpc::Future<double>> runs;
  for (int t = 0; t < trainers; ++t) {
    runs.push_back(rpc::rpc_async<double>(untimed, name_of(t + 2), "run_trainer",
                                          table.get_module_rref(), static_cast<int64_t>(t), epochs,
                                          lr));
  }
  int rc = 0;
  for (int t = 0; t < trainers; ++t) {
    try {
      std::printf("master: %s done, last epoch's loss %.4f\n", name_of(t + 2).c_str(),
                  runs[t].wait());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "hybrid_ddp_rpc: %s failed: %s\n", name_of(t + 2).c_str(), e.what());
      rc = 1;
    }
    std::fflush(stdout);
  }
  return rc;
}

}  // namespace

static int job_main(int argc, char** argv) {
  try {
    const rpc::WorldEnv env = rpc::world_from_env();
    int64_t epochs = 40;
    double lr = 0.2;
    examples::Flags flags("hybrid_ddp_rpc");
    flags.add("--epochs", &epochs, 1, "epochs of 10 batches on each trainer")
        .add("--lr", &lr, "SGD learning rate");
    const std::string error = flags.parse(argc, argv);
    if (env.rank < 0 || env.world_size < 3) {
      return examples::outside_world(
          flags, error,
          "start me with 3 or more workers (a master, a parameter server and "
          "trainers): build/bin/tandem-run --nproc-per-node 4 "
          "build/bin/hybrid_ddp_rpc");
    }

    auto registry = std::make_shared<rpc::Registry>();
    registry->def("run_trainer", [](ModuleRef table, int64_t trainer, int64_t epochs, double lr) {
      return run_trainer(table, trainer, epochs, lr);
    });
    const int trainers = env.world_size - 2;
    if (env.rank >= 2) {
      // The trainers' own group, for DDP (the master and "ps" are not in it),
      // made before the agent starts: the master's call may come as soon as
      // every agent is up, and its handler needs the group.
      ddp::init_process_group("gloo", "env://", trainers, env.rank - 2);
    }
    rpc::AgentOptions options;
    options.name = name_of(env.rank);
    rpc::init(registry, options);
    int rc = 0;
    if (env.rank == 0) {
      // Only the master reads the flags; the others serve until it is done.
      rc = examples::run_worker(flags, error, /*speak=*/true,
                                [&] { return run_master(trainers, epochs, lr); });
    }
    // Graceful: returns once every worker is here, the master last of all.
    rpc::shutdown();
    if (ddp::is_initialized()) ddp::destroy_process_group();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hybrid_ddp_rpc: %s\n", e.what());
    return 1;
  }
}

// examples/launch.h: under tandem-run, or started alone (4 workers).
int main(int argc, char** argv) {
  return examples::launch("hybrid_ddp_rpc", 4, argc, argv, job_main);
}
