// An outside project's program: built against an installed Tandem through
// find_package(Tandem), it starts a one-worker world (with a peer timeout of
// its own, and a NaN step skipped by a NonFiniteGuard), calls itself, and runs
// distributed autograd through that call and through a handler that chains
// its calls with then(), as the README shows, and through a remote value
// handed back to its owner inside a tuple; a DistributedOptimizer steps a
// parameter with that context's gradient, and a RemoteModule's parameters
// train through its forward. A one-rank DistributedDataParallel model takes a
// step, and a DistributedSampler gives its share; then one hybrid step: a
// DDP layer on a RemoteModule's output, inside a distributed autograd
// context, stepped with the module by one DistributedOptimizer. A 1F1B
// pipeline schedule is simulated, and a one-stage Pipe takes a zero-bubble
// step in two micro-batches inside a context, stepped by a
// DistributedOptimizer.
//
// `consumer spawn` starts a two-worker job from code (tandem::spawn finds the
// installed tandem-run beside the library): the workers call each other
// over the same-host shared-memory transport with a 1 MiB tensor.
// `consumer mesh` starts four, laid out as a mesh of 2 pipeline stages x 2
// data-parallel replicas: each replica's driver steps its two-stage pipe on
// its own rows, the stages average their gradients over the replicas, and
// the replicas end with the same parameters.
// `consumer shard` starts three, each with an RPC agent and the default
// process group at the job's one MASTER_PORT: a DDP step with
// ZeroRedundancyOptimizer and sharded gradients, its state consolidated and
// loaded into plain LibTorch, then FullyShardedDataParallel steps of a
// Sequential; every rank ends with the same model.
// `consumer tp` starts two: a transformer block split over them, with
// dropout and recomputation, equals the whole block, and its pieces saved
// by both load back whole.
// `consumer checkpoint` starts two: ZeroRedundancyOptimizer steps, and a
// JobState (the model once, each rank its share of Adam's state, the
// sampler's place, a RemoteModule's part, an FSDP model's slices and their
// Adam state) is saved in the background over a group of the saver's own,
// then, its parts verified, loaded into plain LibTorch on rank 0 alone: the
// models and each parameter's Adam state come back.
// `consumer ft` starts three replicas under ft::Manager: one reports an
// error in a step, which is then committed by none, and the quorum goes on;
// the replicas end alike, on the samples the stream gave them.
// `consumer ft_hsdp` starts four: two replicas of two processes, each an
// FSDP model over its replica's group (made without one, moved to each
// quorum's); a rank reports an error once, the step is committed by none,
// and the four end with the same parameters.
// `consumer ft_pipe` starts four: two pipeline rows of two stages, a Pipe
// over each row's own RPC agent made with each quorum
// (ft::Manager::replica_store, and a group of the row's own,
// replica_subgroup); a rank reports an error once, and every
// stage ends equal to local LibTorch's training on the same samples.
#include <optional>

#include <tandem/autograd/autograd.h>
#include <tandem/checkpoint/job.h>
#include <tandem/ddp/distributed_data_parallel.h>
#include <tandem/ddp/fully_sharded.h>
#include <tandem/ddp/sampler.h>
#include <tandem/ft/manager.h>
#include <tandem/mesh/mesh.h>
#include <tandem/optim/distributed_optimizer.h>
#include <tandem/optim/nonfinite.h>
#include <tandem/optim/zero_redundancy_optimizer.h>
#include <tandem/parallel/random.h>
#include <tandem/parallel/recompute.h>
#include <tandem/parallel/transformer.h>
#include <tandem/pipeline/pipe.h>
#include <tandem/pipeline/schedule.h>
#include <tandem/remote_module/remote_module.h>
#include <tandem/remote_module/served.h>
#include <tandem/rpc/agent.h>
#include <tandem/rpc/api.h>
#include <tandem/rpc/rref.h>
#include <tandem/rpc/spawn.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>

#include <ATen/ops/arange.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

int spawn_job() {
  tandem::spawn(2, [](int rank, int world) {
    auto reg = std::make_shared<tandem::rpc::Registry>();
    reg->def("echo", [](at::Tensor t) { return t; });
    tandem::rpc::init(reg);
    const std::string peer = "worker" + std::to_string((rank + 1) % world);
    at::Tensor big = at::arange(1 << 18, at::kFloat);  // 1 MiB
    at::Tensor back = tandem::rpc::rpc_sync<at::Tensor>(peer, "echo", big);
    const std::string via = tandem::rpc::current_agent()->transport_to(peer);
    std::printf("rank %d of %d: 1 MiB echoed by %s over %s, %s\n", rank, world, peer.c_str(),
                via.c_str(), at::equal(back, big) ? "intact" : "CHANGED");
    tandem::rpc::shutdown();
    if (!at::equal(back, big) || via != "shm") throw std::runtime_error("the echo went wrong");
  });
  std::printf("both spawned workers finished\n");
  return 0;
}

