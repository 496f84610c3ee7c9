// ZeroRedundancyOptimizer (ZeRO stage 1) against single-process LibTorch:
// ranks are threads of this process, each with its replica under DDP and
// its own part of the batch; the reference trains one model on the
// concatenated batch with LibTorch's own optimizer.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/relu.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>

#include <mutex>

#include "ddp/ddp_support.h"
#include "shard/shard_support.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/optim/zero_redundancy_optimizer.h"

using namespace tandem;
using test::error_of;
using test::Groups;
using test::on_ranks;
using namespace test::shard;

namespace {

// This file's batches (tests/shard/shard_support.h).
Batch batch(int r, int k) { return batch_of(500, r, k); }
Batch concat(int n, int k) { return concat_of(500, n, k); }

// A Net or its DDP wrapper.
template <class M>
at::Tensor loss_of(M& net, const Batch& b) {
  return torch::nn::functional::cross_entropy(net(b.x), b.y);
}

std::unique_ptr<torch::optim::Optimizer> local_optimizer(optim::Kind kind,
                                                         std::vector<at::Tensor> params) {
  if (kind == optim::Kind::kAdam) {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
}

optim::Options options_of(optim::Kind kind) {
  optim::Options o;
  o.lr = kind == optim::Kind::kAdam ? 0.01 : 0.1;
  if (kind == optim::Kind::kSGD) o.momentum = 0.9;
  return o;
}

constexpr int kSteps = 3, kMicro = 2;
constexpr double kClip = 0.5;

// The reference: one process, the concatenated batch, two micro-batches a
// step, clipping, LibTorch's optimizer.
void train_local(Net& net, torch::optim::Optimizer& opt, int n, int first_step, int steps) {
  for (int s = first_step; s < first_step + steps; ++s) {
    for (int k = 0; k < kMicro; ++k) loss_of(net, concat(n, s * kMicro + k)).backward();
    torch::nn::utils::clip_grad_norm_(net->parameters(), kClip);
    opt.step();
    opt.zero_grad();
  }
}

// The same on rank r: DDP, accumulation under no_sync, ZeRO's clipping and
// step. With sharded gradients, only the parameters r owns have one.
void train_ranks(ddp::DistributedDataParallel<NetImpl>& net, optim::ZeroRedundancyOptimizer& opt,
                 int r, int first_step, int steps, bool sharded = false) {
  for (int s = first_step; s < first_step + steps; ++s) {
    {
      auto guard = net.no_sync();
      loss_of(net, batch(r, s * kMicro)).backward();
    }
    loss_of(net, batch(r, s * kMicro + 1)).backward();
    for (size_t i = 0; i < opt.params().size() && sharded; ++i) {
      INFO("parameter #" << i << " of rank " << r);
      const bool used = i < 6;  // the unused layer's two come last
      CHECK(opt.params()[i].grad().defined() == (used && opt.owners()[i] == r));
    }
    opt.clip_grad_norm(kClip);
    opt.step();
    opt.zero_grad();
  }
}

void check_same(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("parameter #" << i);
    CHECK(at::allclose(got[i], want[i], 1e-5, 1e-6));
  }
}

// ZeRO stage 2 on one rank: SGD at lr 0.05 over `net`'s parameters, under
// DDP with unused parameters allowed and the gradients sharded by owner.
struct Stage2 {
  Stage2(Net& net, const std::shared_ptr<ddp::ProcessGroup>& group)
      : opt(net->parameters(), optim::Kind::kSGD, sgd_at(0.05), zero_over(group)),
        dnet(net, sharded(opt), group) {}
  static optim::Options sgd_at(double lr) {
    optim::Options o;
    o.lr = lr;
    return o;
  }
  static optim::ZeroOptions zero_over(const std::shared_ptr<ddp::ProcessGroup>& group) {
    optim::ZeroOptions z;
    z.group = group;
    return z;
  }
  static ddp::DDPOptions sharded(const optim::ZeroRedundancyOptimizer& opt) {
    ddp::DDPOptions d;
    d.find_unused_parameters = true;
    d.gradient_owner = opt.gradient_owner();
    return d;
  }
  optim::ZeroRedundancyOptimizer opt;
  ddp::DistributedDataParallel<NetImpl> dnet;
};

}  // namespace

