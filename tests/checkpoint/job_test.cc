// A job's state in one call (checkpoint/job.h): saved by every rank (threads
// of this process) with ZeroRedundancyOptimizer on 2 ranks, it goes on with
// ZeroRedundancyOptimizer on 3 ranks and with LibTorch's own Adam in one
// process, exactly as one process trained throughout; a sampler's place, the
// random generator and a record come back; what does not fit is refused by
// name.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>

#include "ddp/ddp_support.h"
#include "shard/shard_support.h"
#include "tandem/autograd/autograd.h"
#include "tandem/checkpoint/job.h"
#include "tandem/checkpoint/placement.h"
#include "tandem/ddp/fully_sharded.h"
#include "tandem/ddp/sampler.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/optim/owner/local_optimizer.h"
#include "tandem/optim/param_state.h"
#include "tandem/optim/zero_redundancy_optimizer.h"

using namespace tandem;
using test::error_of;
using test::Groups;
using test::on_ranks;
using test::TempDir;
using test::shard::Net;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kBase = 9100;  // this file's batches
constexpr double kLr = 0.01;

// Step k's loss on the batch of every rank of two (the same on every rank:
// each computes the whole gradient, so ZeRO's step is the one-process step).
void backward_at(Net& net, int k) {
  auto b = test::shard::concat_of(kBase, 2, k);
  at::cross_entropy_loss(net->forward(b.x), b.y).backward();
}

std::vector<std::string> names_of(Net& net) {
  std::vector<std::string> out;
  for (const auto& p : net->named_parameters()) out.push_back(p.key());
  return out;
}

std::map<std::string, at::Tensor> values_of(Net& net) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

optim::Options adam_options() {
  optim::Options o;
  o.lr = kLr;
  return o;
}

// The one-process run: 6 steps.
std::map<std::string, at::Tensor> reference_run() {
  Net ref = test::shard::make_net(41);
  torch::optim::Adam ref_adam(ref->parameters(), torch::optim::AdamOptions(kLr));
  for (int k = 0; k < 6; ++k) {
    ref_adam.zero_grad();
    backward_at(ref, k);
    ref_adam.step();
  }
  return values_of(ref);
}

// Net trained 3 steps by ZeroRedundancyOptimizer on 2 ranks (threads), saved
// to `dir` as step 3: the model once (rank 0), each rank its share of Adam's
// state, and the record "step".
void save_zero_run(const std::string& dir) {
  test::Groups g(2);
  test::on_ranks(2, [&](int r) {
    Net net = test::shard::make_net(41);
    optim::ZeroOptions zo;
    zo.group = g.groups[r];
    optim::ZeroRedundancyOptimizer z(net->parameters(), optim::Kind::kAdam, adam_options(), zo);
    for (int k = 0; k < 3; ++k) {
      z.zero_grad();
      backward_at(net, k);
      z.step();
    }
    std::string step = "3";
    checkpoint::JobState state(r);
    state.module("net", *net, /*write=*/r == 0)
        .optimizer("adam", z, names_of(net))
        .record("step", &step);
    checkpoint::SaveOptions so;
    so.group = g.groups[r];
    checkpoint::save_job(dir, 3, state, so);
  });
}

// Net and LibTorch's Adam in one process (other values first), loaded from
// `dir`'s step 3 and trained on to step 6: its parameters then.
std::map<std::string, at::Tensor> go_on_in_one_process(const std::string& dir) {
  Net net = test::shard::make_net(99);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(kLr));
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : net->named_parameters()) named.emplace_back(p.key(), p.value());
  checkpoint::JobState state;
  state.module("net", *net).optimizer("adam", adam, named);
  CHECK(checkpoint::load_latest_job(dir, state) == 3);
  for (int k = 3; k < 6; ++k) {
    adam.zero_grad();
    backward_at(net, k);
    adam.step();
  }
  return values_of(net);
}

}  // namespace

TEST_CASE("job: saved with ZeRO on 2 ranks, it goes on with ZeRO on 3 and with Adam alone") {
  TempDir tmp;
  const auto want = reference_run();  // one process throughout

  // Saved after 3 steps on 2 ranks, each its share of Adam's state.
  save_zero_run(tmp.path);
  // Each rank wrote only its share's state; the model once.
  {
    checkpoint::Reader reader(checkpoint::latest(tmp.path)->path);
    CHECK(reader.rank_of("net.fc1.weight") == 0);
    std::set<int> writers;
    for (const auto& n : reader.names()) {
      if (n.rfind("adam/", 0) == 0) writers.insert(reader.rank_of(n));
    }
    CHECK(writers == std::set<int>{0, 1});
  }

  SUBCASE("on 3 ranks") {
    Groups g(3);
    std::vector<std::map<std::string, at::Tensor>> got(3);
    on_ranks(3, [&](int r) {
      Net net = test::shard::make_net(99);  // other values: the checkpoint's must replace them
      optim::ZeroOptions zo;
      zo.group = g.groups[r];
      optim::ZeroRedundancyOptimizer z(net->parameters(), optim::Kind::kAdam, adam_options(), zo);
      std::string step;
      checkpoint::JobState state(r);
      state.module("net", *net).optimizer("adam", z, names_of(net)).record("step", &step);
      CHECK(checkpoint::load_latest_job(tmp.path, state) == 3);
      CHECK(step == "3");
      for (int k = 3; k < 6; ++k) {
        z.zero_grad();
        backward_at(net, k);
        z.step();
      }
      got[r] = values_of(net);
    });
    for (int r = 0; r < 3; ++r) {
      for (const auto& [name, t] : want) {
        CAPTURE(r);
        CAPTURE(name);
        CHECK(at::allclose(got[r].at(name), t, 1e-5, 1e-7));
      }
    }
  }
  SUBCASE("in one process, with LibTorch's Adam") {
    const auto got = go_on_in_one_process(tmp.path);
    for (const auto& [name, t] : want) {
      CAPTURE(name);
      CHECK(at::allclose(got.at(name), t, 1e-5, 1e-7));
    }
  }
  SUBCASE("what does not fit is refused by name, and nothing is loaded") {
    torch::nn::Linear other(6, 4);  // net.fc1 is 13 x 6
    const at::Tensor before = other->weight.detach().clone();
    checkpoint::JobState wrong;
    wrong.module("net.fc1", *other);
    CHECK(error_of([&] {
            checkpoint::load_latest_job(tmp.path, wrong);
          }).find("'net.fc1.weight' is [13, 6] in the step, [4, 6] here") != std::string::npos);
    CHECK(at::equal(other->weight, before));
    Net net = test::shard::make_net(99);
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(kLr));
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& p : net->named_parameters()) named.emplace_back(p.key(), p.value());
    checkpoint::JobState typo;
    typo.optimizer("adamw", adam, named);
    CHECK(error_of([&] {
            checkpoint::load_latest_job(tmp.path, typo);
          }).find("the step holds no 'adamw/fc1.weight' (optimizer 'adamw')") != std::string::npos);
  }
}

