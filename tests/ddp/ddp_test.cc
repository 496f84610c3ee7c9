// DistributedDataParallel against single-process LibTorch: ranks are threads
// of this process, each with its own replica and its own part of the batch.
#include "ddp_support.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/relu.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "tandem/ddp/distributed_data_parallel.h"

#include <torch/version.h>

#include <atomic>

using namespace tandem;
using namespace std::chrono_literals;
using test::error_of;
using test::Groups;
using test::on_ranks;

namespace {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int hidden = 8, bool with_unused = false) {
    fc1 = register_module("fc1", torch::nn::Linear(5, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 3));
    if (with_unused) unused = register_module("unused", torch::nn::Linear(3, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, unused{nullptr};
};
TORCH_MODULE(Net);

struct Batch {
  at::Tensor x, y;
};

// Rank r's batch k of 4 samples (its own generator: ranks are threads).
Batch batch(int r, int k) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + 17 * r + k));
  return {at::randn({4, 5}, gen), at::randint(0, 3, {4}, gen, at::kLong)};
}

// The global generator makes the weights: one thread at a time.
std::mutex g_seed_mu;
Net make_net(uint64_t seed, bool with_unused = false, int hidden = 8) {
  std::lock_guard<std::mutex> lock(g_seed_mu);
  at::manual_seed(seed);
  return Net(hidden, with_unused);
}

double loss_of(Net& net, const Batch& b) {
  auto loss = torch::nn::functional::cross_entropy(net->forward(b.x), b.y);
  loss.backward();
  return loss.item<double>();
}

// The same training on one process: each step's batch is every rank's
// batch concatenated; `micro` micro-batches accumulate before a step.
std::vector<at::Tensor> local_training(int world, int steps, int micro, bool with_unused = false) {
  Net net = make_net(0, with_unused);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    for (int k = 0; k < micro; ++k) {
      std::vector<at::Tensor> xs, ys;
      for (int r = 0; r < world; ++r) {
        Batch b = batch(r, s * micro + k);
        xs.push_back(b.x);
        ys.push_back(b.y);
      }
      Batch all{at::cat(xs), at::cat(ys)};
      loss_of(net, all);
    }
    opt.step();
  }
  std::vector<at::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                  double rtol = 1e-5, double atol = 1e-6) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("parameter " << i);
    CHECK(at::allclose(got[i], want[i], rtol, atol));
  }
}

// `steps` synced SGD steps on `world` ranks; every rank's final parameters.
std::vector<std::vector<at::Tensor>> ddp_training(int world, int steps, const ddp::DDPOptions& o) {
  Groups g(world);
  std::vector<std::vector<at::Tensor>> result(world);
  on_ranks(world, [&](int r) {
    Net net = make_net(0);
    ddp::DistributedDataParallel model(net, o, g.groups[r]);
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      Batch b = batch(r, s);
      torch::nn::functional::cross_entropy(model(b.x), b.y).backward();
      opt.step();
    }
    for (auto& p : net->parameters()) result[r].push_back(p.detach().clone());
  });
  return result;
}

}  // namespace

TEST_CASE("ddp: DistributedDataParallel trains as one process on the concatenated batches") {
  const int steps = 3;
  for (int world : {2, 3}) {
    for (double cap : {25.0, 1e-6}) {  // one bucket; a bucket per parameter
      INFO("world " << world << " bucket_cap_mb " << cap);
      Groups g(world);
      std::vector<std::vector<at::Tensor>> result(world);
      on_ranks(world, [&](int r) {
        Net net = make_net(r == 0 ? 0 : r + 7);  // others differ on purpose: rank 0's are taken
        ddp::DDPOptions o;
        o.bucket_cap_mb = cap;
        o.first_bucket_mb = cap;
        ddp::DistributedDataParallel model(net, o, g.groups[r]);
        auto before = model.reducer().stats();
        CHECK(before.buckets == (cap < 1 ? 4u : 1u));
        // Reverse parameter order at first: fc2.bias is the first bucket's.
        CHECK(before.bucket_params.front().front() == 3u);
        torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
        for (int s = 0; s < steps; ++s) {
          opt.zero_grad();
          Batch b = batch(r, s);
          auto loss = torch::nn::functional::cross_entropy(model(b.x), b.y);
          loss.backward();
          // The averaged gradient lives in the bucket: .grad aliases it.
          for (auto& p : model.parameters()) CHECK(p.grad().defined());
          opt.step();
        }
        CHECK(model.reducer().stats().rebuilt);
        for (auto& p : net->parameters()) result[r].push_back(p.detach().clone());
      });
      auto want = local_training(world, steps, 1);
      for (int r = 0; r < world; ++r) expect_close(result[r], want);
    }
  }
}

