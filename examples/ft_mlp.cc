// ft_mlp: data-parallel training that goes on through a failure. Each
// process is a replica (tandem::ft::Manager): kill one and the others keep
// training from the next step; tandem-run starts it again and it is healed
// from a peer's memory, then trains with them.
//
//   build/bin/tandem-run --replace-failed 3 --nproc-per-node 3 build/bin/ft_mlp --steps 200
//
// The task is synthetic: --samples random inputs labelled by a random
// "teacher" MLP (the same on every replica, from --seed). In float64, so
// that a reference computed in another order of sums (one process, not an
// all-reduce) still agrees to 1e-5 after hundreds of Adam steps: in
// float32 the orders' rounding grows to 1e-3 over 900 steps. The sample stream
// is the quorum's (ft/manager.h, 6.): a failed step's samples are the next
// step's, so none is skipped or trained twice. Adam, so that healing moves
// optimizer state too.
//
// Every replica prints, on stdout:
//   started age_ms A t T replacement R     (at main: A ms after its process began; T wall ms)
//   step S k K loss L t T                  (each committed step: K replicas took part)
//   failed step S t T: WHY                 (a step committed by none)
//   healed bytes B state S ms M            (after it was healed)
//   final step S loss L norm N             (L: the loss over every sample; N: the parameters')
// --reference K1,K2,... computes, in one process, the run whose committed
// steps had K1, K2, ... replicas (what a survivor printed) and prints its
// final line: a survivor's must equal it (1e-5 relative).
//
// With --checkpoint-every N the quorum's first member writes a checkpoint
// every N committed steps, and a job restarted as a whole (no quorum left:
// tandem-run --max-restarts) resumes from the newest ("resumed S").
//
// With --ddp the gradients are averaged by DistributedDataParallel's
// buckets, overlapped with backward, over each quorum's group (made with
// init_sync off at the first quorum, moved by set_group() at each next),
// instead of Manager::allreduce_grads after backward.
//
// With --replica-size S a replica is S processes that shard the model
// between them (HSDP: FullyShardedDataParallel over the replica's own
// group, ft::Manager::replica_group(), each rank taking 1/S of the
// replica's batch; the shards' gradients averaged over the quorum's
// replicas): under tandem-run, ranks 0..S-1 are replica 0, and so on.
// Kill any rank and its replica sits out until the launcher's replacement
// is healed, shard by shard, from another replica's same rank.
//
// With --pipeline (and --replica-size 2) a replica is a pipeline row: rank
// 0 of the row holds the MLP's first layers and drives, rank 1 its last
// layer, and each step runs through tandem::pipeline::Pipe in 4
// micro-batches, over an RPC agent of the row's own made anew with each
// quorum (Manager::replica_store). Each rank's gradients are taken out of
// the step's distributed autograd context and averaged, stage by stage,
// over the quorum's rows; each rank steps its own Adam. Kill either rank
// and its row sits out until the replacement is healed from another row's
// same stage.
//
// --restart runs the same job the old way, for comparison (ft_bench): a
// plain process group, a checkpoint every --checkpoint-every steps by rank
// 0, and under tandem-run --max-restarts a failure restarts every worker
// from the newest checkpoint (printing "resumed S").
#include <ATen/ops/cat.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>


#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "examples/flags.h"
#include "examples/ft_checkpoint.h"
#include "examples/ft_lines.h"
#include "examples/pipeline_row.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/ddp/fully_sharded.h"
#include "tandem/ddp/process_group.h"
#include "tandem/ft/manager.h"
#include "tandem/remote_module/served.h"