namespace {

// Collective: every parameter of an FSDP model, on rank 0 (elsewhere none).
std::map<std::string, at::Tensor> gathered(ddp::FullyShardedDataParallel& f) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : f.full_state_dict(0)) out[name] = t;
  return out;
}

// Net under FullyShardedDataParallel (fc1 and fc2 units of their own; fc3
// and the unused layer the root) with Adam over its shards, on a rank of
// `group` (and, for HSDP, `replicate`). Every rank steps on the whole batch:
// the averaged gradient is the one process's.
struct Sharded {
  Sharded(uint64_t seed, std::shared_ptr<ddp::ProcessGroup> group,
          std::shared_ptr<ddp::ProcessGroup> replicate = nullptr)
      : net(test::shard::make_net(seed)) {
    ddp::FSDPOptions o;
    o.units = {"fc1", "fc2"};
    o.replicate_group = std::move(replicate);
    fsdp = std::make_unique<ddp::FullyShardedDataParallel>(net.ptr(), o, std::move(group));
    adam = std::make_unique<torch::optim::Adam>(fsdp->parameters(), torch::optim::AdamOptions(kLr));
  }
  void step(int k) {
    adam->zero_grad();
    auto b = test::shard::concat_of(kBase, 2, k);
    at::Tensor out = fsdp->forward([&] {
      at::Tensor h = fsdp->run("fc1", [&] { return at::relu(net->fc1(b.x)); });
      h = fsdp->run("fc2", [&] { return at::relu(net->fc2(h)); });
      return net->fc3(h);
    });
    at::cross_entropy_loss(out, b.y).backward();
    adam->step();
  }
  std::map<std::string, at::Tensor> values() { return gathered(*fsdp); }
  Net net;
  std::unique_ptr<ddp::FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::Adam> adam;
};

void check_values(const std::map<std::string, at::Tensor>& got,
                  const std::map<std::string, at::Tensor>& want) {
  REQUIRE(got.size() == want.size());
  for (const auto& [name, t] : want) {
    CAPTURE(name);
    CHECK(at::allclose(got.at(name), t, 1e-5, 1e-7));
  }
}

}  // namespace

TEST_CASE("job: FSDP's shards saved on 2 ranks go on with FSDP on 3, in one process, and back") {
  TempDir tmp;
  const auto want = reference_run();
  {
    Groups g(2);
    on_ranks(2, [&](int r) {
      Sharded job(41, g.groups[r]);
      for (int k = 0; k < 3; ++k) job.step(k);
      std::string step = "3";
      checkpoint::JobState state(r);
      state.module("net", *job.fsdp).optimizer("adam", *job.adam, *job.fsdp).record("step", &step);
      checkpoint::SaveOptions so;
      so.group = g.groups[r];
      checkpoint::save_job(tmp.path, 3, state, so);
    });
  }
  // Each parameter in slices by the ranks whose shards hold a piece of it:
  // fc1 (13 x 6 + 13 = 91 elements, padded to 92) is cut at 46.
  {
    checkpoint::Reader reader(checkpoint::latest(tmp.path)->path);
    CHECK_FALSE(reader.contains("net.fc1.weight"));
    CHECK(reader.shape("net.fc1.weight#0:46") == std::vector<int64_t>{46});
    CHECK(reader.rank_of("net.fc1.weight#0:46") == 0);
    CHECK(reader.rank_of("net.fc1.weight#46:78") == 1);
    CHECK(reader.rank_of("net.fc1.bias#0:13") == 1);
    CHECK(reader.rank_of("adam/fc1.weight#46:78") == 1);
  }

  SUBCASE("FSDP on 3 ranks") {
    Groups g(3);
    std::map<std::string, at::Tensor> got;
    on_ranks(3, [&](int r) {
      Sharded job(99, g.groups[r]);  // other values: the checkpoint's replace them
      std::string step;
      checkpoint::JobState state(r);
      state.module("net", *job.fsdp).optimizer("adam", *job.adam, *job.fsdp).record("step", &step);
      CHECK(checkpoint::load_latest_job(tmp.path, state) == 3);
      CHECK(step == "3");
      for (int k = 3; k < 6; ++k) job.step(k);
      auto v = job.values();
      if (r == 0) got = v;
    });
    check_values(got, want);
  }
  SUBCASE("in one process, with LibTorch's Adam") {
    check_values(go_on_in_one_process(tmp.path), want);
  }
  SUBCASE("a ZeRO checkpoint (whole names) goes on with FSDP on 3 ranks") {
    TempDir zero_dir;
    save_zero_run(zero_dir.path);
    Groups g(3);
    std::map<std::string, at::Tensor> got;
    on_ranks(3, [&](int r) {
      Sharded job(99, g.groups[r]);
      checkpoint::JobState state(r);
      state.module("net", *job.fsdp).optimizer("adam", *job.adam, *job.fsdp);
      CHECK(checkpoint::load_latest_job(zero_dir.path, state) == 3);
      for (int k = 3; k < 6; ++k) job.step(k);
      auto v = job.values();
      if (r == 0) got = v;
    });
    check_values(got, want);
  }
}