TEST_CASE("ddp: without init_sync each rank keeps its values; set_group moves to a smaller group") {
  // As under tandem::ft: a quorum of three, then of two (rank 2 gone).
  Groups three(3), two(2);
  std::vector<std::vector<at::Tensor>> result(2);
  on_ranks(3, [&](int r) {
    Net net = make_net(0);
    Net other = make_net(9);
    ddp::DDPOptions o;
    o.init_sync = false;
    o.bucket_cap_mb = 1e-6;  // a bucket a parameter
    o.first_bucket_mb = 1e-6;
    {
      // Nothing compared, nothing taken from rank 0.
      ddp::DistributedDataParallel kept(other, o, three.groups[r]);
      auto want = make_net(9)->parameters();
      for (size_t i = 0; i < want.size(); ++i) CHECK(at::equal(other->parameters()[i], want[i]));
    }
    ddp::DistributedDataParallel model(net, o, three.groups[r]);
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 3; ++s) {
      if (s == 1) {
        if (r == 2) return;
        model.set_group(two.groups[r]);
        CHECK_FALSE(model.reducer().stats().rebuilt);  // from the reverse order again
      }
      opt.zero_grad();
      Batch b = batch(r, s);
      torch::nn::functional::cross_entropy(model(b.x), b.y).backward();
      opt.step();
    }
    CHECK(model.reducer().stats().rebuilt);
    CHECK_THROWS_AS(model.set_group(nullptr), std::invalid_argument);
    for (auto& p : net->parameters()) result[r].push_back(p.detach().clone());
  });
  // The reference: step 0 over three ranks' batches, steps 1 and 2 over two.
  Net net = make_net(0);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < 3; ++s) {
    const int world = s == 0 ? 3 : 2;
    std::vector<at::Tensor> xs, ys;
    for (int r = 0; r < world; ++r) {
      Batch b = batch(r, s);
      xs.push_back(b.x);
      ys.push_back(b.y);
    }
    opt.zero_grad();
    loss_of(net, Batch{at::cat(xs), at::cat(ys)});
    opt.step();
  }
  std::vector<at::Tensor> want;
  for (auto& p : net->parameters()) want.push_back(p.detach().clone());
  for (int r = 0; r < 2; ++r) expect_close(result[r], want);
}

TEST_CASE("ddp: no_sync accumulates locally and the next backward averages it all") {
  const int world = 2, steps = 2, micro = 3;
  Groups g(world);
  std::vector<std::vector<at::Tensor>> result(world);
  on_ranks(world, [&](int r) {
    Net net = make_net(0);
    ddp::DistributedDataParallel model(net, {}, g.groups[r]);
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      for (int k = 0; k < micro; ++k) {
        Batch b = batch(r, s * micro + k);
        if (k + 1 < micro) {
          auto scope = model.no_sync();
          torch::nn::functional::cross_entropy(model(b.x), b.y).backward();
        } else {
          torch::nn::functional::cross_entropy(model(b.x), b.y).backward();
        }
      }
      opt.step();
    }
    for (auto& p : net->parameters()) result[r].push_back(p.detach().clone());
  });
  auto want = local_training(world, steps, micro);
  for (int r = 0; r < world; ++r) expect_close(result[r], want);
}