namespace {

namespace ft = tandem::ft;
namespace ddp = tandem::ddp;
namespace nn = torch::nn;
using examples::begin_step;
using examples::print_started;
using examples::print_step;
using examples::wall_ms;

struct Config {
  int64_t steps = 100;
  int64_t samples = 4096;
  int64_t batch = 32;
  int64_t width = 256;
  int64_t seed = 1;
  int64_t step_ms = 0;
  int64_t min_replicas = 1;
  int64_t replicas = 0;
  int64_t checkpoint_every = 0;
  int64_t replica_size = 1;
  double lr = 1e-3;
  std::string reference;
  std::string checkpoint = "ft_mlp.ckpt";
  bool restart = false;
  bool ddp = false;
  bool pipeline = false;
};

constexpr int64_t kIn = 32, kOut = 8;

struct Data {
  at::Tensor x, y;
};

Data make_data(const Config& c) {
  at::manual_seed(static_cast<uint64_t>(c.seed) + 1000);
  Data d;
  d.x = at::randn({c.samples, kIn}).to(at::kDouble);
  nn::Sequential teacher(nn::Linear(kIn, 64), nn::Tanh(), nn::Linear(64, kOut));
  teacher->to(at::kDouble);
  at::NoGradGuard g;
  d.y = teacher->forward(d.x);
  return d;
}

nn::Sequential make_model(const Config& c) {
  at::manual_seed(static_cast<uint64_t>(c.seed));
  nn::Sequential m(nn::Linear(kIn, c.width), nn::ReLU(), nn::Linear(c.width, c.width), nn::ReLU(),
                   nn::Linear(c.width, kOut));
  m->to(at::kDouble);
  return m;
}

at::Tensor batch_loss(nn::Sequential& m, const Data& d, const std::vector<int64_t>& idx) {
  const at::Tensor i = at::tensor(idx, at::kLong);
  return torch::nn::functional::mse_loss(m->forward(d.x.index_select(0, i)),
                                         d.y.index_select(0, i));
}

void print_final(int64_t step, nn::Sequential& m, const Data& d) {
  at::NoGradGuard g;
  const double loss = torch::nn::functional::mse_loss(m->forward(d.x), d.y).item<double>();
  double sq = 0;
  for (const auto& p : m->parameters()) sq += p.pow(2).sum().item<double>();
  std::printf("final step %lld loss %.9g norm %.9g\n", static_cast<long long>(step), loss,
              std::sqrt(sq));
  std::fflush(stdout);
}

// This process's parameters ("p0", "p1", ...) and their Adam state, for a
// checkpoint (examples/ft_checkpoint.h).
examples::RankState state_of(const std::vector<at::Tensor>& params, torch::optim::Adam& opt) {
  return {examples::indexed_names(params.size()), params, &opt};
}

// --checkpoint-every's checkpoint; `layout` non-empty ("hsdp 2",
// "pipeline 2"): a replica of several processes, each rank's part its own.
examples::ReplicaCheckpoint checkpoint_of(const Config& c, const std::string& layout = "") {
  return {c.checkpoint, c.checkpoint_every, layout, !layout.empty(), ""};
}

int run_reference(const Config& c) {
  const std::vector<int> ks = examples::quorum_sizes(c.reference);
  const Data d = make_data(c);
  auto model = make_model(c);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(c.lr));
  int64_t cursor = 0;
  for (int k : ks) {
    opt.zero_grad();
    // The mean over k replicas' batches of their mean losses.
    for (int r = 0; r < k; ++r) {
      auto idx = ft::sample_stream(c.samples, static_cast<uint64_t>(c.seed), true,
                                   cursor + r * c.batch, c.batch);
      (batch_loss(model, d, idx) / k).backward();
    }
    opt.step();
    cursor += k * c.batch;
  }
  print_final(static_cast<int64_t>(ks.size()), model, d);
  return 0;
}

ft::ManagerOptions manager_options(const Config& c) {
  ft::ManagerOptions o;
  o.min_replicas = static_cast<int>(c.min_replicas);
  if (c.replicas > 0) o.max_replicas = static_cast<int>(c.replicas);
  o.dataset_size = c.samples;
  o.batch_size = c.batch;
  o.seed = static_cast<uint64_t>(c.seed);
  o.heartbeat_timeout = std::chrono::milliseconds(1500);
  o.join_timeout = std::chrono::milliseconds(2000);
  o.collective_timeout = std::chrono::seconds(20);
  return o;
}