namespace {

// A model with FSDP's corner cases: a Linear two modules share ("pair.left"
// and "pair.right", one unit), a 1-element unit ("tiny": on 2 ranks, rank
// 1's shard is all padding) and a parameter of no elements in the root.
struct TinyImpl : torch::nn::Module {
  TinyImpl() { w = register_parameter("w", at::full({1}, 0.5)); }
  at::Tensor w;
};
TORCH_MODULE(Tiny);
struct PairImpl : torch::nn::Module {
  PairImpl() {
    torch::nn::Linear shared(3, 3);
    left = register_module("left", shared);
    right = register_module("right", shared);
  }
  torch::nn::Linear left{nullptr}, right{nullptr};
};
TORCH_MODULE(Pair);
struct OddImpl : torch::nn::Module {
  explicit OddImpl(uint64_t seed) {
    std::lock_guard<std::mutex> lock(test::shard::seed_mutex());
    at::manual_seed(seed);
    pair = register_module("pair", Pair());
    tiny = register_module("tiny", Tiny());
    z = register_parameter("z", at::empty({0}));
  }
  Pair pair{nullptr};
  Tiny tiny{nullptr};
  at::Tensor z;
};
TORCH_MODULE(Odd);

using RunUnit = std::function<at::Tensor(const std::string&, const std::function<at::Tensor()>&)>;

at::Tensor odd_loss(Odd& m, const RunUnit& run, int k) {
  auto gen = at::detail::createCPUGenerator(500 + k);
  const at::Tensor x = at::randn({4, 3}, gen);
  at::Tensor h = run("pair", [&] { return m->pair->right(at::relu(m->pair->left(x))); });
  h = run("tiny", [&] { return h * m->tiny->w; });
  return (h * h).sum() + m->z.sum();
}

// Adagrad over FSDP's shards of an Odd on a rank of `group`.
struct OddSharded {
  OddSharded(uint64_t seed, std::shared_ptr<ddp::ProcessGroup> group) : net(seed) {
    ddp::FSDPOptions o;
    o.units = {"pair", "tiny"};
    fsdp = std::make_unique<ddp::FullyShardedDataParallel>(net.ptr(), o, std::move(group));
    opt = std::make_unique<torch::optim::Adagrad>(fsdp->parameters(),
                                                  torch::optim::AdagradOptions(0.1));
  }
  void step(int k) {
    opt->zero_grad();
    const RunUnit run = [&](const std::string& u, const std::function<at::Tensor()>& fn) {
      return fsdp->run(u, fn);
    };
    fsdp->forward([&] { return odd_loss(net, run, k); }).backward();
    opt->step();
  }
  std::map<std::string, at::Tensor> values() { return gathered(*fsdp); }
  Odd net;
  std::unique_ptr<ddp::FullyShardedDataParallel> fsdp;
  std::unique_ptr<torch::optim::Adagrad> opt;
};

// An Odd's parameters once each (LibTorch lists the shared Linear's twice),
// with their first names.
std::vector<std::pair<std::string, at::Tensor>> unique_params(Odd& net) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : net->named_parameters()) {
    if (std::none_of(out.begin(), out.end(),
                     [&](const auto& u) { return u.second.is_same(p.value()); }))
      out.emplace_back(p.key(), p.value());
  }
  return out;
}

}  // namespace