TEST_CASE(
    "ddp: an unused parameter fails the backward by name, or is skipped with "
    "find_unused_parameters") {
  const int world = 2;
  {
    Groups g(world);
    std::vector<std::string> errors(world);
    on_ranks(world, [&](int r) {
      Net net = make_net(0, /*with_unused=*/true);
      ddp::DistributedDataParallel model(net, {}, g.groups[r]);
      Batch b = batch(r, 0);
      errors[r] =
          error_of([&] { torch::nn::functional::cross_entropy(model(b.x), b.y).backward(); });
    });
    for (const auto& e : errors) {
      CHECK(e.find("parameters 'unused.weight', 'unused.bias' got no gradient in this backward") !=
            std::string::npos);
      CHECK(e.find("find_unused_parameters = true") != std::string::npos);
    }
  }
  Groups g(world);
  std::vector<std::vector<at::Tensor>> result(world);
  on_ranks(world, [&](int r) {
    Net net = make_net(0, true);
    ddp::DDPOptions o;
    o.find_unused_parameters = true;
    o.bucket_cap_mb = o.first_bucket_mb = 1e-6;
    ddp::DistributedDataParallel model(net, o, g.groups[r]);
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      Batch b = batch(r, s);
      torch::nn::functional::cross_entropy(model(b.x), b.y).backward();
      // No rank used it: it keeps no gradient, as in PyTorch.
      CHECK_FALSE(net->unused->weight.grad().defined());
      opt.step();
    }
    for (auto& p : net->parameters()) result[r].push_back(p.detach().clone());
  });
  auto want = local_training(world, 3, 1, /*with_unused=*/true);
  for (int r = 0; r < world; ++r) expect_close(result[r], want);
}

TEST_CASE("ddp: ranks whose models differ fail at construction naming the parameter and ranks") {
  Groups g(2);
  std::vector<std::string> errors(2);
  on_ranks(2, [&](int r) {
    Net net = make_net(0, false, r == 0 ? 8 : 9);
    errors[r] = error_of([&] { ddp::DistributedDataParallel model(net, {}, g.groups[r]); });
  });
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e.find("the ranks' models differ at parameter #0: rank 0 has 'fc1.weight' [8, 5] Float, "
                 "rank 1 has 'fc1.weight' [9, 5] Float") != std::string::npos);
  }
}

TEST_CASE("ddp: a rank that stops taking part fails the others' backward within the timeout") {
  Groups g(2, 2s);
  Net net = make_net(0);
  std::string err;
  on_ranks(2, [&](int r) {
    Net mine = make_net(0);
    ddp::DDPOptions o;
    o.timeout = 500ms;
    ddp::DistributedDataParallel model(mine, o, g.groups[r]);
    if (r == 1) return;  // never runs a step
    Batch b = batch(0, 0);
    auto t0 = std::chrono::steady_clock::now();
    err = error_of([&] { torch::nn::functional::cross_entropy(model(b.x), b.y).backward(); });
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  });
  CHECK(err.find("all_reduce(sum) on rank 0 of 2 failed (timeout 500 ms)") != std::string::npos);
}

TEST_CASE("ddp: bad DistributedDataParallel arguments are refused") {
  Groups g(1);
  Net net = make_net(0);
  ddp::DDPOptions o;
  o.bucket_cap_mb = 0;
  CHECK(error_of([&] {
          ddp::DistributedDataParallel m(net, o, g.groups[0]);
        }).find("bucket_cap_mb and first_bucket_mb must be > 0") != std::string::npos);
  for (auto& p : net->parameters()) p.set_requires_grad(false);
  CHECK(error_of([&] {
          ddp::DistributedDataParallel m(net, {}, g.groups[0]);
        }).find("no parameter that requires grad") != std::string::npos);
  CHECK(error_of([&] { ddp::DistributedDataParallel m(net); }).find("init_process_group") !=
        std::string::npos);
}

