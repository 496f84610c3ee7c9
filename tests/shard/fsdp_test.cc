// FullyShardedDataParallel (ZeRO stage 3) against single-process LibTorch:
// ranks are threads of this process, each its own part of the batch; the
// reference trains one model on the concatenated batch.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/relu.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <mutex>

#include "ddp/ddp_support.h"
#include "shard/shard_support.h"
#include "tandem/ddp/fully_sharded.h"

using namespace tandem;
using test::error_of;
using test::Groups;
using test::on_ranks;
using namespace test::shard;

namespace {

// A Sequential of uneven layers: 6 -> 13 -> 7 -> 3.
torch::nn::Sequential make_seq(uint64_t seed) {
  std::lock_guard<std::mutex> lock(seed_mutex());
  at::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 13), torch::nn::ReLU(),
                               torch::nn::Linear(13, 7), torch::nn::ReLU(),
                               torch::nn::Linear(7, 3));
}

// This file's batches (tests/shard/shard_support.h).
Batch batch(int r, int k) { return batch_of(900, r, k); }
Batch concat(int n, int k) { return concat_of(900, n, k); }

at::Tensor loss_on(const at::Tensor& out, const Batch& b) {
  return torch::nn::functional::cross_entropy(out, b.y);
}

constexpr int kSteps = 3, kMicro = 2;
constexpr double kClip = 0.5;

// The reference: two micro-batches a step (no zero_grad between), clipping, Adam.
template <class M>
void train_local(M& model, int n, int steps) {
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
  for (int s = 0; s < steps; ++s) {
    for (int k = 0; k < kMicro; ++k) {
      auto b = concat(n, s * kMicro + k);
      loss_on(model->forward(b.x), b).backward();
    }
    torch::nn::utils::clip_grad_norm_(model->parameters(), kClip);
    opt.step();
    opt.zero_grad();
  }
}

// The same on rank r: `forward` runs the sharded model on a batch.
void train_rank(ddp::FullyShardedDataParallel& fsdp,
                const std::function<at::Tensor(const at::Tensor&)>& forward, int r, int steps) {
  torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(0.01));
  for (int s = 0; s < steps; ++s) {
    for (int k = 0; k < kMicro; ++k) {
      auto b = batch(r, s * kMicro + k);
      loss_on(forward(b.x), b).backward();
    }
    fsdp.clip_grad_norm(kClip);
    opt.step();
    opt.zero_grad();
  }
}

void check_state(const std::vector<std::pair<std::string, at::Tensor>>& got,
                 torch::nn::Module& want) {
  auto named = want.named_parameters();
  size_t found = 0;
  for (const auto& [name, t] : got) {
    if (!named.contains(name)) continue;  // buffers
    ++found;
    INFO(name);
    CHECK(at::allclose(t, named[name], 1e-5, 1e-6));
  }
  CHECK(found == named.size());
}

}  // namespace

TEST_CASE("fsdp: a Sequential trains as one process does (2 and 3 ranks; units and the root)") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    auto ref = make_seq(3);
    train_local(ref, n, kSteps);
    Groups g(n);
    std::vector<std::pair<std::string, at::Tensor>> state;
    on_ranks(n, [&](int r) {
      ddp::FSDPOptions o;
      o.units = {"0", "2"};  // the last Linear stays in the root
      ddp::FullyShardedDataParallel fsdp(make_seq(3), o, g.groups[r]);
      // Outside a step the units' parameters hold nothing.
      for (const auto& p : fsdp.module()->parameters()) CHECK(p.numel() == 0);
      train_rank(
          fsdp, [&](const at::Tensor& x) { return fsdp.forward(x); }, r, kSteps);
      for (const auto& p : fsdp.module()->parameters()) CHECK(p.numel() == 0);
      auto st = fsdp.stats();
      CHECK(st.units == std::vector<std::string>{"", "0", "2"});
      CHECK(st.reduce_scatters == 3);
      // Unit "2": 7 * 13 + 7 = 98 elements, padded to a multiple of n.
      CHECK(st.largest_unit_bytes == (98 + n - 1) / n * n * 4);
      auto s = fsdp.full_state_dict(n - 1);
      if (r == n - 1) state = s;
      CHECK(s.empty() == (r != n - 1));
    });
    check_state(state, *ref);
  }
}