TEST_CASE("zero: the partition is PyTorch's, greedy by size, largest first") {
  CHECK(optim::zero_partition({10, 30, 20, 30, 5}, 2) == std::vector<int>{1, 0, 0, 1, 1});
  CHECK(optim::zero_partition({10, 30, 20, 30, 5}, 3) == std::vector<int>{2, 0, 2, 1, 0});
  CHECK(optim::zero_partition({4, 4}, 3) == std::vector<int>{0, 1});
  CHECK(error_of([] { optim::zero_partition({1}, 0); }).find("world_size") != std::string::npos);
}

TEST_CASE("zero: stages 1 and 2 under DDP train as one process does (2 and 3 ranks, Adam, SGD)") {
  for (int stage : {1, 2})
    for (auto kind : {optim::Kind::kAdam, optim::Kind::kSGD}) {
      for (int n : {2, 3}) {
        CAPTURE(stage);
        CAPTURE(n);
        CAPTURE(optim::kind_name(kind));
        Net ref = make_net(7);
        auto ref_opt = local_optimizer(kind, ref->parameters());
        train_local(ref, *ref_opt, n, 0, kSteps);

        Groups g(n);
        std::vector<std::vector<at::Tensor>> params(n);
        std::vector<int64_t> state_bytes(n);
        on_ranks(n, [&](int r) {
          Net net = make_net(7);
          optim::ZeroOptions z;
          z.group = g.groups[r];
          z.bucket_cap_mb = n == 3 ? 1e-5 : 25;  // 3 ranks: buckets of 2 floats, across parameters
          optim::ZeroRedundancyOptimizer opt(net->parameters(), kind, options_of(kind), z);
          ddp::DDPOptions d;
          d.find_unused_parameters = true;
          if (stage == 2) {
            d.gradient_owner = opt.gradient_owner();
            d.bucket_cap_mb = 0.0004;  // buckets of about 100 floats, several owners in each
          }
          ddp::DistributedDataParallel<NetImpl> dnet(net, d, g.groups[r]);
          train_ranks(dnet, opt, r, 0, kSteps, stage == 2);
          params[r] = net->parameters();
          state_bytes[r] = opt.state_bytes();
        });
        for (int r = 0; r < n; ++r) {
          check_same(params[r], ref->parameters());
          for (size_t i = 0; i < params[r].size(); ++i)
            CHECK(at::equal(params[r][i], params[0][i]));
        }
        // The state is split, none of it twice: Adam keeps 2 floats per used
        // element, SGD with momentum 1 (the unused layer has none).
        int64_t used = 0;
        for (auto& p : ref->parameters()) used += p.numel();
        used -= 2 * 2 + 2;
        int64_t total = 0;
        for (int r = 0; r < n; ++r) {
          CHECK(state_bytes[r] > 0);
          CHECK(state_bytes[r] < used * 4 * (kind == optim::Kind::kAdam ? 2 : 1));
          total += state_bytes[r];
        }
        CHECK(total == used * 4 * (kind == optim::Kind::kAdam ? 2 : 1));
      }
    }
}

