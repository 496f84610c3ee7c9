// Pipeline x data parallelism over a mesh (pp=2, dp=2): each replica's
// pipe, driven by its first stage's rank on its own half of every batch,
// averages each stage's gradients over that stage's replicas, and every
// replica ends with the parameters of the unsplit model trained in one
// process on the concatenated batch: under every schedule, with uneven
// micro-batches, small buckets, accumulation under no_sync and global
// clipping. Ranks are threads of this process, each with its own agent.
#include "tandem/mesh/mesh.h"
#include "tandem/pipeline/pipe.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>

#include "ddp/ddp_support.h"
#include "pipeline/stages_support.h"
#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/remote_module/remote_module.h"
#include "test_util.h"

using namespace tandem;
using namespace std::chrono_literals;
using nn::RemoteModule;
using nn::spec;
using test::on_ranks;
using test::World;
namespace dist = tandem::autograd;

namespace {

using test::dims;
using test::kClasses;
using test::kIn;
using test::Weights;
constexpr int kReplicas = 2;
constexpr int64_t kRows = 7;  // per replica and step: uneven micro-batches

struct Batch {
  at::Tensor x, y;
};
// Batch k of the whole job: replica d's share is rows [d * kRows, (d + 1) * kRows).
Batch global_batch(int k) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(300 + k));
  return {at::randn({kReplicas * kRows, kIn}, gen),
          at::randint(0, kClasses, {kReplicas * kRows}, gen, at::kLong)};
}

struct Config {
  std::string schedule = "1f1b";
  int stages = 2;
  int chunks = 3;
  int accumulate = 1;  // batches per optimizer step
  double clip = 0;     // global gradient norm; 0: none
  double bucket_mb = 25;
  int steps = 3;
  double lr = 0.2;
  double momentum = 0;
  bool shard_state = false;  // ZeRO stage 1: each stage's state over its replicas
};

// The unsplit model in one process: per step the gradients of each of its
// global batches' mean losses, summed, clipped, one SGD step.
Weights local_training(const Weights& init, const Config& c) {
  std::vector<at::Tensor> params;
  Weights w;
  for (int s = 0; s < c.stages; ++s) {
    w.w.push_back(init.w[s].clone().requires_grad_());
    w.b.push_back(init.b[s].clone().requires_grad_());
    params.push_back(w.w[s]);
    params.push_back(w.b[s]);
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(c.lr).momentum(c.momentum));
  for (int step = 0; step < c.steps; ++step) {
    opt.zero_grad();
    for (int a = 0; a < c.accumulate; ++a) {
      Batch b = global_batch(step * c.accumulate + a);
      at::Tensor h = b.x;
      for (int s = 0; s < c.stages; ++s) {
        h = at::addmm(w.b[s], h, w.w[s].t());
        if (s + 1 < c.stages) h = at::tanh(h);
      }
      at::cross_entropy_loss(h, b.y).backward();
    }
    if (c.clip > 0) torch::nn::utils::clip_grad_norm_(params, c.clip);
    opt.step();
  }
  return w;
}

struct Replica {
  Weights weights;
  optim::OptimizerState state;  // after training (shard_state: collective)
  pipeline::StepStats last;
  std::vector<size_t> averaged;  // per pipe step: how many stage averages it ran
};