TEST_CASE("ddp: device_ids: one device per process, and the model must be on it") {
  Groups g(1);
  Net net = make_net(0);
  auto with = [](std::vector<int> ids) {
    ddp::DDPOptions o;
    o.device_ids = std::move(ids);
    return o;
  };
  CHECK(error_of([&] {
          ddp::DistributedDataParallel m(net, with({0, 1}), g.groups[0]);
        }) ==
        "DistributedDataParallel: device_ids names 2 devices; each process drives one "
        "(device_ids = {local_rank})");
  CHECK(error_of([&] { ddp::DistributedDataParallel m(net, with({-1}), g.groups[0]); }) ==
        "DistributedDataParallel: device_ids = {-1} is not a CUDA device index");
  // The model is on the CPU: device_ids = {0} names cuda:0.
  CHECK(error_of([&] { ddp::DistributedDataParallel m(net, with({0}), g.groups[0]); }) ==
        "DistributedDataParallel: parameter 'fc1.weight' is on cpu, but device_ids names cuda:0 "
        "(move the model there first: model->to(device))");
  // Buffers are checked too (a meta buffer stands for one on another device).
  {
    Net odd = make_net(0);
    odd->register_buffer("stray", at::empty({2}, at::TensorOptions().device(at::kMeta)));
    CHECK(error_of([&] { ddp::DistributedDataParallel m(odd, {}, g.groups[0]); }) ==
          "DistributedDataParallel: buffer 'stray' is on meta; a gloo group takes CPU tensors "
          "(nccl takes CUDA ones)");
  }
  // Without device_ids, a gloo group takes the CPU model, and forward takes
  // its arguments as they are.
  ddp::DistributedDataParallel m(net, {}, g.groups[0]);
  Batch b = batch(0, 0);
  CHECK(at::equal(m(b.x), net->forward(b.x)));
}

TEST_CASE("ddp: nccl with device_ids = {0} trains on the GPU as one process does (world size 1)") {
  if (!ddp::nccl_available()) {
    std::printf("skipped: no NCCL in this build (this test runs on GPU machines)\n");
    return;
  }
  if (!test::cuda_or_skip()) return;
  const c10::Device gpu(c10::kCUDA, 0);
  // NCCL keeps some things for the process once it has run (its proxy,
  // NVML's device files): a first group, started and shut down, counts
  // for the process; what a group holds of its own must go with it.
  test::process_lifetime([&] {
    Groups g(1, std::chrono::seconds(20), "nccl");
    at::Tensor t = at::ones({1}, at::TensorOptions().device(gpu));
    g[0].all_reduce(t);
  });
  std::vector<at::Tensor> got;
  {
    Groups g(1, std::chrono::seconds(20), "nccl");
    Net net = make_net(0);
    net->to(gpu);
    ddp::DDPOptions o;
    o.device_ids = {0};
    ddp::DistributedDataParallel model(net, o, g.groups[0]);
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      Batch b = batch(0, s);  // on the CPU: forward moves it to cuda:0
      auto out = model(b.x);
      CHECK(out.device() == gpu);
      torch::nn::functional::cross_entropy(out, b.y.to(gpu)).backward();
      opt.step();
    }
    for (auto& p : net->parameters()) got.push_back(p.detach().cpu());
    // A CPU tensor in an nccl group is refused by name.
    Net cpu_net = make_net(0);
    CHECK(error_of([&] { ddp::DistributedDataParallel m(cpu_net, {}, g.groups[0]); }) ==
          "DistributedDataParallel: parameter 'fc1.weight' is on cpu; an nccl group takes CUDA "
          "tensors (gloo takes CPU ones)");
  }
  expect_close(got, local_training(1, 3, 1), 1e-4, 1e-5);
}