int run_ft(const Config& c) {
  print_started();
  const Data d = make_data(c);
  auto model = make_model(c);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(c.lr));
  ft::ManagerOptions o = manager_options(c);
  // --ddp: DistributedDataParallel over each quorum's group.
  std::unique_ptr<ddp::DistributedDataParallel<nn::SequentialImpl>> net;
  if (c.ddp) {
    o.on_quorum = [&](ft::Manager& m) {
      if (net) return net->set_group(m.group());
      ddp::DDPOptions dopt;
      dopt.init_sync = false;  // (the Manager heals a newcomer's parameters)
      dopt.timeout = std::chrono::seconds(20);
      net = std::make_unique<ddp::DistributedDataParallel<nn::SequentialImpl>>(model, dopt,
                                                                              m.group());
    };
  }
  ft::Manager manager(o, ft::module_state(*model, opt));
  const auto checkpoint = checkpoint_of(c);
  const examples::RankState state = state_of(model->parameters(), opt);
  examples::resume_newest(checkpoint, manager, state);
  int64_t heals = 0;
  while (manager.step() < c.steps) {
    if (!begin_step(manager, heals)) return 0;
    opt.zero_grad();
    at::Tensor loss;
    if (c.ddp) {
      // The buckets' averages run during backward: a peer gone fails it.
      try {
        const at::Tensor i = at::tensor(manager.batch_indices(), at::kLong);
        loss = torch::nn::functional::mse_loss(net->forward(d.x.index_select(0, i)),
                                               d.y.index_select(0, i));
        loss.backward();
      } catch (const std::exception& e) {
        manager.report_error(e.what());
      }
      if (c.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(c.step_ms));
    } else {
      loss = batch_loss(model, d, manager.batch_indices());
      loss.backward();
      if (c.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(c.step_ms));
      std::vector<at::Tensor> grads;
      for (const auto& p : model->parameters()) grads.push_back(p.grad());
      manager.allreduce_grads(grads);
    }
    const int k = manager.participants();
    const bool commit = manager.should_commit();
    if (commit) opt.step();
    print_step(manager, commit, k, commit ? loss.item<double>() : 0);
    // The quorum's first member writes the job's checkpoint (every replica
    // holds the same state).
    if (commit) examples::save_every(checkpoint, manager, state);
  }
  print_final(manager.step(), model, d);
  return 0;
}

// HSDP under the Manager: each replica's S processes shard the model (FSDP
// over the replica's group, set again with each quorum), and each shard's
// gradient is averaged over the quorum's replicas.
// The end of a rank's step with a shard or stage of its own: `params`'
// gradients (zeros where none came) averaged over the quorum, the vote,
// and on commit `opt`'s update; prints the step's line. True: committed.
bool average_and_vote(const Config& c, ft::Manager& manager, const std::vector<at::Tensor>& params,
                      torch::optim::Adam& opt, double loss) {
  if (c.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(c.step_ms));
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (!p.grad().defined()) const_cast<at::Tensor&>(p).mutable_grad() = at::zeros_like(p);
    grads.push_back(p.grad());
  }
  manager.allreduce_grads(grads);
  const int k = manager.participants();
  const bool commit = manager.should_commit();
  if (commit) opt.step();
  print_step(manager, commit, k, loss);
  return commit;
}

int run_sharded(const Config& c) {
  print_started();
  const int size = static_cast<int>(c.replica_size);
  if (c.batch % size != 0) {
    throw std::invalid_argument("--batch " + std::to_string(c.batch) +
                                " does not split over --replica-size " + std::to_string(size));
  }
  const Data d = make_data(c);
  auto model = make_model(c);
  ft::ManagerOptions o = manager_options(c);
  o.replica_size = size;
  const char* rank_env = std::getenv("RANK");
  const int rank = (rank_env ? std::atoi(rank_env) : 0) % size;
  // The shards are laid out now; their group comes with each quorum.
  ddp::FSDPOptions fo;
  fo.timeout = std::chrono::seconds(20);
  ddp::FullyShardedDataParallel fsdp(model, fo, rank, size);
  torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(c.lr));
  // What the Manager heals and compares: this rank's shards and their state.
  nn::Module shards;
  int i = 0;
  for (auto& s : fsdp.parameters()) shards.register_parameter("unit" + std::to_string(i++), s);
  o.on_quorum = [&](ft::Manager& m) { fsdp.set_group(m.replica_group()); };
  ft::Manager manager(o, ft::module_state(shards, opt));
  // After a restart of the whole job: each rank's shards from the newest
  // checkpoint (the quorum's first replica writes one, its ranks together).
  const auto checkpoint = checkpoint_of(c, "hsdp " + std::to_string(size));
  examples::resume_newest(checkpoint, manager, state_of(fsdp.parameters(), opt));
  int64_t heals = 0;
  while (manager.step() < c.steps) {
    if (!begin_step(manager, heals)) return 0;
    fsdp.zero_grad();
    // This rank's part of the replica's batch.
    const auto batch = manager.batch_indices();
    const int64_t part = c.batch / size;
    std::vector<int64_t> mine(batch.begin() + rank * part, batch.begin() + (rank + 1) * part);
    double loss_value = 0;
    try {
      const at::Tensor idx = at::tensor(mine, at::kLong);
      at::Tensor loss = torch::nn::functional::mse_loss(fsdp.forward(d.x.index_select(0, idx)),
                                                        d.y.index_select(0, idx));
      loss.backward();
      loss_value = loss.item<double>();
    } catch (const std::exception& e) {
      // A process of this replica is gone (its collectives failed): the
      // step fails everywhere, and this one still takes part in the vote.
      manager.report_error(e.what());
    }
    if (average_and_vote(c, manager, fsdp.parameters(), opt, loss_value)) {
      examples::save_every(checkpoint, manager, state_of(fsdp.parameters(), opt));
    }
  }
  // The whole model on every rank of the replica, for the final line.
  std::vector<std::pair<std::string, at::Tensor>> whole;
  for (int to = 0; to < size; ++to) {
    auto dict = fsdp.full_state_dict(to);
    if (to == rank) whole = std::move(dict);
  }
  auto final_model = make_model(c);
  {
    at::NoGradGuard g;
    std::map<std::string, at::Tensor> by_name(whole.begin(), whole.end());
    for (auto& p : final_model->named_parameters()) p.value().copy_(by_name.at(p.key()));
  }
  print_final(manager.step(), final_model, d);
  return 0;
}