// The same on four ranks: replica d's driver is rank d (pp = 0, dp = d);
// stage s lives on the rank at pp = s % 2 of the same replica.
std::vector<Replica> pp_dp_training(const Weights& init, const Config& c) {
  World w(4);
  std::vector<Replica> out(kReplicas);
  {
    std::vector<std::unique_ptr<Mesh>> mesh(4);
    on_ranks(4, [&](int r) {
      MeshOptions o;
      o.agent = w.agents[r];
      o.store = support::store_client(w.port);
      o.timeout = 20s;
      mesh[r] = std::make_unique<Mesh>(Mesh::Shape{{"pp", 2}, {"dp", 2}}, o);
    });
    on_ranks(kReplicas, [&](int d) {
      Mesh& m = *mesh[d];
      REQUIRE(m.coordinate("pp") == 0);
      REQUIRE(m.coordinate("dp") == d);
      rpc::Agent& driver = *w.agents[d];
      auto dd = dims(c.stages);
      std::vector<RemoteModule> stages;
      for (int s = 0; s < c.stages; ++s) {
        c10::IValue layers = s + 1 < c.stages
                                 ? nn::list({spec("Linear", {dd[s], dd[s + 1]}), spec("Tanh")})
                                 : nn::list({spec("Linear", {dd[s], dd[s + 1]})});
        stages.emplace_back(driver, m.worker_at({{"pp", s % 2}}) + "/cpu", "Sequential",
                            std::vector<c10::IValue>{layers});
        stages.back().load_state_dict({{"0.weight", init.w[s]}, {"0.bias", init.b[s]}});
      }
      pipeline::PipeOptions o;
      o.chunks = c.chunks;
      o.schedule = c.schedule;
      o.data_parallel_group = m.group_name("dp");
      o.bucket_cap_mb = c.bucket_mb;
      pipeline::Pipe pipe(driver, stages, o);
      optim::Options so;
      so.lr = c.lr;
      so.momentum = c.momentum;
      optim::DistributedOptions sharding;
      if (c.shard_state) sharding.shard_group = m.group_name("dp");
      optim::DistributedOptimizer opt(driver, optim::Kind::kSGD, pipe.parameters(), so, sharding);
      for (int step = 0; step < c.steps; ++step) {
        dist::Context ctx(driver);
        for (int a = 0; a < c.accumulate; ++a) {
          Batch g = global_batch(step * c.accumulate + a);
          at::Tensor x = g.x.narrow(0, d * kRows, kRows);
          at::Tensor y = g.y.narrow(0, d * kRows, kRows);
          if (a + 1 < c.accumulate) {
            auto accumulating = pipe.no_sync();
            pipe.step(ctx.id(), x, y);
          } else {
            pipe.step(ctx.id(), x, y);
          }
          out[d].averaged.push_back(pipe.last_step().allreduces.size());
        }
        if (c.clip > 0) opt.clip_grad_norm(ctx.id(), c.clip);
        opt.step(ctx.id());
      }
      out[d].last = pipe.last_step();
      if (c.shard_state) {
        out[d].state = opt.state_dict();  // every replica at once
        m.group("dp")->barrier();         // the drivers: both states are in
        // Replica 0's (whole) state loads back on every replica, each owner
        // taking its share; its owners' ranks become this replica's.
        optim::OptimizerState whole = out[0].state;
        for (auto& part : whole.parts) {
          const int stage_worker = part.rank / 2;  // replica 0's ranks: pp * 2
          part.rank = m.rank_at({{"pp", stage_worker}});
          part.worker = m.worker_at({{"pp", stage_worker}});
        }
        opt.load_state_dict(whole);
      }
      for (auto& s : stages) {
        auto state = s.state_dict();
        out[d].weights.w.push_back(state.at("0.weight"));
        out[d].weights.b.push_back(state.at("0.bias"));
      }
    });
    on_ranks(4, [&](int r) { mesh[r].reset(); });
  }
  w.shutdown();
  return out;
}

void expect_trained_as_one_process(const Config& c) {
  CAPTURE(c.schedule);
  CAPTURE(c.chunks);
  CAPTURE(c.accumulate);
  CAPTURE(c.clip);
  const Weights init = test::initial(c.stages, 7);
  const Weights want = local_training(init, c);
  const std::vector<Replica> got = pp_dp_training(init, c);
  for (int d = 0; d < kReplicas; ++d) {
    CAPTURE(d);
    REQUIRE(got[d].weights.w.size() == static_cast<size_t>(c.stages));
    for (int s = 0; s < c.stages; ++s) {
      CAPTURE(s);
      CHECK(at::allclose(got[d].weights.w[s], want.w[s].detach(), 1e-5, 1e-6));
      CHECK(at::allclose(got[d].weights.b[s], want.b[s].detach(), 1e-5, 1e-6));
    }
    // Every stage averaged once a synced step, never under no_sync.
    for (size_t k = 0; k < got[d].averaged.size(); ++k) {
      const bool synced = (k + 1) % static_cast<size_t>(c.accumulate) == 0;
      CHECK(got[d].averaged[k] == (synced ? static_cast<size_t>(c.stages) : 0u));
    }
    const auto& last = got[d].last;
    CHECK(last.allreduce_hidden >= 0);
    CHECK(last.allreduce_hidden <= 1);
    for (const auto& a : last.allreduces) CHECK(a.done_us >= a.launch_us);
  }
}

}  // namespace