TEST_CASE("fsdp: made without a group, then moved from group to group, trains as one process") {
  // As under tandem::ft: the layout first, each quorum's group later.
  constexpr int n = 2;
  auto ref = make_seq(3);
  train_local(ref, n, kSteps);
  Groups first(n), second(n), lone(1);
  std::vector<std::pair<std::string, at::Tensor>> state;
  on_ranks(n, [&](int r) {
    ddp::FSDPOptions o;
    o.units = {"0", "2"};
    ddp::FullyShardedDataParallel fsdp(make_seq(3), o, r, n);  // the same seed on each rank
    auto b = batch(r, 0);
    CHECK(error_of([&] { fsdp.forward(b.x); }).find("no group yet") != std::string::npos);
    torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(0.01));
    for (int s = 0; s < kSteps; ++s) {
      fsdp.set_group(s == 0 ? first.groups[r] : second.groups[r]);
      for (int k = 0; k < kMicro; ++k) {
        auto mb = batch(r, s * kMicro + k);
        loss_on(fsdp.forward(mb.x), mb).backward();
      }
      fsdp.clip_grad_norm(kClip);
      opt.step();
      opt.zero_grad();
    }
    // Another size: the shards' layout would not fit.
    if (r == 0) {
      CHECK(error_of([&] { fsdp.set_group(lone.groups[0]); }).find("rank 0 of 1") !=
            std::string::npos);
    }
    CHECK_THROWS_AS(fsdp.set_group(nullptr), std::invalid_argument);
    auto st = fsdp.full_state_dict(0);
    if (r == 0) state = st;
  });
  check_state(state, *ref);
  CHECK_THROWS_AS(ddp::FullyShardedDataParallel(make_seq(3), {}, 2, 2), std::invalid_argument);
}