int mesh_job() {
  tandem::spawn(4, [](int rank, int) {
    tandem::rpc::init(std::make_shared<tandem::rpc::Registry>());
    {
      tandem::Mesh mesh({{"pp", 2}, {"dp", 2}});
      if (mesh.coordinate("pp") == 0) {
        std::vector<tandem::nn::RemoteModule> stages;
        for (int s = 0; s < 2; ++s) {
          stages.emplace_back(mesh.worker_at({{"pp", s}}) + "/cpu", "Linear",
                              std::vector<c10::IValue>{int64_t{4}, int64_t{4}});
          stages.back().load_state_dict(
              {{"weight", at::ones({4, 4}) * (s + 1)}, {"bias", at::zeros({4})}});
        }
        tandem::pipeline::PipeOptions o;
        o.chunks = 2;
        o.loss = "mse";
        o.data_parallel_group = mesh.group_name("dp");
        tandem::pipeline::Pipe pipe(stages, o);
        tandem::optim::DistributedOptimizer opt(tandem::optim::Kind::kSGD, pipe.parameters());
        const double row = mesh.coordinate("dp") + 1;  // each replica its own rows
        {
          tandem::autograd::Context ctx;
          pipe.step(ctx.id(), at::ones({4, 4}) * row, at::zeros({4, 4}));
          opt.step(ctx.id());
        }
        at::Tensor w = stages[1].state_dict().at("weight");
        auto all = mesh.group("dp")->all_gather(w);
        const bool same = at::equal(all[0], all[1]) && !at::equal(w, at::ones({4, 4}) * 2);
        std::printf("rank %d: replica %d stepped; replicas %s\n", rank, mesh.coordinate("dp"),
                    same ? "identical" : "DIFFERENT");
        if (!same) throw std::runtime_error("the replicas differ");
      }
      tandem::rpc::shutdown();
    }
  });
  std::printf("the 2 x 2 mesh job finished\n");
  return 0;
}

// Whether every rank holds what this one does.
bool same_everywhere(const at::Tensor& t) {
  for (const auto& other : tandem::ddp::all_gather(t.detach().contiguous())) {
    if (!at::equal(other, t)) return false;
  }
  return true;
}

// `consumer tp`: two ranks split one transformer block (ParallelBlock, with
// dropout drawn as one process draws it, recomputed in backward): each
// rank's output equals the whole block's in one process, and under
// sequence parallelism (partial gradients summed in backward) its piece
// and its gradients the plain split's; both save their pieces, which load
// back whole into the one-process block.
int tp_job() {
  namespace par = tandem::parallel;
  tandem::spawn(2, [](int rank, int) {
    tandem::ddp::init_process_group("gloo");
    auto group = tandem::ddp::default_group_ptr();
    const int64_t C = 16, heads = 4;
    at::manual_seed(3);
    torch::nn::LayerNorm ln1(torch::nn::LayerNormOptions({C})), ln2(torch::nn::LayerNormOptions({C}));
    torch::nn::Linear qkv(C, 3 * C), proj(C, C), fc(C, 4 * C), out(4 * C, C);
    par::BlockOptions o;
    o.attention_dropout = o.residual_dropout = 0.1;
    par::ParallelBlock split(ln1, qkv, proj, ln2, fc, out, heads, group, o);
    const at::Tensor x = at::randn({2, 5, C}, at::detail::createCPUGenerator(11));
    // The whole block in this process, its masks from the same generator.
    par::rng_tracker().seed(7);
    at::Tensor want;
    {
      torch::NoGradGuard no_grad;
      auto drop = [](const at::Tensor& t) {
        return par::dropout(t, 0.1, true, par::rng_tracker().get("block"));
      };
      const int64_t B = 2, T = 5, hd = C / heads;
      at::Tensor p = qkv(ln1(x)).view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});
      at::Tensor att = at::matmul(p[0], p[1].transpose(-2, -1)) / std::sqrt(double(hd));
      att = at::softmax(att.masked_fill(at::ones({T, T}, at::kBool).triu(1), -INFINITY), -1);
      at::Tensor h = x + drop(proj(at::matmul(drop(att), p[2]).transpose(1, 2).reshape({B, T, C})));
      want = h + drop(out(at::gelu(fc(ln2(h)))));
    }
    par::rng_tracker().seed(7);
    const at::Tensor xs = x.clone().requires_grad_();
    const at::Tensor y = tandem::nn::recompute([&](const at::Tensor& h) { return split(h); }, xs,
                                               split->parameters());
    at::sum(y).backward();
    if (!at::allclose(y, want, 1e-5, 1e-6)) throw std::runtime_error("the split block differs");
    {
      // Under sequence parallelism, its LayerNorms' partial gradients summed
      // inside backward (sum_partial_grads): this rank's piece of the
      // output, and the LayerNorms' whole gradients, as the plain split's.
      par::BlockOptions so = o;
      so.sequence_parallel = so.sum_partial_grads = true;
      par::ParallelBlock seq(ln1, qkv, proj, ln2, fc, out, heads, group, so);
      const at::Tensor x6 = at::randn({2, 6, C}, at::detail::createCPUGenerator(12));
      par::rng_tracker().seed(8);
      split->zero_grad();
      const at::Tensor whole_y = split(x6);
      at::sum(whole_y * whole_y).backward();
      par::rng_tracker().seed(8);
      const at::Tensor piece = par::piece_of(x6, 1, rank, 2).clone();
      const at::Tensor y6 = seq(piece);
      at::sum(y6 * y6).backward();
      if (!at::allclose(y6, par::piece_of(whole_y, 1, rank, 2), 1e-5, 1e-6) ||
          !at::allclose(seq->ln1->weight.grad(), split->ln1->weight.grad(), 1e-4, 1e-6) ||
          !at::allclose(seq->proj->bias.grad(), split->proj->bias.grad(), 1e-4, 1e-6)) {
        throw std::runtime_error("the sequence-parallel block differs");
      }
    }
    const std::string dir = "consumer_tp.ckpt";
    tandem::checkpoint::JobState state(rank);
    state.module("block", *split);
    tandem::checkpoint::SaveOptions so;
    so.group = group;
    tandem::checkpoint::save_job(dir, 1, state, so);
    if (rank == 0) {
      // The pieces into the whole modules, by the whole block's names.
      torch::nn::Linear qkv2(C, 3 * C), out2(4 * C, C);
      tandem::checkpoint::JobState back;
      back.module("block.qkv", *qkv2).module("block.out", *out2);
      tandem::checkpoint::load_latest_job(dir, back);
      if (!at::equal(qkv2->weight, qkv->weight) || !at::equal(out2->weight, out->weight) ||
          !at::equal(out2->bias, out->bias)) {
        throw std::runtime_error("the pieces did not load back whole");
      }
      std::filesystem::remove_all(dir);
    }
    group->barrier();
    std::printf("rank %d: a split block equals the whole, its pieces load back whole\n", rank);
    tandem::ddp::destroy_process_group();
  });
  return 0;
}