// --pipeline: a replica is a row of two processes, each holding a stage of
// the MLP (ranks 0: its first four modules; 1: its last), trained through a
// Pipe over the row's own RPC agent, made anew with each quorum
// (examples/pipeline_row.h).
int run_pipeline(const Config& c) {
  print_started();
  const Data d = make_data(c);
  auto o = manager_options(c);
  o.replica_size = 2;
  const char* rank_env = std::getenv("RANK");
  const int rank = (rank_env ? std::atoi(rank_env) : 0) % 2;
  // Every rank builds the whole model (the reference's initial values) and
  // keeps its stage of it.
  auto full = make_model(c);
  nn::Sequential stage =
      rank == 0 ? nn::Sequential(nn::Linear(full->ptr<nn::LinearImpl>(0)),
                                 nn::ReLU(full->ptr<nn::ReLUImpl>(1)),
                                 nn::Linear(full->ptr<nn::LinearImpl>(2)),
                                 nn::ReLU(full->ptr<nn::ReLUImpl>(3)))
                : nn::Sequential(nn::Linear(full->ptr<nn::LinearImpl>(4)));
  torch::optim::Adam opt(stage->parameters(), torch::optim::AdamOptions(c.lr));
  // What the row's RemoteModules serve: this process's stage itself.
  auto served = tandem::nn::serve_module(
      stage.ptr(), "ft_mlp stage " + std::to_string(rank),
      [stage](std::vector<c10::IValue>& args) mutable -> c10::IValue {
        return stage->forward(args.at(0).toTensor());
      });
  tandem::nn::register_factory("ft_mlp.stage",
                               [served](std::vector<c10::IValue>&) { return served; });
  tandem::pipeline::PipeOptions po;
  po.chunks = 4;
  po.loss = "mse";
  examples::PipelineRow row(stage->parameters(), "ft_mlp.stage", po, o.collective_timeout);
  o.on_quorum = [&](ft::Manager& m) { row.open(m); };
  ft::Manager manager(o, ft::module_state(*stage, opt));
  const auto checkpoint = checkpoint_of(c, "pipeline 2");
  examples::resume_newest(checkpoint, manager, state_of(stage->parameters(), opt));
  int64_t heals = 0;
  while (manager.step() < c.steps) {
    if (!begin_step(manager, heals)) return 0;
    at::Tensor x, y;
    if (rank == 0) {
      const at::Tensor idx = at::tensor(manager.batch_indices(), at::kLong);
      x = d.x.index_select(0, idx);
      y = d.y.index_select(0, idx);
    }
    const double loss = row.step(manager, x, y);
    if (average_and_vote(c, manager, stage->parameters(), opt, loss)) {
      examples::save_every(checkpoint, manager, state_of(stage->parameters(), opt));
    }
  }
  // The whole model on both ranks, for the final line: each parameter from
  // the rank whose stage holds it.
  {
    at::NoGradGuard g;
    const auto params = full->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor p = params[i];
      manager.replica_group()->broadcast(p, i < 4 ? 0 : 1);
    }
  }
  row.close(true);
  print_final(manager.step(), full, d);
  return 0;
}