TEST_CASE("job: FSDP with a shared Linear, an all-padding shard and an empty parameter (Adagrad)") {
  TempDir tmp;
  Groups g(2);
  std::map<std::string, at::Tensor> saved, want;
  on_ranks(2, [&](int r) {
    OddSharded job(7, g.groups[r]);
    job.step(0);
    job.step(1);
    checkpoint::JobState state(r);
    state.module("odd", *job.fsdp).optimizer("adagrad", *job.opt, *job.fsdp);
    checkpoint::SaveOptions so;
    so.group = g.groups[r];
    checkpoint::save_job(tmp.path, 2, state, so);
    auto v = job.values();
    job.step(2);
    job.step(3);
    auto w = job.values();
    if (r == 0) {
      saved = v;
      want = w;
    }
  });
  {
    checkpoint::Reader reader(checkpoint::latest(tmp.path)->path);
    CHECK(reader.bytes("odd.pair.right.weight#alias") == "odd.pair.left.weight");
    CHECK(reader.bytes("adagrad/pair.right.bias#alias") == "adagrad/pair.left.bias");
    CHECK(reader.bytes("odd.pair.left.weight#shape") == "3 3");
  }
  SUBCASE("FSDP on 2 ranks goes on as the original did (the padding shard keeps its state)") {
    std::map<std::string, at::Tensor> got;
    on_ranks(2, [&](int r) {
      OddSharded job(99, g.groups[r]);
      checkpoint::JobState state(r);
      state.module("odd", *job.fsdp).optimizer("adagrad", *job.opt, *job.fsdp);
      CHECK(checkpoint::load_latest_job(tmp.path, state) == 2);
      job.step(2);
      job.step(3);
      auto v = job.values();
      if (r == 0) got = v;
    });
    check_values(got, want);
  }
  SUBCASE("one process: both names of the shared Linear, and the empty parameter, load") {
    Odd net(99);
    // (LibTorch lists the shared Linear's tensors twice: once each, as FSDP steps them)
    std::vector<at::Tensor> unique;
    for (const auto& [_, t] : unique_params(net)) unique.push_back(t);
    CHECK(unique.size() == net->parameters().size() - 2);
    torch::optim::Adagrad opt(unique, torch::optim::AdagradOptions(0.1));
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& p : net->named_parameters()) named.emplace_back(p.key(), p.value());
    checkpoint::JobState state;
    state.module("odd", *net).optimizer("adagrad", opt, named);
    CHECK(checkpoint::load_latest_job(tmp.path, state) == 2);
    for (const auto& [name, t] : saved) {
      CAPTURE(name);
      CHECK(at::equal(net->named_parameters()[name], t));
    }
    CHECK(at::equal(net->named_parameters()["pair.right.weight"], saved.at("pair.left.weight")));
    const RunUnit plain = [](const std::string&, const std::function<at::Tensor()>& fn) {
      return fn();
    };
    for (int k = 2; k < 4; ++k) {
      opt.zero_grad();
      odd_loss(net, plain, k).backward();
      opt.step();
    }
    for (const auto& [name, t] : want) {
      CAPTURE(name);
      CHECK(at::allclose(net->named_parameters()[name], t, 1e-5, 1e-7));
    }
  }
  SUBCASE("a DistributedOptimizer's owner loads it; the empty parameter keeps its own state") {
    test::World w(1);
    Odd net(99);
    std::vector<rpc::RRef<at::Tensor>> params;
    std::vector<std::string> names;
    for (const auto& [name, t] : unique_params(net)) {
      params.push_back(rpc::RRef<at::Tensor>::make_local(w[0], t));
      names.push_back(name);
    }
    optim::Options o;
    o.lr = 0.1;
    optim::DistributedOptimizer opt(w[0], optim::Kind::kAdagrad, params, o);
    checkpoint::JobState state;
    state.module("odd", *net).distributed_optimizer("adagrad", opt, names);
    CHECK(checkpoint::load_latest_job(tmp.path, state) == 2);
    const RunUnit plain = [](const std::string&, const std::function<at::Tensor()>& fn) {
      return fn();
    };
    for (int k = 2; k < 4; ++k) {
      autograd::Context ctx(w[0]);
      autograd::backward(w[0], ctx.id(), {odd_loss(net, plain, k)});
      opt.step(ctx.id());  // (Adagrad with no state for z would fail here)
    }
    for (const auto& [name, t] : want) {
      CAPTURE(name);
      CHECK(at::allclose(net->named_parameters()[name], t, 1e-5, 1e-7));
    }
  }
}

TEST_CASE("job: HSDP writes each shard once (the first replica), and it loads in one process") {
  TempDir tmp;
  const auto want = reference_run();
  const int n = 4;
  Groups world(n);
  test::HsdpGroups hsdp;
  on_ranks(n, [&](int r) {
    Sharded job(41, hsdp.shard[r], hsdp.replicate[r]);
    for (int k = 0; k < 3; ++k) job.step(k);
    checkpoint::JobState state(r);
    state.module("net", *job.fsdp).optimizer("adam", *job.adam, *job.fsdp);
    checkpoint::SaveOptions so;
    so.group = world.groups[r];
    checkpoint::save_job(tmp.path, 3, state, so);
  });
  {
    checkpoint::Reader reader(checkpoint::latest(tmp.path)->path);
    std::set<int> writers;
    for (const auto& name : reader.names()) writers.insert(reader.rank_of(name));
    CHECK(writers == std::set<int>{0, 1});  // the first replica's two shards
  }
  check_values(go_on_in_one_process(tmp.path), want);
}