int shard_job() {
  tandem::spawn(3, [](int rank, int) {
    tandem::rpc::init(std::make_shared<tandem::rpc::Registry>());
    tandem::ddp::init_process_group("gloo");
    {
      // ZeRO stages 1 and 2 under DDP.
      torch::nn::Linear fc(8, 5);
      tandem::optim::Options o;
      o.lr = 0.01;
      tandem::optim::ZeroRedundancyOptimizer opt(fc->parameters(), tandem::optim::Kind::kAdam, o);
      tandem::ddp::DDPOptions d;
      d.gradient_owner = opt.gradient_owner();
      tandem::ddp::DistributedDataParallel net(fc, d);
      at::sum(net(at::ones({2, 8}) * (rank + 1))).backward();
      opt.clip_grad_norm(1.0);
      opt.step();
      opt.consolidate_state_dict(0);
      if (rank == 0) {
        const std::string bytes = opt.state_dict();
        torch::serialize::InputArchive in;
        in.load_from(bytes.data(), bytes.size());
        torch::optim::Adam plain(fc->parameters());
        plain.load(in);
      }
      if (!same_everywhere(fc->weight)) throw std::runtime_error("ZeRO's replicas differ");
      // Stage 3.
      torch::nn::Sequential seq(torch::nn::Linear(8, 16), torch::nn::Linear(16, 4));
      tandem::ddp::FullyShardedDataParallel fsdp(seq);
      torch::optim::SGD sgd(fsdp.parameters(), 0.1);
      for (int step = 0; step < 2; ++step) {
        at::sum(fsdp(at::ones({2, 8}) * (rank + 1))).backward();
        sgd.step();
        sgd.zero_grad();
      }
      auto full = fsdp.full_state_dict(0);
      if (rank == 0 && (full.size() != 4 || full[0].first != "0.weight" ||
                        full[0].second.sizes() != at::IntArrayRef{16, 8})) {
        throw std::runtime_error("FSDP's gathered state is not the model's");
      }
      std::printf("rank %d: ZeRO and FSDP stepped; %zu tensors gathered\n", rank, full.size());
    }
    tandem::ddp::destroy_process_group();
    tandem::rpc::shutdown();
  });
  std::printf("the sharded job finished\n");
  return 0;
}