TEST_CASE("zero: bfloat16 parameters come back to every rank bit for bit (Gloo)") {
  // Gloo 1.x has no bfloat16: the parameters travel as float16's words.
  const int n = 3;
  auto make = [] {
    auto gen = at::detail::createCPUGenerator(11);
    std::vector<at::Tensor> ps;
    for (int64_t len : {5, 300, 0, 7, 1}) {  // (one of no elements: nothing to send)
      ps.push_back(at::randn({len}, gen).to(at::kBFloat16).requires_grad_(true));
    }
    return ps;
  };
  auto grads_of = [](const std::vector<at::Tensor>& ps) {
    auto gen = at::detail::createCPUGenerator(12);
    for (const auto& p : ps) p.mutable_grad() = at::randn(p.sizes(), gen).to(at::kBFloat16);
  };
  std::vector<at::Tensor> want = make();
  grads_of(want);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : want) p.add_(p.grad(), -0.5);  // SGD, lr 0.5
  }
  Groups g(n);
  std::vector<std::vector<at::Tensor>> got(n);
  on_ranks(n, [&](int r) {
    std::vector<at::Tensor> ps = make();
    grads_of(ps);
    optim::Options o;
    o.lr = 0.5;
    optim::ZeroOptions z;
    z.group = g.groups[r];
    optim::ZeroRedundancyOptimizer opt(ps, optim::Kind::kSGD, o, z);
    opt.step();
    got[r] = ps;
  });
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < want.size(); ++i) {
      CAPTURE(r);
      CAPTURE(i);
      const bool bfloat16 = got[r][i].scalar_type() == at::kBFloat16;
      CHECK(bfloat16);
      CHECK(at::equal(got[r][i], want[i]));
    }
  }
}

// Sets `net`'s parameters to `values`.
void assign(Net& net, const std::vector<at::Tensor>& values) {
  torch::NoGradGuard no_grad;
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

TEST_CASE("zero: a consolidated state loads into plain LibTorch and into another rank count") {
  const int n = 2;
  std::string archive;
  std::vector<std::string> shares(n);
  std::vector<at::Tensor> after2;  // the parameters after two steps
  {
    Groups g(n);
    on_ranks(n, [&](int r) {
      Net net = make_net(11);
      ddp::DDPOptions d;
      d.find_unused_parameters = true;
      ddp::DistributedDataParallel<NetImpl> dnet(net, d, g.groups[r]);
      optim::ZeroOptions z;
      z.group = g.groups[r];
      optim::ZeroRedundancyOptimizer opt(net->parameters(), optim::Kind::kAdam,
                                         options_of(optim::Kind::kAdam), z);
      CHECK(error_of([&] { opt.state_dict(); }).find("consolidate_state_dict") !=
            std::string::npos);
      train_ranks(dnet, opt, r, 0, 2);
      opt.consolidate_state_dict(1);
      if (r == 1) {
        archive = opt.state_dict();
        after2 = net->parameters();
      } else {
        CHECK(error_of([&] { opt.state_dict(); }).find("consolidated on rank 1") !=
              std::string::npos);
      }
      shares[r] = opt.local_state_dict();
    });
  }
  // Plain LibTorch takes the consolidated state: its third step is the
  // uninterrupted reference's.
  Net ref = make_net(11);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.01));
  train_local(ref, ref_opt, n, 0, 2);
  check_same(after2, ref->parameters());
  train_local(ref, ref_opt, n, 2, 1);
  // One more step from the saved point, in one process over `ranks`' data.
  auto plain_third_step = [&](int ranks) {
    Net plain = make_net(11);
    assign(plain, after2);
    torch::optim::Adam opt(plain->parameters(), torch::optim::AdamOptions(0.01));
    torch::serialize::InputArchive in;
    in.load_from(archive.data(), archive.size());
    opt.load(in);
    train_local(plain, opt, ranks, 2, 1);
    return plain->parameters();
  };
  check_same(plain_third_step(2), ref->parameters());

  // ZeRO on 3 ranks from the consolidated state, and on 2 from each rank's
  // own share: the third step is plain LibTorch's over the same data.
  auto third_step_on = [&](int ranks, bool from_shares) {
    std::vector<at::Tensor> got;
    Groups g(ranks);
    on_ranks(ranks, [&](int r) {
      Net net = make_net(11);
      assign(net, after2);
      ddp::DDPOptions d;
      d.find_unused_parameters = true;
      ddp::DistributedDataParallel<NetImpl> dnet(net, d, g.groups[r]);
      optim::ZeroOptions z;
      z.group = g.groups[r];
      optim::Options o = options_of(optim::Kind::kAdam);
      o.lr = 0.5;  // the state's rate (0.01) wins
      optim::ZeroRedundancyOptimizer opt(net->parameters(), optim::Kind::kAdam, o, z);
      if (from_shares) {
        opt.load_local_state_dict(shares[r]);
      } else {
        opt.load_state_dict(archive);
      }
      CHECK(opt.lr() == doctest::Approx(0.01));
      train_ranks(dnet, opt, r, 2, 1);
      if (r == 0) got = net->parameters();
    });
    return got;
  };
  check_same(third_step_on(3, false), plain_third_step(3));
  check_same(third_step_on(2, true), plain_third_step(2));
}