TEST_CASE("job: slices that leave elements out, overlap or do not fit are refused by name") {
  // A Linear(6, 4)'s weight (24 elements) in hand-made slices.
  auto step_with = [](const std::string& dir,
                      const std::vector<std::pair<std::string, int64_t>>& cuts) {
    checkpoint::Part p;
    for (const auto& [name, n] : cuts) p.add(name, at::ones({n}));
    p.add("m.bias", at::zeros({4}));
    checkpoint::save(dir, 1, p);
  };
  auto error_loading = [](const std::string& dir, torch::nn::Module& m) {
    checkpoint::JobState state;
    state.module("m", m);
    return error_of([&] { checkpoint::load_latest_job(dir, state); });
  };
  torch::nn::Linear m(6, 4);
  const at::Tensor before = m->weight.detach().clone();
  struct Bad {
    std::vector<std::pair<std::string, int64_t>> cuts;  // name, elements
    std::string error;
  };
  const std::vector<Bad> bad = {
      {{{"m.weight#0:10", 10}, {"m.weight#12:24", 12}},
       "'m.weight': its elements [10, 12) are in no slice"},
      {{{"m.weight#0:12", 12}, {"m.weight#10:24", 14}},
       "'m.weight#10:24' overlaps the slice before it"},
      {{{"m.weight#0:12", 12}, {"m.weight#12:24", 11}}, "'m.weight#12:24' is [11], not [12]"},
      {{{"m.weight#0:12", 12}, {"m.weight#12:30", 18}},
       "'m.weight' has 30 elements in its slices, 24 here"},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.error);
    TempDir d;
    step_with(d.path, b.cuts);
    CHECK(error_loading(d.path, *m).find(b.error) != std::string::npos);
  }
  CHECK(at::equal(m->weight, before));  // nothing loaded
  {
    TempDir d;
    step_with(d.path, {{"m.weight#0:12", 12}, {"m.weight#12:24", 12}});
    checkpoint::JobState state;
    state.module("m", *m);
    CHECK(checkpoint::load_latest_job(d.path, state) == 1);
    CHECK(at::equal(m->weight, at::ones({4, 6})));
  }
  // An optimizer state in slices of another kind (SGD's) is refused naming the piece.
  {
    TempDir d;
    torch::nn::Linear src(6, 4);
    torch::optim::SGD sgd(src->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    src->weight.mutable_grad() = at::ones({4, 6});
    src->bias.mutable_grad() = at::ones({4});
    sgd.step();
    checkpoint::Part p;
    p.add_bytes("opt/weight#0:24", optim::param_state_slice_bytes(sgd, src->weight, 0, 24));
    p.add_bytes("opt/bias", optim::param_state_bytes(sgd, src->bias));
    checkpoint::save(d.path, 1, p);
    torch::nn::Linear dst(6, 4);
    torch::optim::Adam adam(dst->parameters(), torch::optim::AdamOptions(0.1));
    checkpoint::JobState state;
    state.optimizer("adam", adam, {{"weight", dst->weight}, {"bias", dst->bias}});
    CHECK(error_of([&] {
            checkpoint::load_latest_job(d.path, state);
          }).find("the step holds no 'adam/weight'") != std::string::npos);
    checkpoint::JobState wrong;
    wrong.optimizer("opt", adam, {{"weight", dst->weight}, {"bias", dst->bias}});
    CHECK(error_of([&] {
            checkpoint::load_latest_job(d.path, wrong);
          }).find("checkpoint: 'opt/weight': 'opt/weight#0:24': not Adam's for one parameter") !=
          std::string::npos);
    // And SGD's own goes back together, exactly.
    torch::optim::SGD back(dst->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    checkpoint::JobState right;
    right.optimizer("opt", back, {{"weight", dst->weight}, {"bias", dst->bias}});
    CHECK(checkpoint::load_latest_job(d.path, right) == 1);
    auto momentum = [](torch::optim::Optimizer& o, const at::Tensor& p) {
      return optim::owner::state_tensors(*optim::owner::find_state(o, p)).at(0);
    };
    CHECK(at::equal(momentum(back, dst->weight), momentum(sgd, src->weight)));
    CHECK(momentum(back, dst->weight).sizes() == src->weight.sizes());
  }
}

TEST_CASE("job: a sampler's place goes on among other replicas, and the generator comes back") {
  TempDir tmp;
  constexpr size_t kSize = 84;
  // Two replicas, 12 indices each into epoch 2.
  std::vector<std::vector<size_t>> rest(2);
  {
    Groups g(2);
    on_ranks(2, [&](int r) {
      ddp::DistributedSampler s(kSize, 2, r, /*shuffle=*/true, /*seed=*/5);
      s.set_epoch(2);
      s.reset();  // (as a data loader does at an epoch's start)
      s.next(7);
      s.next(5);
      checkpoint::JobState state(r);
      state.sampler("data", s);
      // (the ranks are threads sharing one generator: rank 0 alone seeds and saves it)
      if (r == 0) {
        at::manual_seed(1234);
        state.random();
      }
      checkpoint::SaveOptions so;
      so.group = g.groups[r];
      checkpoint::save_job(tmp.path, 1, state, so);
      rest[r] = *s.next(1000);
    });
  }
  // One replica goes on where the two were: the epoch's order from 24 on.
  ddp::DistributedSampler whole(kSize, 1, 0, true, 5);
  whole.set_epoch(2);
  const std::vector<size_t> order = whole.indices();
  ddp::DistributedSampler one(kSize, 1, 0, true, 5);
  checkpoint::JobState state;
  state.sampler("data", one).random();
  at::manual_seed(777);
  CHECK(checkpoint::load_latest_job(tmp.path, state) == 1);
  CHECK(one.epoch() == 2);
  CHECK(*one.next(1000) == std::vector<size_t>(order.begin() + 24, order.end()));
  // The two replicas' own continuations are that order, dealt out.
  for (size_t i = 0; i < rest[0].size(); ++i) {
    CHECK(rest[0][i] == order[24 + 2 * i]);
    CHECK(rest[1][i] == order[25 + 2 * i]);
  }
  // The generator is rank 0's as saved.
  at::manual_seed(1234);
  const at::Tensor expected = at::randn({5});
  at::manual_seed(777);
  checkpoint::load_latest_job(tmp.path, state);
  CHECK(at::equal(at::randn({5}), expected));
  // An epoch gone through whole (its padding differs by replica count) loads
  // anywhere as gone through.
  {
    TempDir whole_dir;
    ddp::DistributedSampler three(10, 3, 0, true, 5);  // 4 each, 12 with padding
    three.set_epoch(1);
    three.reset();
    three.next(100);
    checkpoint::JobState saved;
    saved.sampler("data", three);
    checkpoint::save_job(whole_dir.path, 1, saved);
    ddp::DistributedSampler two(10, 2, 1, true, 5);
    checkpoint::JobState loaded(1);
    loaded.sampler("data", two);
    CHECK(checkpoint::load_latest_job(whole_dir.path, loaded) == 1);
    CHECK(two.epoch() == 1);
    CHECK_FALSE(two.next(1).has_value());
  }
  CHECK(error_of([] {
          ddp::DistributedSampler(10, 2, 0).resume(0, 6);
        }).find("position 6 is past the epoch's 5 indices") != std::string::npos);
  // Seven replicas cannot share 24 indices.
  ddp::DistributedSampler seven(kSize, 7, 3, true, 5);
  checkpoint::JobState bad(3);
  bad.sampler("data", seven);
  CHECK(error_of([&] {
          checkpoint::load_latest_job(tmp.path, bad);
        }).find("gone through 24 indices of epoch 2, which do not divide among 7 replicas") !=
        std::string::npos);
}

TEST_CASE("job: each GPU's generator comes back too") {
  if (!test::cuda_or_skip()) return;
  TempDir tmp;
  at::manual_seed(77);  // every device's
  checkpoint::JobState state;
  state.random();
  checkpoint::save_job(tmp.path, 1, state);
  const at::Tensor want = at::randn({4}, at::TensorOptions().device(at::kCUDA)).cpu();
  checkpoint::Reader r(checkpoint::latest(tmp.path)->path);
  CHECK(r.contains("rng/0/cuda0"));
  at::manual_seed(5);  // elsewhere
  checkpoint::load_latest_job(tmp.path, state);
  CHECK(at::equal(at::randn({4}, at::TensorOptions().device(at::kCUDA)).cpu(), want));
}

TEST_CASE(
    "job: an optimizer's state is copied when the part is made, its bytes made at the write") {
  TempDir tmp;
  torch::nn::Linear m(3, 2);
  torch::optim::Adam adam(m->parameters(), torch::optim::AdamOptions(0.1));
  auto step = [&] {
    adam.zero_grad();
    at::sum(m(at::ones({4, 3}))).backward();
    adam.step();
  };
  step();
  checkpoint::JobState state;
  state.optimizer("adam", adam, {{"weight", m->weight}, {"bias", m->bias}});
  checkpoint::Part part = state.part();
  auto moments = [](torch::optim::Adam& o, const at::Tensor& p) {
    return optim::owner::state_tensors(*optim::owner::find_state(o, p)).at(0).clone();
  };
  const at::Tensor then = moments(adam, m->weight);
  step();  // (Adam's moments change in place)
  CHECK_FALSE(at::equal(moments(adam, m->weight), then));
  checkpoint::save(tmp.path, 1, part);
  torch::nn::Linear back(3, 2);
  torch::optim::Adam loaded(back->parameters(), torch::optim::AdamOptions(0.1));
  checkpoint::JobState load;
  load.optimizer("adam", loaded, {{"weight", back->weight}, {"bias", back->bias}});
  CHECK(checkpoint::load_latest_job(tmp.path, load) == 1);
  CHECK(at::equal(moments(loaded, back->weight), then));
  const auto* st = optim::owner::find_state(loaded, back->weight);
  CHECK(static_cast<const torch::optim::AdamParamState&>(*st).step() == 1);
}

namespace {

// A model of three tensors split over tensor-parallel ranks as Megatron
// splits them (checkpoint/placement.h): `rows` [9, 4] by rows, unevenly
// (range_of's cut); `fused` [18, 4] a third of each of its three blocks
// of 6 rows (a [q; k; v]); `cols` [4, 6] by columns; and `shared` [4]
// replicated. Rank r of n holds the pieces; n = 1 is the whole model.
struct Split : torch::nn::Module {
  at::Tensor rows, fused, cols, shared;
};

std::pair<int64_t, int64_t> range_of(int64_t total, int r, int n) {
  const int64_t base = total / n, extra = total % n;
  const int64_t start = r * base + std::min<int64_t>(r, extra);
  return {start, start + base + (r < extra ? 1 : 0)};
}

// Rank r's pieces of the whole tensors.
std::map<std::string, at::Tensor> pieces_of(const std::map<std::string, at::Tensor>& whole, int r,
                                            int n) {
  const auto [a, b] = range_of(9, r, n);
  std::vector<at::Tensor> thirds;
  for (int k = 0; k < 3; ++k) thirds.push_back(whole.at("fused").narrow(0, 6 * k + r * 6 / n, 6 / n));
  return {{"rows", whole.at("rows").narrow(0, a, b - a)},
          {"fused", at::cat(thirds)},
          {"cols", whole.at("cols").narrow(1, r * 6 / n, 6 / n)},
          {"shared", whole.at("shared")}};
}

std::shared_ptr<Split> split_model(int r, int n) {
  auto m = std::make_shared<Split>();
  std::map<std::string, at::Tensor> zeros = {{"rows", at::zeros({9, 4})},
                                             {"fused", at::zeros({18, 4})},
                                             {"cols", at::zeros({4, 6})},
                                             {"shared", at::zeros({4})}};
  const auto mine = pieces_of(zeros, r, n);
  m->rows = m->register_parameter("rows", mine.at("rows").clone());
  m->fused = m->register_parameter("fused", mine.at("fused").clone());
  m->cols = m->register_parameter("cols", mine.at("cols").clone());
  m->shared = m->register_parameter("shared", mine.at("shared").clone());
  if (n > 1) {
    const auto [a, b] = range_of(9, r, n);
    checkpoint::set_placement(m->rows, {{9, 4}, 0, {{a, b}}});
    std::vector<std::pair<int64_t, int64_t>> thirds;
    for (int k = 0; k < 3; ++k) thirds.emplace_back(6 * k + r * 6 / n, 6 * k + (r + 1) * 6 / n);
    checkpoint::set_placement(m->fused, {{18, 4}, 0, thirds});
    checkpoint::set_placement(m->cols, {{4, 6}, 1, {{r * 6 / n, (r + 1) * 6 / n}}});
    checkpoint::set_replica(m->shared, r);
  }
  return m;
}

// (a generator of its own: the ranks draw at once, on threads)
std::map<std::string, at::Tensor> whole_at(uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return {{"rows", at::randn({9, 4}, g)},
          {"fused", at::randn({18, 4}, g)},
          {"cols", at::randn({4, 6}, g)},
          {"shared", at::randn({4}, g)}};
}

// Two Adam steps of rank r of n from the whole values of seed 1, on its
// pieces of the whole gradients of seeds 2 and 3 (elementwise: each piece's
// values and state are the slices of the whole model's).
void train_piece(Split& m, torch::optim::Adam& adam, int r, int n) {
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : pieces_of(whole_at(1), r, n)) m.named_parameters()[name].copy_(t);
  for (uint64_t s : {2, 3}) {
    for (auto& [name, g] : pieces_of(whole_at(s), r, n)) {
      m.named_parameters()[name].mutable_grad() = g.clone();
    }
    adam.step();
  }
}

std::vector<std::pair<std::string, at::Tensor>> named(Split& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters()) out.emplace_back(p.key(), p.value());
  return out;
}