int checkpoint_job() {
  tandem::spawn(2, [&](int rank, int) {
    // (the workers run this program anew: they agree on the job's port)
    const std::string dir = std::string("/tmp/tandem-consumer-ckpt-") + std::getenv("MASTER_PORT");
    tandem::ddp::init_process_group("gloo");
    tandem::rpc::init(std::make_shared<tandem::rpc::Registry>());
    {
      torch::nn::Linear fc(8, 5);
      // A piece on another worker, written there: rank 0's RemoteModule on worker1.
      std::optional<tandem::nn::RemoteModule> far;
      if (rank == 0) far.emplace("worker1/cpu", "Linear", std::vector<c10::IValue>{4, 3});
      tandem::optim::Options o;
      o.lr = 0.01;
      tandem::optim::ZeroRedundancyOptimizer opt(fc->parameters(), tandem::optim::Kind::kAdam, o);
      tandem::ddp::DistributedSampler sampler(40, 2, rank);
      sampler.next(4);
      for (int step = 0; step < 2; ++step) {
        at::sum(fc(at::ones({2, 8}))).backward();
        opt.step();
        opt.zero_grad();
      }
      std::vector<std::string> names;
      for (const auto& p : fc->named_parameters()) names.push_back(p.key());
      // FSDP's shards, each rank its slices of every parameter and of Adam's state.
      tandem::ddp::FullyShardedDataParallel fsdp(
          torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Linear(16, 4)));
      torch::optim::Adam fsdp_adam(fsdp.parameters());
      at::sum(fsdp(at::ones({2, 8}))).backward();
      fsdp_adam.step();
      const auto fsdp_full = fsdp.full_state_dict(0);
      tandem::checkpoint::JobState state(rank);
      state.module("fc", *fc, rank == 0).optimizer("adam", opt, names).sampler("data", sampler);
      state.module("seq", fsdp).optimizer("seq_adam", fsdp_adam, fsdp);
      if (far) state.remote_module("far", *far);
      tandem::ddp::ProcessGroupOptions go;
      go.group_name = "checkpoints";
      tandem::checkpoint::SaveOptions so;
      so.group = tandem::ddp::ProcessGroup::create(go);
      tandem::checkpoint::AsyncSaver saver(dir, so);
      saver.save(2, state.part(), state.remote_writers());
      saver.wait();
      if (rank == 0) {
        torch::nn::Linear again(8, 5);
        torch::optim::Adam adam(again->parameters());
        std::vector<std::pair<std::string, at::Tensor>> named;
        for (const auto& p : again->named_parameters()) named.emplace_back(p.key(), p.value());
        tandem::ddp::DistributedSampler one(40, 1, 0);
        tandem::nn::RemoteModule far_again("worker1/cpu", "Linear", {4, 3});
        tandem::checkpoint::JobState load;
        load.module("fc", *again).optimizer("adam", adam, named).sampler("data", one);
        load.remote_module("far", far_again);
        // (every part read and checked against the manifest first)
        const auto found =
            tandem::checkpoint::latest(dir, tandem::checkpoint::LatestOptions::verified());
        if (!found || found->step != 2) throw std::runtime_error("no whole step 2 found");
        const auto step = tandem::checkpoint::load_latest_job(dir, load);
        if (step != 2 || !at::equal(again->weight, fc->weight) || one.position() != 8 ||
            !at::equal(far_again.state_dict().at("weight"), far->state_dict().at("weight")) ||
            tandem::checkpoint::restart_count() != 0) {
          throw std::runtime_error("the job's state did not come back");
        }
        if (adam.state().size() != 2) throw std::runtime_error("Adam's state did not come back");
        for (const auto& [key, st] : adam.state()) {
          if (static_cast<torch::optim::AdamParamState&>(*st).step() != 2) {
            throw std::runtime_error("a parameter's Adam state did not come back");
          }
        }
        // The FSDP model's slices, whole again in one process.
        torch::nn::Sequential seq(torch::nn::Linear(8, 16), torch::nn::Linear(16, 4));
        torch::optim::Adam seq_adam(seq->parameters());
        std::vector<std::pair<std::string, at::Tensor>> seq_named;
        for (const auto& p : seq->named_parameters()) seq_named.emplace_back(p.key(), p.value());
        tandem::checkpoint::JobState plain;
        plain.module("seq", *seq).optimizer("seq_adam", seq_adam, seq_named);
        tandem::checkpoint::load_latest_job(dir, plain);
        for (const auto& [name, t] : fsdp_full) {
          if (!at::equal(seq->named_parameters()[name], t)) {
            throw std::runtime_error("FSDP's '" + name + "' did not come back whole");
          }
        }
        if (seq_adam.state().size() != 4) {
          throw std::runtime_error("FSDP's Adam state did not come back whole");
        }
        std::printf(
            "rank 0: the job's state came back from step %lld into plain Adam, FSDP's shards "
            "into one model\n",
            static_cast<long long>(*step));
        std::filesystem::remove_all(dir);
      }
    }
    tandem::ddp::destroy_process_group();
    tandem::rpc::shutdown();
  });
  std::printf("the checkpointed job finished\n");
  return 0;
}