TEST_CASE("ddp: buckets fill as PyTorch's do: the parameter that crosses the cap stays in") {
  // Reverse order: fc2.bias (12 bytes), fc2.weight (96), fc1.bias (32), fc1.weight (160).
  Groups g(1);
  Net net = make_net(0);
  ddp::DDPOptions o;
  o.first_bucket_mb = 50.0 / (1024 * 1024);  // crossed by fc2.weight
  o.bucket_cap_mb = 100.0 / (1024 * 1024);   // crossed by fc1.weight
  ddp::DistributedDataParallel model(net, o, g.groups[0]);
  auto stats = model.reducer().stats();
  CHECK(stats.buckets == 2u);
  CHECK(stats.bucket_params == std::vector<std::vector<size_t>>{{3, 2}, {1, 0}});
  CHECK(stats.bucket_bytes == std::vector<size_t>{108, 192});
}

TEST_CASE("ddp: communication hooks: fp16 and bf16 compression, and a hook of the user's") {
  const int world = 2, steps = 3;
  auto want = local_training(world, steps, 1);
  ddp::DDPOptions o;
  o.bucket_cap_mb = o.first_bucket_mb = 1e-6;  // a hook call per parameter
  // float16 keeps 11 significant bits: three steps stay within 1e-3.
  o.comm_hook = ddp::fp16_compress_hook();
  auto fp16 = ddp_training(world, steps, o);
  for (int r = 0; r < world; ++r) {
    expect_close(fp16[r], want, 1e-3, 1e-3);
    expect_close(fp16[r], fp16[0], 0, 0);  // every replica the same
  }
  // bfloat16 keeps 8: within 1e-2.
  o.comm_hook = ddp::bf16_compress_hook();
  std::string bf16_error;
  std::vector<std::vector<at::Tensor>> bf16;
  try {
    bf16 = ddp_training(world, steps, o);
  } catch (const std::exception& e) {
    bf16_error = e.what();
  }
  if (bf16_error.empty()) {
    MESSAGE("bf16 compression: Gloo sums bfloat16 here");
    for (int r = 0; r < world; ++r) expect_close(bf16[r], want, 1e-2, 1e-2);
  } else {
    // Gloo in LibTorch 1.x has no bfloat16 sum: the error says so.
    INFO(bf16_error);
    CHECK(bf16_error.find("Gloo in LibTorch 1.x cannot sum bfloat16") != std::string::npos);
    CHECK(TORCH_VERSION_MAJOR < 2);
  }

  // A user's hook: counted, then the default's work.
  std::atomic<int> calls{0};
  o.comm_hook = [&calls, inner = ddp::allreduce_hook()](ddp::ProcessGroup& g, at::Tensor& bucket) {
    ++calls;
    return inner(g, bucket);
  };
  auto user = ddp_training(world, steps, o);
  for (int r = 0; r < world; ++r) expect_close(user[r], want);
  CHECK(calls.load() == world * steps * 4);  // 4 buckets a step on each rank

  // A hook that starts nothing fails the backward, naming the hook.
  o.comm_hook = [](ddp::ProcessGroup&, at::Tensor&) { return ddp::BucketWork{}; };
  CHECK(error_of([&] { ddp_training(1, 1, o); }).find("the communication hook started nothing") !=
        std::string::npos);
}

TEST_CASE("ddp: a backward that fails midway leaves the next step working") {
  Groups g(1);
  Net net = make_net(0);
  ddp::DistributedDataParallel model(net, {}, g.groups[0]);
  Batch b = batch(0, 0);
  // A gradient hook of the user's that throws ends this backward early.
  auto handle = net->fc1->weight.register_hook(
      [](at::Tensor) -> at::Tensor { throw std::runtime_error("user hook failed"); });
  CHECK(error_of([&] {
          torch::nn::functional::cross_entropy(model(b.x), b.y).backward();
        }).find("user hook failed") != std::string::npos);
  net->fc1->weight.remove_hook(handle);
  net->zero_grad();
  torch::nn::functional::cross_entropy(model(b.x), b.y).backward();
  Net local = make_net(0);
  torch::nn::functional::cross_entropy(local->forward(b.x), b.y).backward();
  auto mine = net->parameters(), theirs = local->parameters();
  for (size_t i = 0; i < mine.size(); ++i) CHECK(at::allclose(mine[i].grad(), theirs[i].grad()));
}