// Adam's first moment of each parameter.
std::map<std::string, at::Tensor> moments_of(torch::optim::Adam& adam, Split& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    out[p.key()] = optim::owner::state_tensors(*optim::owner::find_state(adam, p.value())).at(1);
  }
  return out;
}

// Saves ranks 0..n-1 of a split trained by train_piece as step 2 of `dir`
// (every rank its part, together).
void save_split(const std::string& dir, int n) {
  test::Groups g(n);
  test::on_ranks(n, [&](int r) {
    auto m = split_model(r, n);
    torch::optim::Adam adam(m->parameters(), torch::optim::AdamOptions(0.1));
    train_piece(*m, adam, r, n);
    checkpoint::JobState state(r);
    state.module("m", *m).optimizer("adam", adam, named(*m));
    checkpoint::SaveOptions so;
    so.group = g.groups[r];
    checkpoint::save_job(dir, 2, state, so);
  });
}

}  // namespace

TEST_CASE("job: tensor-parallel pieces are slices of the whole: 2 ranks load into 1 and 3, and back") {
  // The whole model trained alone: what every split must hold.
  auto whole = split_model(0, 1);
  torch::optim::Adam whole_adam(whole->parameters(), torch::optim::AdamOptions(0.1));
  train_piece(*whole, whole_adam, 0, 1);
  std::map<std::string, at::Tensor> want;
  for (const auto& p : whole->named_parameters()) want[p.key()] = p.value().detach().clone();
  const auto want_moments = moments_of(whole_adam, *whole);

  TempDir two;
  save_split(two.path, 2);
  {
    // The pieces' names: the whole tensors' slices, blocks along dim 1, once
    // for the replicated one.
    const checkpoint::Reader r(checkpoint::latest(two.path).value().path);
    const auto names = r.names();
    const std::set<std::string> have(names.begin(), names.end());
    for (const char* n : {"m.rows#0:20", "m.rows#20:36", "m.fused#0:12", "m.fused#24:36",
                          "m.fused#48:60", "m.fused#12:24", "m.cols#d1:0:3", "m.cols#d1:3:6",
                          "m.shared", "m.rows#shape", "adam/cols#d1:3:6", "adam/fused#60:72",
                          "adam/rows#shape"}) {
      CHECK_MESSAGE(have.count(n), n);
    }
    CHECK(std::count_if(names.begin(), names.end(),
                        [](const std::string& n) { return n.rfind("m.shared", 0) == 0; }) == 1);
  }
  // Into one process: the whole values and Adam's whole state.
  {
    auto one = split_model(0, 1);
    torch::optim::Adam adam(one->parameters(), torch::optim::AdamOptions(0.1));
    checkpoint::JobState state;
    state.module("m", *one).optimizer("adam", adam, named(*one));
    CHECK(checkpoint::load_latest_job(two.path, state) == 2);
    for (const auto& p : one->named_parameters()) CHECK(at::equal(p.value(), want.at(p.key())));
    const auto moments = moments_of(adam, *one);
    for (const auto& [name, m] : want_moments) CHECK(at::equal(moments.at(name), m));
  }
  // Into 3 ranks: each its own pieces of both.
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    auto piece = split_model(r, 3);
    torch::optim::Adam adam(piece->parameters(), torch::optim::AdamOptions(0.1));
    checkpoint::JobState state(r);
    state.module("m", *piece).optimizer("adam", adam, named(*piece));
    CHECK(checkpoint::load_latest_job(two.path, state) == 2);
    const auto values = pieces_of(want, r, 3);
    for (const auto& p : piece->named_parameters()) CHECK(at::equal(p.value(), values.at(p.key())));
    const auto moments = moments_of(adam, *piece);
    for (const auto& [name, m] : pieces_of(want_moments, r, 3)) CHECK(at::equal(moments.at(name), m));
  }
  // One process's step into 2 ranks.
  TempDir one;
  {
    checkpoint::JobState state;
    state.module("m", *whole).optimizer("adam", whole_adam, named(*whole));
    checkpoint::save_job(one.path, 2, state);
  }
  for (int r = 0; r < 2; ++r) {
    auto piece = split_model(r, 2);
    torch::optim::Adam adam(piece->parameters(), torch::optim::AdamOptions(0.1));
    checkpoint::JobState state(r);
    state.module("m", *piece).optimizer("adam", adam, named(*piece));
    CHECK(checkpoint::load_latest_job(one.path, state) == 2);
    const auto values = pieces_of(want, r, 2);
    for (const auto& p : piece->named_parameters()) CHECK(at::equal(p.value(), values.at(p.key())));
    const auto moments = moments_of(adam, *piece);
    for (const auto& [name, m] : pieces_of(want_moments, r, 2)) CHECK(at::equal(moments.at(name), m));
  }
}