TEST_CASE("zero: a share loads only into its own partition; foreign states are refused") {
  std::vector<std::string> shares(2);
  std::string archive;
  {
    Groups g(2);
    on_ranks(2, [&](int r) {
      Net net = make_net(3);
      optim::ZeroOptions z;
      z.group = g.groups[r];
      optim::ZeroRedundancyOptimizer opt(net->parameters(), optim::Kind::kAdam,
                                         options_of(optim::Kind::kAdam), z);
      loss_of(net, batch(r, 0)).backward();
      opt.step();
      shares[r] = opt.local_state_dict();
      opt.consolidate_state_dict(0);
      if (r == 0) archive = opt.state_dict();
    });
  }
  Groups g(2);
  on_ranks(2, [&](int r) {
    Net net = make_net(3);
    optim::ZeroOptions z;
    z.group = g.groups[r];
    optim::ZeroRedundancyOptimizer opt(net->parameters(), optim::Kind::kAdam,
                                       options_of(optim::Kind::kAdam), z);
    CHECK(error_of([&] { opt.load_local_state_dict(shares[1 - r]); })
              .find("saved by rank " + std::to_string(1 - r) + " of 2, this is rank " +
                    std::to_string(r) + " of 2") != std::string::npos);
    CHECK(error_of([&] {
            opt.load_local_state_dict("not an archive");
          }).find("is not a LibTorch archive") != std::string::npos);
    CHECK(error_of([&] { opt.load_local_state_dict(archive); }).find("no 'tandem_zero_version'") !=
          std::string::npos);
    opt.load_local_state_dict(shares[r]);
    // Another model's state: 4 parameters, not 8.
    auto other = std::make_shared<torch::nn::LinearImpl>(6, 13);
    auto two = std::make_shared<torch::nn::LinearImpl>(13, 2);
    std::vector<at::Tensor> four = other->parameters();
    for (auto& p : two->parameters()) four.push_back(p);
    CHECK(error_of([&] {
            optim::ZeroOptions z2;
            z2.group = g.groups[r];
            optim::ZeroRedundancyOptimizer small(four, optim::Kind::kAdam, {}, z2);
            small.load_state_dict(archive);
          }).find("is not that of Adam over these 4 parameters") != std::string::npos);
  });
  // Another world size: the partition differs.
  Groups g3(3);
  on_ranks(3, [&](int r) {
    Net net = make_net(3);
    optim::ZeroOptions z;
    z.group = g3.groups[r];
    optim::ZeroRedundancyOptimizer opt(net->parameters(), optim::Kind::kAdam, {}, z);
    if (r < 2) {
      CHECK(error_of([&] {
              opt.load_local_state_dict(shares[r]);
            }).find("of 2, this is rank " + std::to_string(r) + " of 3") != std::string::npos);
    }
  });
}