TEST_CASE("pp x dp: 2 x 2 trains as one process on the concatenated batch, every schedule") {
  for (const char* schedule : {"gpipe", "1f1b", "zero-bubble"}) {
    Config c;
    c.schedule = schedule;
    expect_trained_as_one_process(c);
  }
  Config interleaved;  // two stages a worker: four stages on each replica's two ranks
  interleaved.schedule = "interleaved";
  interleaved.stages = 4;
  interleaved.chunks = 2;
  expect_trained_as_one_process(interleaved);
}

TEST_CASE("pp x dp: many small buckets, accumulation under no_sync, global clipping") {
  Config small;
  small.schedule = "zero-bubble";
  small.bucket_mb = 100.0 / (1 << 20);  // 100 bytes: several buckets a stage
  expect_trained_as_one_process(small);
  Config acc;
  acc.accumulate = 2;
  acc.clip = 0.5;  // below the gradients' norm: the clip bites
  expect_trained_as_one_process(acc);
}

TEST_CASE("pp x dp: each stage's optimizer state sharded over its replicas trains as one process") {
  // ZeRO stage 1 inside the pipeline: SGD with momentum, whose buffers each
  // replica's stage worker keeps for its share only.
  Config c;
  c.momentum = 0.9;
  c.shard_state = true;
  expect_trained_as_one_process(c);
  const Weights init = test::initial(c.stages, 7);
  const std::vector<Replica> got = pp_dp_training(init, c);
  // The whole state on replica 0 (its owners are their groups' rank 0),
  // none on replica 1, in the unsharded format: one archive per owner.
  REQUIRE(got[0].state.parts.size() == 2);
  REQUIRE(got[1].state.parts.size() == 2);
  for (int s = 0; s < 2; ++s) {
    CHECK_FALSE(got[0].state.parts[s].bytes.empty());
    CHECK(got[1].state.parts[s].bytes.empty());
  }
}

TEST_CASE("pp x dp: a stage worker without the named group fails the step, naming it") {
  World w(2);
  {
    std::vector<RemoteModule> stages;
    stages.emplace_back(*w.agents[0], "worker0/cpu", "Linear", std::vector<c10::IValue>{4, 4});
    stages.emplace_back(*w.agents[0], "worker1/cpu", "Linear", std::vector<c10::IValue>{4, 4});
    pipeline::PipeOptions o;
    o.chunks = 2;
    o.loss = "mse";
    o.data_parallel_group = "no-such-group";
    pipeline::Pipe pipe(*w.agents[0], stages, o);
    dist::Context ctx(*w.agents[0]);
    const std::string error = test::error_of([&] {
      pipe.step(ctx.id(), at::ones({4, 4}), at::zeros({4, 4}));
    });
    CHECK(error.find("has no process group 'no-such-group'") != std::string::npos);
    CHECK(error.find("worker0") != std::string::npos);
    // Forwards only average nothing, so they need no group.
    CHECK(pipe.forward(at::ones({4, 4})).sizes() == at::IntArrayRef{4, 4});
    // Nor do steps under no_sync.
    {
      auto accumulating = pipe.no_sync();
      CHECK_FALSE(pipe.sync());
      pipe.step(ctx.id(), at::ones({4, 4}), at::zeros({4, 4}));
      CHECK(pipe.last_step().allreduces.empty());
    }
    CHECK(pipe.sync());
    o.bucket_cap_mb = 0;
    CHECK(test::error_of([&] { pipeline::Pipe(*w.agents[0], stages, o); }) ==
          "Pipe: bucket_cap_mb must be in (0, 1048576], got 0.000000");
  }
  w.shutdown();
}