TEST_CASE("job: FSDP over each tensor-parallel rank's replicas writes its shards' share of the pieces") {
  // tp 2 x dp 6: each tp rank's split (split_model) sharded by FSDP over its
  // 6 replicas, one unit: tp rank 0's 72 elements (rows 20, fused 36, cols
  // 12, shared 4) make shards of 12, so the shards cut the row pieces into
  // flat slices and the column block at [56, 68) at 60: its parts
  // "#d1:0:3@0:4" and "#d1:0:3@4:12" (tp rank 1's at [52, 64): "#d1:3:6@0:8"
  // and "#d1:3:6@8:12"). The replicated vector is written once, by tp rank 0.
  const auto whole = split_model(0, 1);
  torch::optim::Adam whole_adam(whole->parameters(), torch::optim::AdamOptions(0.1));
  train_piece(*whole, whole_adam, 0, 1);
  std::map<std::string, at::Tensor> want;
  for (const auto& p : whole->named_parameters()) want[p.key()] = p.value().detach().clone();
  const auto want_moments = moments_of(whole_adam, *whole);

  TempDir dir;
  {
    constexpr int kTp = 2, kDp = 6;
    Groups dp0(kDp), dp1(kDp), all(kTp * kDp);
    on_ranks(kTp * kDp, [&](int rank) {
      const int t = rank / kDp, d = rank % kDp;
      auto m = split_model(t, kTp);
      {
        torch::NoGradGuard no_grad;
        for (auto& [name, v] : pieces_of(whole_at(1), t, kTp)) m->named_parameters()[name].copy_(v);
      }
      ddp::FullyShardedDataParallel f(m, {}, (t == 0 ? dp0 : dp1).groups[d]);
      torch::optim::Adam adam(f.parameters(), torch::optim::AdamOptions(0.1));
      const at::Tensor shard = f.parameters().at(0);
      for (uint64_t s : {2, 3}) {  // (each shard's gradient: its slice of the pieces' gradients)
        std::vector<at::Tensor> flat;
        const auto g = pieces_of(whole_at(s), t, kTp);
        for (const auto& p : m->named_parameters()) flat.push_back(g.at(p.key()).reshape(-1));
        at::Tensor all_grads = at::cat(flat);
        all_grads = at::cat({all_grads, at::zeros({shard.numel() * kDp - all_grads.numel()})});
        shard.mutable_grad() = all_grads.narrow(0, d * shard.numel(), shard.numel()).clone();
        adam.step();
      }
      checkpoint::JobState state(rank);
      state.module("m", f).optimizer("adam", adam, f);
      checkpoint::SaveOptions so;
      so.group = all.groups[rank];
      checkpoint::save_job(dir.path, 2, state, so);
    });
  }
  {
    const checkpoint::Reader r(checkpoint::latest(dir.path).value().path);
    const auto names = r.names();
    const std::set<std::string> have(names.begin(), names.end());
    for (const char* n : {"m.cols#d1:0:3@0:4", "m.cols#d1:0:3@4:12", "adam/cols#d1:3:6@8:12",
                          "m.rows#0:12", "m.rows#12:20", "m.rows#20:32", "m.cols#shape",
                          "m.fused#0:4", "m.shared#0:4"}) {
      CHECK_MESSAGE(have.count(n), std::string(n));
    }
    CHECK(std::count_if(names.begin(), names.end(),
                        [](const std::string& n) { return n.rfind("m.shared", 0) == 0; }) == 2);
  }
  // Into one process, and into 3 tensor-parallel ranks: the whole model's
  // values and Adam's state, and their pieces.
  for (int n : {1, 3}) {
    for (int r = 0; r < n; ++r) {
      CAPTURE(n);
      CAPTURE(r);
      auto piece = split_model(r, n);
      torch::optim::Adam adam(piece->parameters(), torch::optim::AdamOptions(0.1));
      checkpoint::JobState state(r);
      state.module("m", *piece).optimizer("adam", adam, named(*piece));
      CHECK(checkpoint::load_latest_job(dir.path, state) == 2);
      const auto values = pieces_of(want, r, n);
      for (const auto& p : piece->named_parameters()) {
        CHECK(at::allclose(p.value(), values.at(p.key()), 1e-6, 1e-7));
      }
      const auto moments = moments_of(adam, *piece);
      for (const auto& [name, m] : pieces_of(want_moments, r, n)) {
        CHECK(at::allclose(moments.at(name), m, 1e-6, 1e-7));
      }
    }
  }
}