int ft_job() {
  namespace ft = tandem::ft;
  tandem::spawn(3, [](int rank, int) {
    at::manual_seed(5);
    const at::Tensor x = at::randn({30, 4}), y = at::randn({30, 1});
    torch::nn::Linear model(4, 1);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
    ft::ManagerOptions o;
    o.dataset_size = 30;
    o.batch_size = 2;
    ft::Manager manager(o, ft::module_state(*model, opt));
    int failed = 0;
    for (int tried = 0; manager.step() < 6; ++tried) {
      manager.start_step();
      if (tried == 2 && rank == 2) manager.report_error("a NaN loss");
      opt.zero_grad();
      const at::Tensor i = at::tensor(manager.batch_indices(), at::kLong);
      at::mse_loss(model(x.index_select(0, i)), y.index_select(0, i)).backward();
      manager.allreduce_grads({model->weight.grad(), model->bias.grad()});
      if (manager.should_commit()) {
        opt.step();
      } else {
        ++failed;
      }
    }
    if (failed != 1 || manager.samples_done() != 6 * 3 * 2 || manager.participants() != 3) {
      throw std::runtime_error("replica " + std::to_string(rank) + ": " + std::to_string(failed) +
                               " failed steps, " + std::to_string(manager.samples_done()) +
                               " samples done");
    }
  });
  std::printf("three replicas trained through a failed step\n");
  return 0;
}

int ft_hsdp_job() {
  namespace ft = tandem::ft;
  tandem::spawn(4, [](int rank, int) {
    at::manual_seed(5);
    const at::Tensor x = at::randn({40, 4}), y = at::randn({40, 1});
    torch::nn::Sequential model(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 1));
    const int part = rank % 2;
    tandem::ddp::FullyShardedDataParallel fsdp(model, {}, part, 2);
    torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(0.01));
    torch::nn::Module shards;
    for (size_t k = 0; k < fsdp.parameters().size(); ++k) {
      shards.register_parameter("unit" + std::to_string(k), fsdp.parameters()[k]);
    }
    ft::ManagerOptions o;
    o.replica_size = 2;
    o.dataset_size = 40;
    o.batch_size = 4;
    o.on_quorum = [&](ft::Manager& m) { fsdp.set_group(m.replica_group()); };
    ft::Manager manager(o, ft::module_state(shards, opt));
    int failed = 0;
    for (int tried = 0; manager.step() < 5; ++tried) {
      manager.start_step();
      if (tried == 1 && rank == 3) manager.report_error("a NaN loss");
      fsdp.zero_grad();
      auto all = manager.batch_indices();
      const at::Tensor i = at::tensor(std::vector<int64_t>(all.begin() + 2 * part,
                                                           all.begin() + 2 * part + 2),
                                      at::kLong);
      at::mse_loss(fsdp.forward(x.index_select(0, i)), y.index_select(0, i)).backward();
      std::vector<at::Tensor> grads;
      for (auto& s : fsdp.parameters()) grads.push_back(s.grad());
      manager.allreduce_grads(grads);
      if (manager.should_commit()) {
        opt.step();
      } else {
        ++failed;
      }
    }
    // Each shard equal across the replicas: the same rank of the other replica.
    at::Tensor mine = at::cat({fsdp.parameters()[0].detach().flatten(),
                               fsdp.parameters()[1].detach().flatten()});
    at::Tensor other = mine.clone();
    manager.group()->broadcast(other, 0);
    if (failed != 1 || manager.participants() != 2 || !at::equal(mine, other)) {
      throw std::runtime_error("process " + std::to_string(rank) + ": " + std::to_string(failed) +
                               " failed steps, shards equal: " +
                               std::to_string(at::equal(mine, other)));
    }
  });
  std::printf("two HSDP replicas trained through a failed step\n");
  return 0;
}

// A stage's gradients in a step's distributed autograd context, onto its .grad.
void take_grads(tandem::rpc::Agent& agent, uint64_t context, torch::nn::Sequential& stage) {
  const auto grads = tandem::autograd::get_gradients(agent, context);
  for (auto& p : stage->parameters()) {
    p.mutable_grad() = grads.contains(p) ? grads.at(p).clone() : at::zeros_like(p);
  }
}