TEST_CASE("fsdp: clipping a model also split over a tensor-parallel group (ClipOptions)") {
  // Two ranks shard the same Sequential over `dp` and stand, for clipping,
  // as two tensor-parallel ranks too (`tp`): the squares are summed over
  // dp, then over tp (so each counted gradient twice), and the parameters
  // `counted` turns down (the last layer's bias) are left out of the norm
  // but scaled with the rest.
  Groups dp(2), tp(2);
  auto whole = make_seq(31);
  auto b = concat(2, 0);
  loss_on(whole->forward(b.x), b).backward();
  const auto last = whole->named_parameters()["4.bias"];
  double squares = 0;
  for (const auto& p : whole->parameters()) {
    if (!p.is_same(last)) squares += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  const double want = std::sqrt(2 * squares);
  on_ranks(2, [&](int r) {
    auto model = make_seq(31);
    const at::Tensor skip = model->named_parameters()["4.bias"];
    ddp::FullyShardedDataParallel fsdp(model, {}, dp.groups[r]);
    auto mine = batch(r, 0);
    loss_on(fsdp.forward(mine.x), mine).backward();
    std::vector<at::Tensor> before;
    for (const auto& shard : fsdp.parameters()) before.push_back(shard.grad().clone());
    ddp::ClipOptions o;
    o.group = tp.groups[r];
    o.counted = [skip](const at::Tensor& p) { return !p.is_same(skip); };
    const double norm = fsdp.clip_grad_norm(0.1, o);
    CHECK(norm == doctest::Approx(want).epsilon(1e-5));
    // (every gradient scaled by 0.1 / norm: the bias's too)
    for (size_t k = 0; k < before.size(); ++k) {
      CHECK(at::allclose(fsdp.parameters()[k].grad(), before[k] * (0.1 / (norm + 1e-6))));
    }
  });
}

TEST_CASE("fsdp: mixed precision trains close to float32 (bfloat16 on Gloo)") {
  // Gathered, computed and reduced in bfloat16 (8 significant bits),
  // stepped in float32 by SGD (whose step is proportional to the gradient,
  // so the difference says how close the gradients were): within 5e-3 of
  // the float32 reference after three steps. float16 needs a GPU: LibTorch
  // 1.x's CPU has no float16 matmul.
  const int n = 2;
  auto ref = make_seq(6);
  {
    torch::optim::SGD opt(ref->parameters(), 0.1);
    for (int s = 0; s < kSteps; ++s) {
      auto b = concat(n, s);
      loss_on(ref->forward(b.x), b).backward();
      opt.step();
      opt.zero_grad();
    }
  }
  Groups g(n);
  std::vector<std::pair<std::string, at::Tensor>> state;
  on_ranks(n, [&](int r) {
    ddp::FSDPOptions o;
    o.param_dtype = at::kBFloat16;
    ddp::FullyShardedDataParallel fsdp(make_seq(6), o, g.groups[r]);
    CHECK(fsdp.parameters()[0].dtype() == at::kFloat);  // the masters
    torch::optim::SGD opt(fsdp.parameters(), 0.1);
    for (int s = 0; s < kSteps; ++s) {
      auto b = batch(r, s);
      at::Tensor out = fsdp.forward(b.x);
      CHECK(out.dtype() == at::kBFloat16);
      loss_on(out.to(at::kFloat), b).backward();
      opt.step();
      opt.zero_grad();
    }
    auto st = fsdp.full_state_dict(0);
    if (r == 0) state = st;
  });
  auto named = ref->named_parameters();
  double worst = 0;
  for (const auto& [name, t] : state) {
    REQUIRE(t.dtype() == at::kFloat);
    worst = std::max(worst, (t - named[name]).abs().max().item<double>());
  }
  CAPTURE(worst);
  CHECK(worst < 5e-3);
  CHECK(worst > 0);  // it did compute in 16 bits
}

TEST_CASE("fsdp: HSDP, sharded over pairs and replicated across them, trains as one process") {
  // Ranks 0..3: shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}.
  const int n = 4;
  auto ref = make_seq(8);
  train_local(ref, n, kSteps);
  test::HsdpGroups groups;
  std::vector<std::pair<std::string, at::Tensor>> state;
  on_ranks(n, [&](int r) {
    ddp::FSDPOptions o;
    o.replicate_group = groups.replicate[r];
    // Rank 2 and 3 start from other values: the replicas take replica 0's.
    ddp::FullyShardedDataParallel fsdp(make_seq(r < 2 ? 8 : 80), o, groups.shard[r]);
    train_rank(
        fsdp, [&](const at::Tensor& x) { return fsdp.forward(x); }, r, kSteps);
    auto s = fsdp.full_state_dict(0);
    if (r == 2) state = s;  // the second replica's
  });
  check_state(state, *ref);
}

TEST_CASE("fsdp: any model through run(), with an unused layer and no reshard after forward") {
  for (int n : {2, 3})
    for (bool reshard : {true, false}) {
      CAPTURE(n);
      CAPTURE(reshard);
      Net ref = make_net(4);
      train_local(ref, n, kSteps);
      Groups g(n);
      std::vector<std::pair<std::string, at::Tensor>> state;
      on_ranks(n, [&](int r) {
        Net net = make_net(4);
        ddp::FSDPOptions o;
        o.units = {"fc1", "fc2"};
        o.reshard_after_forward = reshard;
        ddp::FullyShardedDataParallel fsdp(net.ptr(), o, g.groups[r]);
        auto forward = [&](const at::Tensor& x) {
          return fsdp.forward([&] {
            at::Tensor h = fsdp.run("fc1", [&] { return at::relu(net->fc1(x)); });
            h = fsdp.run("fc2", [&] { return at::relu(net->fc2(h)); });
            return net->fc3(h);
          });
        };
        train_rank(fsdp, forward, r, kSteps);
        auto s = fsdp.full_state_dict(0);
        if (r == 0) state = s;
        CHECK(error_of([&] {
                fsdp.run("fc1", [&] { return at::Tensor(); });
              }).find("outside forward()") != std::string::npos);
        CHECK(error_of([&] {
                fsdp.run("fc9", [&] { return at::Tensor(); });
              }).find("no such unit") != std::string::npos);
        CHECK(error_of([&] {
                fsdp.forward(at::ones({1, 6}));
              }).find("runs a Sequential model") != std::string::npos);
      });
      check_state(state, *ref);
    }
}

TEST_CASE("fsdp: full and sharded state dicts reload, into another rank count too") {
  auto ref = make_seq(5);
  train_local(ref, 2, 2);
  std::vector<std::pair<std::string, at::Tensor>> full;
  std::vector<std::vector<ddp::UnitShard>> shards(2);
  {
    Groups g(2);
    on_ranks(2, [&](int r) {
      ddp::FullyShardedDataParallel fsdp(make_seq(5), {}, g.groups[r]);
      train_rank(
          fsdp, [&](const at::Tensor& x) { return fsdp.forward(x); }, r, 2);
      auto s = fsdp.full_state_dict(0);
      if (r == 0) full = s;
      shards[r] = fsdp.sharded_state_dict();
    });
  }
  check_state(full, *ref);
  // Loaded on 3 ranks (another model's values first), the state is the same.
  Groups g3(3);
  on_ranks(3, [&](int r) {
    ddp::FullyShardedDataParallel fsdp(make_seq(99), {}, g3.groups[r]);
    fsdp.load_full_state_dict(full);
    auto back = fsdp.full_state_dict(0);
    if (r == 0) check_state(back, *ref);
    if (r < 2) {
      CHECK(error_of([&] { fsdp.load_sharded_state_dict(shards[r]); })
                .find("saved by rank " + std::to_string(r) + " of 2, this is rank " +
                      std::to_string(r) + " of 3") != std::string::npos);
    }
    auto missing = full;
    missing.erase(missing.begin());
    CHECK(error_of([&] { fsdp.load_full_state_dict(missing); }).find("no '0.weight'") !=
          std::string::npos);
  });
  Groups g2(2);
  on_ranks(2, [&](int r) {
    ddp::FullyShardedDataParallel fsdp(make_seq(99), {}, g2.groups[r]);
    fsdp.load_sharded_state_dict(shards[r]);
    auto back = fsdp.full_state_dict(1);
    if (r == 1) check_state(back, *ref);
    CHECK(error_of([&] { fsdp.load_sharded_state_dict(shards[1 - r]); }).find("saved by rank") !=
          std::string::npos);
  });
}

TEST_CASE("fsdp: bad units and ranks whose models differ fail on every rank, naming them") {
  Groups g(2);
  on_ranks(2, [&](int r) {
    auto make = [&](std::vector<std::string> units) {
      ddp::FSDPOptions o;
      o.units = std::move(units);
      return error_of([&] { ddp::FullyShardedDataParallel f(make_net(1).ptr(), o, g.groups[r]); });
    };
    CHECK(make({"fc9"}).find("unit 'fc9' is not a submodule of the model") != std::string::npos);
    CHECK(make({"fc1", "fc1"}).find("units 'fc1' and 'fc1' overlap (the same unit twice)") !=
          std::string::npos);
    // A module holding another: the Sequential inside a Sequential.
    auto outer = std::make_shared<torch::nn::Module>();
    outer->register_module("0", make_seq(1));
    ddp::FSDPOptions o;
    o.units = {"0", "0.2"};
    CHECK(error_of([&] {
            ddp::FullyShardedDataParallel f(outer, o, g.groups[r]);
          }).find("units '0' and '0.2' overlap (one holds the other)") != std::string::npos);
    // A parameter two units share.
    Net tied = make_net(1);
    tied->fc2->register_parameter("tied", tied->fc1->weight);
    o.units = {"fc1", "fc2"};
    CHECK(error_of([&] {
            ddp::FullyShardedDataParallel f(tied.ptr(), o, g.groups[r]);
          }).find("put both in one unit") != std::string::npos);
    // A frozen parameter.
    Net frozen = make_net(1);
    frozen->fc2->bias.requires_grad_(false);
    o.units = {"fc1"};
    CHECK(error_of([&] {
            ddp::FullyShardedDataParallel f(frozen.ptr(), o, g.groups[r]);
          }).find("parameter 'fc2.bias' does not require grad") != std::string::npos);
    // Only rank 1 names a unit the model lacks: both fail, and neither hangs.
    o.units = {r == 1 ? "fc9" : "fc1"};
    const std::string one_sided =
        error_of([&] { ddp::FullyShardedDataParallel f(make_net(1).ptr(), o, g.groups[r]); });
    CAPTURE(one_sided);
    CHECK(one_sided.find(r == 1 ? "unit 'fc9' is not a submodule" : "rank 1 has an error: ") !=
          std::string::npos);
    // Rank 1's model is another.
    std::shared_ptr<torch::nn::Module> model =
        r == 0 ? make_net(1).ptr() : std::shared_ptr<torch::nn::Module>(make_seq(1).ptr());
    o.units = {};
    CHECK(error_of([&] { ddp::FullyShardedDataParallel f(model, o, g.groups[r]); })
              .find("FullyShardedDataParallel: the ranks' models differ at entry #0: rank 0 has "
                    "unit 'fc1', rank 1 has unit '0'") != std::string::npos);
  });
}