TEST_CASE("job: a split missing a rank's pieces is refused by name; bad placements too") {
  // Only rank 0 of 2 saved: the whole tensors lack rank 1's slices.
  TempDir d;
  {
    auto m = split_model(0, 2);
    checkpoint::JobState state;
    state.module("m", *m);
    checkpoint::save_job(d.path, 1, state);
  }
  auto one = split_model(0, 1);
  const at::Tensor before = one->rows.detach().clone();
  checkpoint::JobState state;
  state.module("m", *one);
  CHECK(error_of([&] { checkpoint::load_latest_job(d.path, state); })
            .find("'m.rows' has 20 elements in its slices, 36 here") != std::string::npos);
  CHECK(at::equal(one->rows, before));  // nothing loaded
  // ... and rank 1 of 2, whose columns are missing from the blocks.
  auto other = split_model(1, 2);
  checkpoint::JobState other_state(1);
  other_state.module("m", *other);
  CHECK(error_of([&] { checkpoint::load_latest_job(d.path, other_state); }).find("'m.rows'") !=
        std::string::npos);

  const at::Tensor t = at::zeros({3, 4});
  auto refused = [&](checkpoint::Placement p) {
    return error_of([&] { checkpoint::set_placement(t, std::move(p)); });
  };
  CHECK(refused({{9, 4}, 2, {{0, 3}}}).find("dimension 2 of a whole tensor of 2") !=
        std::string::npos);
  CHECK(refused({{9, 4}, 0, {{0, 3}, {2, 5}}}).find("overlaps or precedes") != std::string::npos);
  CHECK(refused({{9, 4}, 0, {{0, 4}}}).find("a piece of [3, 4] is not [4, 4]") !=
        std::string::npos);
  CHECK(refused({{3, 8}, 1, {{0, 2}, {4, 6}}}).find("several are taken along dimension 0 only") !=
        std::string::npos);
  CHECK_FALSE(checkpoint::placement_of(t));
}