int ft_pipe_job() {
  namespace ft = tandem::ft;
  namespace rpc = tandem::rpc;
  tandem::spawn(4, [](int rank, int) {
    const int part = rank % 2;  // the stage this process holds in its row
    at::manual_seed(5);
    const at::Tensor x = at::randn({40, 4}), y = at::randn({40, 1});
    auto build = [] {
      at::manual_seed(7);
      return torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Tanh(),
                                   torch::nn::Linear(6, 1));
    };
    auto full = build();
    torch::nn::Sequential stage =
        part == 0 ? torch::nn::Sequential(torch::nn::Linear(full->ptr<torch::nn::LinearImpl>(0)),
                                          torch::nn::Tanh(full->ptr<torch::nn::TanhImpl>(1)))
                  : torch::nn::Sequential(torch::nn::Linear(full->ptr<torch::nn::LinearImpl>(2)));
    torch::optim::Adam opt(stage->parameters(), torch::optim::AdamOptions(0.01));
    auto served = tandem::nn::serve_module(
        stage.ptr(), "stage", [stage](std::vector<c10::IValue>& a) mutable -> c10::IValue {
          return stage->forward(a.at(0).toTensor());
        });
    tandem::nn::register_factory("consumer.stage",
                                 [served](std::vector<c10::IValue>&) { return served; });
    auto registry = std::make_shared<rpc::Registry>();
    registry->def("take_grads", [&stage](int64_t context) {
      take_grads(*rpc::handler_agent(), static_cast<uint64_t>(context), stage);
      return true;
    });
    // The row's agent and, on its driver, the pipe: made anew with each quorum.
    std::shared_ptr<rpc::Agent> agent;
    std::vector<tandem::nn::RemoteModule> stages;
    std::unique_ptr<tandem::pipeline::Pipe> pipe;
    auto close = [&](bool graceful) {
      pipe.reset();
      stages.clear();
      if (agent) agent->shutdown(graceful);
      agent.reset();
    };
    ft::ManagerOptions o;
    o.replica_size = 2;
    o.dataset_size = 40;
    o.batch_size = 4;
    o.on_quorum = [&](ft::Manager& m) {
      close(false);
      rpc::AgentOptions ao;
      ao.name = "s" + std::to_string(part);
      ao.rank = part;
      ao.world_size = 2;
      agent = rpc::Agent::create(ao, registry, m.replica_store("rpc"));
      // A group of the row's own made in the quorum too (a stage's tp group's way).
      auto pair = m.replica_subgroup("pair", {1, 0});
      at::Tensor sum = at::full({1}, static_cast<double>(part + 1), at::kDouble);
      pair->all_reduce(sum);
      if (pair->rank() != 1 - part || sum.item<double>() != 3) {
        throw std::logic_error("the row's subgroup is not the row's two processes");
      }
      if (part != 0) return;
      stages = {tandem::nn::RemoteModule(*agent, "s0/cpu", "consumer.stage"),
                tandem::nn::RemoteModule(*agent, "s1/cpu", "consumer.stage")};
      tandem::pipeline::PipeOptions po;
      po.chunks = 2;
      po.loss = "mse";
      pipe = std::make_unique<tandem::pipeline::Pipe>(*agent, stages, po);
    };
    ft::Manager manager(o, ft::module_state(*stage, opt));
    int failed = 0;
    for (int tried = 0; manager.step() < 5; ++tried) {
      manager.start_step();
      // (both stages past the last update before the driver's forward)
      at::Tensor ready = at::ones({1});
      manager.replica_group()->all_reduce(ready);
      if (part == 0) {
        tandem::autograd::Context ctx(*agent);
        const at::Tensor i = at::tensor(manager.batch_indices(), at::kLong);
        pipe->step(ctx.id(), x.index_select(0, i), y.index_select(0, i));
        agent->rpc_sync("s1", "take_grads", static_cast<int64_t>(ctx.id()));
        take_grads(*agent, ctx.id(), stage);
      }
      at::Tensor done = at::ones({1});
      manager.replica_group()->all_reduce(done);  // (stage 1's gradients are in)
      if (tried == 1 && rank == 3) manager.report_error("a NaN loss");
      std::vector<at::Tensor> grads;
      for (auto& p : stage->parameters()) grads.push_back(p.grad());
      manager.allreduce_grads(grads);
      if (manager.should_commit()) {
        opt.step();
      } else {
        ++failed;
      }
    }
    close(true);
    // Local LibTorch on the same samples: each committed step the mean over
    // the two rows' batches.
    auto ref = build();
    torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.01));
    for (int64_t s = 0; s < 5; ++s) {
      ref_opt.zero_grad();
      for (int64_t r = 0; r < 2; ++r) {
        const at::Tensor i = at::tensor(ft::sample_stream(40, 0, true, s * 8 + r * 4, 4), at::kLong);
        (at::mse_loss(ref->forward(x.index_select(0, i)), y.index_select(0, i)) / 2).backward();
      }
      ref_opt.step();
    }
    const auto mine = stage->parameters();
    const auto all = ref->parameters();
    bool equal = true;
    for (size_t k = 0; k < mine.size(); ++k) {
      equal = equal && at::allclose(mine[k], all[part == 0 ? k : k + 2], 1e-5, 1e-6);
    }
    if (failed != 1 || manager.participants() != 2 || !equal) {
      throw std::runtime_error("process " + std::to_string(rank) + ": " + std::to_string(failed) +
                               " failed steps, stage equal to local LibTorch's: " +
                               std::to_string(equal));
    }
  });
  std::printf("two pipeline rows trained through a failed step, equal to local LibTorch\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "ft") == 0) return ft_job();
  if (argc > 1 && std::strcmp(argv[1], "ft_hsdp") == 0) return ft_hsdp_job();
  if (argc > 1 && std::strcmp(argv[1], "ft_pipe") == 0) return ft_pipe_job();
  if (argc > 1 && std::strcmp(argv[1], "checkpoint") == 0) return checkpoint_job();
  if (argc > 1 && std::strcmp(argv[1], "spawn") == 0) return spawn_job();
  if (argc > 1 && std::strcmp(argv[1], "mesh") == 0) return mesh_job();
  if (argc > 1 && std::strcmp(argv[1], "shard") == 0) return shard_job();
  if (argc > 1 && std::strcmp(argv[1], "tp") == 0) return tp_job();
  auto reg = std::make_shared<tandem::rpc::Registry>();
  reg->def("twice", [](int64_t x) { return 2 * x; });
  reg->def("scale", [](at::Tensor t, double s) { return at::mul(t, s); });
  reg->def("scale_twice", [](at::Tensor t) {
    auto agent = tandem::rpc::current_agent();
    return agent->rpc_async<at::Tensor>("worker0", "scale", t, 2)
        .then([agent](tandem::rpc::Future<at::Tensor> r) {
          return agent->rpc_async<at::Tensor>("worker0", "scale", r.wait(), 3);
        });
  });
  // The owner scales a value it holds, handed to it inside a tuple.
  reg->def("scale_held", [](std::tuple<double, tandem::rpc::RRef<at::Tensor>> p) {
    return at::mul(std::get<1>(p).local_value(), std::get<0>(p));
  });
  tandem::rpc::AgentOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.init_method = "tcp://127.0.0.1:0";  // one worker: it hosts the store itself
  o.peer_timeout = std::chrono::seconds(5);  // a silent peer counts as stalled after 5 s
  tandem::rpc::init(reg, o);
  int64_t y = tandem::rpc::rpc_sync<int64_t>("worker0", "twice", 21);
  if (!tandem::rpc::current_agent()->stalled("worker0").empty()) {
    throw std::runtime_error("a worker that answers counts as stalled");
  }
  // A step whose loss is NaN is skipped, and counted.
  tandem::optim::NonFiniteGuard guard(tandem::optim::NonFinite::kSkip);
  if (!guard.check(1, 0.5, 1.0) || guard.check(2, std::nan(""), 1.0) || guard.skipped() != 1) {
    throw std::runtime_error("the non-finite guard did not skip a NaN step");
  }
  double g = 0, chained = 0;
  bool named = false;
  {
    tandem::autograd::Context ctx;
    at::Tensor x = at::ones({4}).requires_grad_();
    at::Tensor z = tandem::rpc::rpc_sync<at::Tensor>("worker0", "scale", x, 3.0);
    tandem::autograd::backward(ctx.id(), {at::sum(z)});
    auto grads = tandem::autograd::get_gradients(ctx.id());
    g = grads.at(x)[0].item<double>();
    try {
      grads.at(at::ones({4}).requires_grad_());
    } catch (const std::out_of_range& e) {
      named = std::string(e.what()).find("got no gradient") != std::string::npos;
    }
  }
  {
    tandem::autograd::Context ctx;
    at::Tensor x = at::ones({4}).requires_grad_();
    at::Tensor w = tandem::rpc::rpc_sync<at::Tensor>("worker0", "scale_twice", x);
    tandem::autograd::backward(ctx.id(), {at::add(at::sum(w), at::sum(x))});
    chained = tandem::autograd::get_gradients(ctx.id()).at(x)[0].item<double>();
  }
  double held = 0;
  {
    tandem::autograd::Context ctx;
    at::Tensor x = at::ones({4}).requires_grad_();
    auto r = tandem::rpc::remote<at::Tensor>("worker0", "scale", x, 3.0);
    at::Tensor w =
        tandem::rpc::rpc_sync<at::Tensor>("worker0", "scale_held", std::make_tuple(2.0, r));
    tandem::autograd::backward(ctx.id(), {at::sum(w)});
    held = tandem::autograd::get_gradients(ctx.id()).at(x)[0].item<double>();
  }
  double stepped = 0;
  {
    at::Tensor weight = at::ones({4}).requires_grad_();
    auto p = tandem::rpc::RRef<at::Tensor>::make_local(*tandem::rpc::current_agent(), weight);
    tandem::optim::Options oo;
    oo.lr = 0.5;
    tandem::optim::DistributedOptimizer opt(tandem::optim::Kind::kSGD, {p}, oo);
    tandem::autograd::Context ctx;
    at::Tensor y = tandem::rpc::rpc_sync<at::Tensor>("worker0", "scale", weight, 3.0);
    tandem::autograd::backward(ctx.id(), {at::sum(y)});
    opt.step(ctx.id());
    stepped = weight[0].item<double>();  // 1 - 0.5 * 3
  }
  double module_weight = 0;
  {
    tandem::nn::RemoteModule fc("worker0/cpu", "Linear", {2, 1});
    fc.load_state_dict({{"weight", at::ones({1, 2})}, {"bias", at::zeros({1})}});
    tandem::optim::Options oo;
    oo.lr = 0.5;
    tandem::optim::DistributedOptimizer opt(tandem::optim::Kind::kSGD, fc.remote_parameters(), oo);
    tandem::autograd::Context ctx;
    at::Tensor y = fc.forward(at::ones({1, 2}));
    tandem::autograd::backward(ctx.id(), {at::sum(y)});
    opt.step(ctx.id());
    module_weight = fc.state_dict().at("weight")[0][0].item<double>();  // 1 - 0.5 * 1
  }
  double ddp_weight = 0, hybrid_head = -1, hybrid_first = -1;
  size_t share = 0;
  bool hybrid_grad_untouched = false;
  {
    tandem::ddp::init_process_group("gloo", "tcp://127.0.0.1:0", 1, 0);
    torch::nn::Linear fc(2, 1);
    fc->weight.data().fill_(1);
    tandem::ddp::DistributedDataParallel net(fc);
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.5));
    at::sum(net(at::ones({1, 2}))).backward();
    opt.step();
    ddp_weight = fc->weight[0][0].item<double>();                  // 1 - 0.5 * 1
    share = tandem::ddp::DistributedSampler(10).indices().size();  // the default group's 1 rank
    {
      tandem::nn::RemoteModule first("worker0/cpu", "Linear", {2, 2});
      first.load_state_dict({{"weight", at::ones({2, 2})}, {"bias", at::zeros({2})}});
      torch::nn::Linear head(2, 1);
      head->weight.data().fill_(1);
      head->bias.data().fill_(0);
      tandem::ddp::DistributedDataParallel dense(head);
      auto params = first.remote_parameters();
      for (auto& p : dense.parameters()) params.emplace_back(p);
      tandem::optim::Options oo;
      oo.lr = 0.5;
      tandem::optim::DistributedOptimizer opt(tandem::optim::Kind::kSGD, params, oo);
      tandem::autograd::Context ctx;
      at::Tensor h = first.forward(at::ones({1, 2}));  // [2, 2]
      tandem::autograd::backward(ctx.id(), {at::sum(dense(h))});
      opt.step(ctx.id());
      hybrid_head = head->weight[0][0].item<double>();                      // 1 - 0.5 * 2
      hybrid_first = first.state_dict().at("weight")[0][0].item<double>();  // 1 - 0.5 * 1
      hybrid_grad_untouched = !head->weight.grad().defined();               // the context held it
    }
    tandem::ddp::destroy_process_group();
  }
  double pipe_loss = -1, pipe_weight = 0;
  {
    tandem::nn::RemoteModule fc("worker0/cpu", "Linear", {2, 1});
    fc.load_state_dict({{"weight", at::ones({1, 2})}, {"bias", at::zeros({1})}});
    tandem::pipeline::PipeOptions po;
    po.chunks = 2;
    po.loss = "mse";
    po.schedule = "zero-bubble";  // each backward as an input pass, then a weight pass
    tandem::pipeline::Pipe pipe({fc}, po);
    tandem::optim::Options oo;
    oo.lr = 0.5;
    tandem::optim::DistributedOptimizer opt(tandem::optim::Kind::kSGD, pipe.parameters(), oo);
    tandem::autograd::Context ctx;
    pipe_loss = pipe.step(ctx.id(), at::ones({2, 2}), at::zeros({2, 1}));  // (2 - 0)^2
    opt.step(ctx.id());
    pipe_weight = fc.state_dict().at("weight")[0][0].item<double>();  // 1 - 0.5 * 2 * 2
  }
  tandem::rpc::shutdown();
  std::printf("a one-stage pipe's loss %.2f, its weight after one SGD step %.2f\n", pipe_loss,
              pipe_weight);
  // 2 workers, 4 micro-batches: (4 + 2 - 1) slots of forward 1 + backward 2.
  const double makespan =
      tandem::pipeline::simulate(tandem::pipeline::OneFOneB().plan(2, 4)).makespan;
  std::printf("a 1F1B schedule of 4 micro-batches on 2 workers takes %.0f units\n", makespan);
  std::printf(
      "DDP's weight after one step %.2f, the sampler's share %zu; after a hybrid step the "
      "DDP layer's weight %.2f, the RemoteModule's %.2f, .grad %s\n",
      ddp_weight, share, hybrid_head, hybrid_first, hybrid_grad_untouched ? "untouched" : "SET");
  std::printf("after one SGD step the parameter is %.2f, the RemoteModule's weight %.2f\n", stepped,
              module_weight);
  std::printf(
      "twice(21) = %lld, d(sum(3x))/dx = %.1f, d(sum(6x) + sum(x))/dx = %.1f, "
      "through a held RRef in a tuple d(sum(2*3x))/dx = %.1f, %s\n",
      static_cast<long long>(y), g, chained, held,
      named ? "a missing gradient is named" : "a missing gradient is NOT named");
  return y == 42 && g == 3.0 && chained == 7.0 && held == 6.0 && stepped == -0.5 &&
                 module_weight == 0.5 && named && ddp_weight == 0.5 && share == 10 &&
                 hybrid_head == 0.0 && hybrid_first == 0.5 && hybrid_grad_untouched &&
                 makespan == 15.0 && pipe_loss == 4.0 && pipe_weight == -1.0
             ? 0
             : 1;
}