TEST_CASE("zero: bad arguments, and ranks whose parameters differ, fail on every rank") {
  Groups g(2);
  on_ranks(2, [&](int r) {
    optim::ZeroOptions z;
    z.group = g.groups[r];
    CHECK(error_of([&] {
            optim::ZeroRedundancyOptimizer({}, optim::Kind::kSGD, {}, z);
          }).find("no parameters") != std::string::npos);
    at::Tensor w = at::zeros({3, 3}).requires_grad_();
    CHECK(error_of([&] {
            optim::ZeroRedundancyOptimizer({w, w}, optim::Kind::kSGD, {}, z);
          }).find("parameter #1 is #0 again") != std::string::npos);
    CHECK(error_of([&] {
            optim::ZeroRedundancyOptimizer({w.t()}, optim::Kind::kSGD, {}, z);
          }).find("parameter #0 is not contiguous") != std::string::npos);
    optim::ZeroOptions bad = z;
    bad.bucket_cap_mb = 0;
    CHECK(error_of([&] {
            optim::ZeroRedundancyOptimizer({w}, optim::Kind::kSGD, {}, bad);
          }).find("bucket_cap_mb") != std::string::npos);
    // Rank 1 passes a parameter of another shape.
    std::vector<at::Tensor> params{at::zeros({4}), at::zeros({r == 0 ? 5 : 6})};
    CHECK(error_of([&] { optim::ZeroRedundancyOptimizer(params, optim::Kind::kSGD, {}, z); }) ==
          "ZeroRedundancyOptimizer: the ranks' parameters differ at parameter #1: rank 0 has [5] "
          "Float, rank 1 has [6] Float (every rank must pass the same parameters in the same "
          "order)");
    // Only rank 1's parameter is refused: both fail, and neither hangs.
    at::Tensor m = at::zeros({3, 3});
    CHECK(error_of([&] {
            optim::ZeroRedundancyOptimizer({r == 1 ? m.t() : m}, optim::Kind::kSGD, {}, z);
          }).find(r == 1 ? "parameter #0 is not contiguous" : "rank 1 has an error: ") !=
          std::string::npos);
    optim::ZeroRedundancyOptimizer ok({w}, optim::Kind::kSGD, {}, z);
    CHECK(error_of([&] { ok.clip_grad_norm(0); }).find("max_norm") != std::string::npos);
    CHECK(error_of([&] { ok.set_lr(-1); }).find("not a finite number >= 0") != std::string::npos);
    CHECK(error_of([&] { ok.consolidate_state_dict(2); }).find("rank 2 is not in [0, 2)") !=
          std::string::npos);
    CHECK(error_of([&] { ok.share(-1); }).find("rank -1") != std::string::npos);
  });
}

TEST_CASE("zero: clipping a model also split over a tensor-parallel group (ClipOptions)") {
  // Two ranks share the optimizer over `dp` and stand, for clipping, as two
  // tensor-parallel ranks too (`tp`): each counted gradient's squares are
  // summed over both groups (so twice), the one `counted` turns down is left
  // out of the norm, and every gradient is scaled.
  Groups dp(2), tp(2);
  on_ranks(2, [&](int r) {
    std::vector<at::Tensor> params;
    for (int64_t n : {5, 3, 4}) params.push_back(at::zeros({n}).requires_grad_());
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = at::full({params[i].numel()}, static_cast<double>(i + 1));
    }
    optim::ZeroOptions z;
    z.group = dp.groups[r];
    optim::ZeroRedundancyOptimizer zero(params, optim::Kind::kSGD, {}, z);
    const at::Tensor skip = params[1];
    ddp::ClipOptions o;
    o.group = tp.groups[r];
    o.counted = [skip](const at::Tensor& p) { return !p.is_same(skip); };
    const double norm = zero.clip_grad_norm(0.5, o);
    const double want = std::sqrt(2.0 * (5 * 1 + 4 * 9));  // (parameter 1's 3 x 4 left out)
    CHECK(norm == doctest::Approx(want).epsilon(1e-9));
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(at::allclose(params[i].grad(),
                         at::full({params[i].numel()}, (i + 1) * 0.5 / (want + 1e-6))));
    }
  });
}