// The old way: every worker restarts from the newest checkpoint.
int run_restart(const Config& c) {
  print_started();
  const Data d = make_data(c);
  auto model = make_model(c);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(c.lr));
  ddp::init_process_group("gloo");
  const int world = ddp::get_world_size();
  const int rank = ddp::get_rank();
  int64_t step = 0;
  if (auto found = tandem::checkpoint::latest(c.checkpoint)) {
    tandem::checkpoint::Reader r(found->path);
    examples::load_state(r, state_of(model->parameters(), opt));
    step = found->step;
    std::printf("resumed %lld t %lld\n", static_cast<long long>(step),
                static_cast<long long>(wall_ms()));
  }
  while (step < c.steps) {
    opt.zero_grad();
    auto idx = ft::sample_stream(c.samples, static_cast<uint64_t>(c.seed), true,
                                 step * world * c.batch + rank * c.batch, c.batch);
    at::Tensor loss = batch_loss(model, d, idx);
    loss.backward();
    if (c.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(c.step_ms));
    // One all-reduce of every gradient, as the fault-tolerant way does.
    std::vector<at::Tensor> flat;
    for (auto& p : model->parameters()) flat.push_back(p.grad().reshape({-1}));
    at::Tensor all = at::cat(flat);
    ddp::all_reduce(all);
    all.div_(world);
    int64_t at = 0;
    for (auto& p : model->parameters()) {
      p.grad().copy_(all.narrow(0, at, p.numel()).view_as(p));
      at += p.numel();
    }
    opt.step();
    ++step;
    std::printf("step %lld k %d loss %.6f t %lld\n", static_cast<long long>(step), world,
                loss.item<double>(), static_cast<long long>(wall_ms()));
    std::fflush(stdout);
    if (rank == 0 && step % c.checkpoint_every == 0) {
      tandem::checkpoint::save(c.checkpoint, step,
                               examples::state_part(state_of(model->parameters(), opt)));
    }
  }
  print_final(step, model, d);
  ddp::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  examples::Flags flags("ft_mlp");
  flags.add("--steps", &c.steps, 1, "committed steps to train")
      .add("--samples", &c.samples, 1, "samples in the dataset")
      .add("--batch", &c.batch, 1, "samples a replica a step")
      .add("--width", &c.width, 1, "the MLP's hidden width")
      .add("--seed", &c.seed, 0, "seed of the data, the model and the sample order")
      .add("--step-ms", &c.step_ms, 0, "extra milliseconds of work a step (pacing)")
      .add("--min-replicas", &c.min_replicas, 1, "a quorum's minimum")
      .add("--replicas", &c.replicas, 0, "replica ids 0..N-1 (0: WORLD_SIZE / --replica-size)")
      .add("--replica-size", &c.replica_size, 1,
           "processes a replica, sharding the model between them (HSDP)")
      .add("--lr", &c.lr, "Adam's learning rate")
      .add("--reference", &c.reference,
           "K1,K2,...: the run whose committed steps had these quorums")
      .add_switch("--restart", &c.restart, "no fault tolerance: restart from a checkpoint")
      .add_switch("--ddp", &c.ddp, "average by DistributedDataParallel's buckets in backward")
      .add_switch("--pipeline", &c.pipeline,
                  "a replica is a pipeline row of --replica-size 2 processes, a stage each")
      .add("--checkpoint", &c.checkpoint, "--restart's checkpoint folder")
      .add("--checkpoint-every", &c.checkpoint_every, 0,
           "a checkpoint into --checkpoint every N committed steps (0: none; --restart: 10)");
  if (std::string error = flags.parse(argc, argv); !error.empty()) {
    std::fprintf(stderr, "ft_mlp: %s\n%s", error.c_str(), flags.usage().c_str());
    return 2;
  }
  if (flags.help()) {
    std::printf("%s", flags.usage().c_str());
    return 0;
  }
  try {
    if (!c.reference.empty()) return run_reference(c);
    if (c.restart && c.checkpoint_every == 0) c.checkpoint_every = 10;
    if (c.restart) return run_restart(c);
    if (c.pipeline) {
      if (c.replica_size != 2 || c.ddp) {
        std::fprintf(stderr, "ft_mlp: --pipeline needs --replica-size 2 (two stages), and does "
                             "not take --ddp\n");
        return 2;
      }
      return run_pipeline(c);
    }
    return c.replica_size > 1 ? run_sharded(c) : run_ft(c);
  } catch (const ft::QuorumError& e) {
    std::fprintf(stderr, "ft_mlp: %s\n", e.what());
    return ft::kExitNotReplaceable;  // the job's failure: not replaced alone
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ft_mlp: %s\n", e.what());
    return 1;
  }
}