TEST_CASE("ddp: uneven inputs under join() end as PyTorch's join: zeros from ranks that ran out") {
  for (bool find_unused : {false, true}) {
    const std::vector<int> batches = {3, 1, 4};  // per rank
    const int world = 3, longest = 4;
    INFO("find_unused_parameters " << find_unused);
    // The reference: each step averages the gradients of the ranks still
    // training over the whole group.
    Net local = make_net(0);
    torch::optim::SGD ref(local->parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < longest; ++s) {
      ref.zero_grad();
      for (int r = 0; r < world; ++r) {
        if (s < batches[r]) loss_of(local, batch(r, s));
      }
      for (auto& p : local->parameters()) p.mutable_grad().div_(world);
      ref.step();
    }
    std::vector<at::Tensor> want;
    for (auto& p : local->parameters()) want.push_back(p.detach().clone());

    Groups g(world);
    std::vector<std::vector<at::Tensor>> result(world);
    on_ranks(world, [&](int r) {
      Net net = make_net(0);
      ddp::DDPOptions o;
      o.find_unused_parameters = find_unused;
      o.bucket_cap_mb = o.first_bucket_mb = 1e-6;
      ddp::DistributedDataParallel model(net, o, g.groups[r]);
      torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
      auto join = model.join();
      for (int s = 0; s < batches[r]; ++s) {
        opt.zero_grad();
        Batch b = batch(r, s);
        torch::nn::functional::cross_entropy(model(b.x), b.y).backward();
        opt.step();
      }
      join.end();
      for (auto& p : net->parameters()) result[r].push_back(p.detach().clone());
    });
    for (int r = 0; r < world; ++r) {
      INFO("rank " << r);
      expect_close(result[r], want);
    }
  }
}

TEST_CASE("ddp: with TANDEM_TRACE each bucket's allreduce is a span on the timeline") {
  test::TempDir dir;
  ::setenv("TANDEM_TRACE", dir.path.c_str(), 1);
  {
    Groups g(2);
    on_ranks(2, [&](int r) {
      Net net = make_net(0);
      ddp::DDPOptions o;
      o.bucket_cap_mb = o.first_bucket_mb = 1e-6;  // a bucket per parameter
      ddp::DistributedDataParallel model(net, o, g.groups[r]);
      for (int s = 0; s < 2; ++s) {
        Batch b = batch(r, s);
        torch::nn::functional::cross_entropy(model(b.x), b.y).backward();
      }
    });
  }
  ::unsetenv("TANDEM_TRACE");
  // Each rank's file was written when its DDP let go of the tracer.
  std::vector<std::vector<test::TraceEvent>> spans;
  for (int r = 0; r < 2; ++r) {
    const std::string path = dir.file("tandem-trace-rank" + std::to_string(r) + ".json");
    test::Trace t = test::read_trace(path);
    REQUIRE(t.ok);
    CHECK(test::valid_json(path));
    spans.push_back(t.spans("allreduce", r));
    REQUIRE(spans.back().size() == 8);  // 4 buckets, 2 backwards
    for (const auto& s : spans.back()) {
      CHECK(s.cat == "ddp.bucket");
      CHECK(s.line.find("\"bytes\":") != std::string::npos);
    }
  }
  // An allreduce is collective: the two ranks' spans of one bucket overlap.
  for (size_t i = 0; i < 8; ++i) {
    CAPTURE(i);
    CHECK(spans[0][i].ts <= spans[1][i].end());
    CHECK(spans[1][i].ts <= spans[0][i].end());
  }
}