TEST_CASE("zero: stage 2 adds a gradient left from the last step, as DDP does") {
  // No zero_grad between steps: each step's gradient is the sum so far.
  const int n = 2;
  Net ref = make_net(5);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05));
  for (int s = 0; s < 3; ++s) {
    loss_of(ref, concat(n, s)).backward();
    ref_opt.step();
  }
  Groups g(n);
  std::vector<std::vector<at::Tensor>> params(n);
  on_ranks(n, [&](int r) {
    Net net = make_net(5);
    Stage2 z2(net, g.groups[r]);
    auto& opt = z2.opt;
    auto& dnet = z2.dnet;
    for (int s = 0; s < 3; ++s) {
      loss_of(dnet, batch(r, s)).backward();
      opt.step();
    }
    params[r] = net->parameters();
    // The bucket is gone after the step; its layout is what it was.
    auto st = dnet.reducer().stats();
    CHECK(st.buckets >= 1);
    CHECK(st.bucket_bytes.front() > 0);
  });
  for (int r = 0; r < n; ++r) check_same(params[r], ref->parameters());
}

TEST_CASE("zero: stage 2 with zero_grad after forward, and a forward between backward and step") {
  // Each step: forward, zero_grad, backward, an evaluation forward, step.
  const int n = 2;
  Net ref = make_net(6);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05));
  for (int s = 0; s < 3; ++s) {
    auto b = concat(n, s);
    at::Tensor loss = loss_of(ref, b);
    ref_opt.zero_grad();
    loss.backward();
    ref->forward(b.x);
    ref_opt.step();
  }
  Groups g(n);
  std::vector<std::vector<at::Tensor>> params(n);
  on_ranks(n, [&](int r) {
    Net net = make_net(6);
    Stage2 z2(net, g.groups[r]);
    auto& opt = z2.opt;
    auto& dnet = z2.dnet;
    for (int s = 0; s < 3; ++s) {
      auto b = batch(r, s);
      at::Tensor loss = loss_of(dnet, b);
      opt.zero_grad(/*set_to_none=*/s % 2 == 0);
      loss.backward();
      {
        auto evaluating = dnet.no_sync();
        torch::NoGradGuard no_grad;
        dnet(b.x);
      }
      opt.step();
    }
    params[r] = net->parameters();
  });
  for (int r = 0; r < n; ++r) check_same(params[r], ref->parameters());
}

TEST_CASE("zero: stage 2 refuses what it cannot do, naming it") {
  Groups g(2);
  on_ranks(2, [&](int r) {
    Net net = make_net(5);
    optim::ZeroOptions z;
    z.group = g.groups[r];
    // The optimizer over fc1 only: fc2's parameters have no owner.
    optim::ZeroRedundancyOptimizer opt(net->fc1->parameters(), optim::Kind::kSGD, {}, z);
    ddp::DDPOptions d;
    d.gradient_owner = opt.gradient_owner();
    CHECK(error_of([&] {
            ddp::DistributedDataParallel<NetImpl> x(net, d, g.groups[r]);
          }).find("gives parameter 'fc2.weight' to rank -1") != std::string::npos);
    d.comm_hook = ddp::allreduce_hook();
    CHECK(error_of([&] {
            ddp::DistributedDataParallel<NetImpl> x(net, d, g.groups[r]);
          }).find("take no comm_hook") != std::string::npos);
    optim::ZeroRedundancyOptimizer all(net->parameters(), optim::Kind::kSGD, {}, z);
    ddp::DDPOptions ok;
    ok.find_unused_parameters = true;
    ok.gradient_owner = all.gradient_owner();
    ddp::DistributedDataParallel<NetImpl> dnet(net, ok, g.groups[r]);
    CHECK(error_of([&] { auto j = dnet.join(); }).find("join() is not supported") !=
          std::string::npos);
  });
}
