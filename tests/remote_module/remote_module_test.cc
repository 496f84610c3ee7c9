// RemoteModule: modules built (or loaded from TorchScript) on their owner
// compute what the same modules compute locally, train across workers to
// the parameters local training gives, refuse bad input clearly while the
// owner keeps serving, and go when their last reference does.
#include "tandem/remote_module/remote_module.h"

#include <ATen/Context.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "test_util.h"

using namespace tandem;
using test::World;
namespace dist = tandem::autograd;
using nn::RemoteModule;
using nn::spec;

namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);
const std::string kScript = std::string(TANDEM_TEST_DATA) + "/scripted_mlp.pt";

// The C++ twin of data/scripted_mlp.pt, registered as a user's module.
struct ScriptTwinImpl : torch::nn::Module {
  ScriptTwinImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  at::Tensor forward(at::Tensor x) { return fc2(at::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

const bool kTwin = [] {
  nn::register_module("ScriptTwin", [] { return std::make_shared<ScriptTwinImpl>(); });
  return true;
}();

void define(rpc::Registry& r) {
  (void)kTwin;
  // A user's function on a module the caller holds an RRef to.
  r.def("out_features", [](c10::IValue module) {
    auto linear = nn::local_module<torch::nn::LinearImpl>(module);
    if (!linear) throw std::invalid_argument("not a Linear");
    return linear->options.out_features();
  });
  // Uses a module it was handed, as a third worker would.
  r.def("apply", [](rpc::RRef<c10::IValue> module, at::Tensor x) {
    return RemoteModule(std::move(module)).forward(x);
  });
}

// Loads a local module's state into a remote one (so both start equal).
void copy_into(const RemoteModule& remote, torch::nn::Module& local) {
  RemoteModule::StateDict state;
  for (const auto& p : local.named_parameters()) state[p.key()] = p.value().detach();
  for (const auto& b : local.named_buffers()) state[b.key()] = b.value().detach();
  remote.load_state_dict(state);
}

// Each remote parameter equals the local one of the same name.
void check_same(const RemoteModule& remote, torch::nn::Module& local, double rtol = 1e-5) {
  auto state = remote.state_dict();
  auto params = local.named_parameters();
  CHECK(state.size() == params.size() + local.named_buffers().size());
  for (const auto& p : params) {
    CAPTURE(p.key());
    REQUIRE(state.count(p.key()));
    CHECK(at::allclose(state.at(p.key()), p.value(), rtol, 1e-8));
  }
}

}  // namespace

TEST_CASE("nn: remote devices parse, and bad ones are refused naming the form") {
  auto d = nn::RemoteDevice::parse("worker1/cpu");
  CHECK(d.worker == "worker1");
  CHECK(d.rank == -1);
  CHECK(d.device.is_cpu());
  d = nn::RemoteDevice::parse("rank:2/cuda:1");
  CHECK(d.rank == 2);
  CHECK(d.worker.empty());
  CHECK(d.device == c10::Device(c10::kCUDA, 1));
  CHECK(d.str() == "rank:2/cuda:1");
  CHECK(nn::RemoteDevice::parse("trainer").device.is_cpu());
  for (const char* bad : {"", "/cpu", "rank:x/cpu", "rank:/cpu", "worker1/gpu", "worker1/cuda:z"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(nn::RemoteDevice::parse(bad), doctest::Contains("bad remote device"),
                         std::invalid_argument);
  }
}

TEST_CASE("nn: each built-in module computes on its owner what it computes locally") {
  World w(2, define);
  at::manual_seed(1);
  {  // Linear, by rank; forward and forward_async
    RemoteModule fc(w[0], "rank:1/cpu", "Linear", {4, 3});
    CHECK(fc.owner().name == "worker1");
    torch::nn::Linear local(4, 3);
    copy_into(fc, *local);
    at::Tensor x = at::randn({5, 4});
    CHECK(at::allclose(fc.forward(x), local(x)));
    CHECK(at::allclose(fc.forward_async(x).wait(), local(x)));
    check_same(fc, *local);
    auto params = fc.remote_parameters();
    REQUIRE(params.size() == 2);
    CHECK(params[0].owner().name == "worker1");
    CHECK(at::equal(params[0].to_here(), local->weight.detach()));
    CHECK(at::equal(params[1].to_here(), local->bias.detach()));
    // A user's function sees the module itself.
    CHECK(fc.get_module_rref().rpc_sync<int64_t>("out_features") == 3);
  }
  {  // LSTM: a tuple (h, c) in and out, and the state left out
    RemoteModule lstm(w[0], "worker1/cpu", "LSTM", {3, 5, 2});
    torch::nn::LSTM local(torch::nn::LSTMOptions(3, 5).num_layers(2));
    copy_into(lstm, *local);
    at::Tensor x = at::randn({4, 2, 3});
    using Out = std::tuple<at::Tensor, std::tuple<at::Tensor, at::Tensor>>;
    auto [y, hc] = lstm.forward<Out>(x);
    auto [ly, lhc] = local(x);
    CHECK(at::allclose(y, ly));
    CHECK(at::allclose(std::get<1>(hc), std::get<1>(lhc)));
    auto [y2, hc2] = lstm.forward<Out>(x, hc);
    auto [ly2, lhc2] = local(x, lhc);
    CHECK(at::allclose(y2, ly2));
    CHECK(at::allclose(std::get<0>(hc2), std::get<0>(lhc2)));
  }
  {  // GRU, EmbeddingBag with offsets, Embedding, Conv2d, LayerNorm
    RemoteModule gru(w[0], "worker1/cpu", "GRU", {3, 4});
    torch::nn::GRU lgru(3, 4);
    copy_into(gru, *lgru);
    at::Tensor x = at::randn({2, 3, 3});
    CHECK(at::allclose(std::get<0>(gru.forward<std::tuple<at::Tensor, at::Tensor>>(x)),
                       std::get<0>(lgru(x))));

    RemoteModule bag(w[0], "worker1/cpu", "EmbeddingBag", {10, 4, "sum"});
    torch::nn::EmbeddingBag lbag(torch::nn::EmbeddingBagOptions(10, 4).mode(torch::kSum));
    copy_into(bag, *lbag);
    at::Tensor ids = at::tensor({1, 2, 4, 5, 4, 3, 2, 9}, at::kLong);
    at::Tensor offsets = at::tensor({0, 4}, at::kLong);
    CHECK(at::allclose(bag.forward(ids, offsets), lbag(ids, offsets)));

    RemoteModule emb(w[0], "worker1/cpu", "Embedding", {10, 3});
    torch::nn::Embedding lemb(10, 3);
    copy_into(emb, *lemb);
    CHECK(at::allclose(emb.forward(ids), lemb(ids)));

    RemoteModule conv(w[0], "worker1/cpu", "Conv2d", {2, 3, 3, 1, 1});
    torch::nn::Conv2d lconv(torch::nn::Conv2dOptions(2, 3, 3).stride(1).padding(1));
    copy_into(conv, *lconv);
    at::Tensor img = at::randn({1, 2, 5, 5});
    CHECK(at::allclose(conv.forward(img), lconv(img), 1e-5, 1e-6));

    RemoteModule norm(w[0], "worker1/cpu", "LayerNorm", {std::vector<int64_t>{3}});
    torch::nn::LayerNorm lnorm(torch::nn::LayerNormOptions({3}));
    copy_into(norm, *lnorm);
    CHECK(at::allclose(norm.forward(x), lnorm(x), 1e-5, 1e-6));
  }
  {  // Dropout: train() and eval() reach the owner
    RemoteModule drop(w[0], "worker1/cpu", "Dropout", {0.5});
    at::Tensor ones = at::ones({1000});
    CHECK(drop.is_training());
    CHECK_FALSE(at::equal(drop.forward(ones), ones));
    drop.eval();
    CHECK_FALSE(drop.is_training());
    CHECK(at::equal(drop.forward(ones), ones));
    drop.train();
    CHECK(drop.is_training());
  }
  {  // Sequential: children named "0", "1", ... as in PyTorch
    RemoteModule seq(w[0], "worker1/cpu", "Sequential",
                     {nn::list({spec("Linear", {4, 6}), spec("ReLU"), spec("Linear", {6, 2})})});
    torch::nn::Sequential local(torch::nn::Linear(4, 6), torch::nn::ReLU(),
                                torch::nn::Linear(6, 2));
    copy_into(seq, *local);
    auto state = seq.state_dict();
    CHECK(state.count("0.weight"));
    CHECK(state.count("2.bias"));
    at::Tensor x = at::randn({3, 4});
    CHECK(at::allclose(seq.forward(x), local->forward(x)));
  }
  w.shutdown();
}

TEST_CASE("nn: a model split over RemoteModules trains to the parameters local training gives") {
  World w(2, define);
  at::manual_seed(3);
  // The model of the bench, small: Linear-ReLU here, Linear-ReLU-Linear on worker1.
  torch::nn::Linear first(6, 8);
  torch::nn::Sequential rest(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 4));
  torch::nn::Linear ref_first(6, 8);
  torch::nn::Sequential ref_rest(torch::nn::Linear(8, 8), torch::nn::ReLU(),
                                 torch::nn::Linear(8, 4));
  {
    at::NoGradGuard g;
    for (auto [from, to] :
         {std::pair<torch::nn::Module*, torch::nn::Module*>{first.get(), ref_first.get()},
          {rest.get(), ref_rest.get()}}) {
      auto src = from->parameters();
      auto dst = to->parameters();
      for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    }
  }
  {
    RemoteModule remote(w[0], "worker1/cpu", "Sequential",
                        {nn::list({spec("Linear", {8, 8}), spec("ReLU"), spec("Linear", {8, 4})})});
    copy_into(remote, *rest);
    std::vector<rpc::RRef<at::Tensor>> params;
    for (auto& p : first->parameters())
      params.push_back(rpc::RRef<at::Tensor>::make_local(w[0], p));
    for (auto& p : remote.remote_parameters()) params.push_back(p);
    optim::Options o;
    o.lr = 0.05;
    o.momentum = 0.9;
    optim::DistributedOptimizer opt(w[0], optim::Kind::kSGD, params, o);
    std::vector<at::Tensor> ref_params = ref_first->parameters();
    for (auto& p : ref_rest->parameters()) ref_params.push_back(p);
    torch::optim::SGD ref_opt(ref_params, torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 6; ++step) {
      at::manual_seed(50 + step);
      at::Tensor x = at::randn({5, 6});
      at::Tensor y = at::randint(0, 4, {5}, at::kLong);
      {
        dist::Context ctx(w[0]);
        at::Tensor out = remote.forward(at::relu(first(x)));
        dist::backward(w[0], ctx.id(), {torch::nn::functional::cross_entropy(out, y)});
        opt.step(ctx.id());
      }
      ref_opt.zero_grad();
      torch::nn::functional::cross_entropy(ref_rest->forward(at::relu(ref_first(x))), y).backward();
      ref_opt.step();
    }
    check_same(remote, *ref_rest);
    CHECK(at::allclose(first->weight, ref_first->weight, 1e-5, 1e-8));
    // They did train: the remote part moved away from where it started.
    CHECK_FALSE(
        at::allclose(remote.state_dict().at("0.weight"), rest[0]->as<torch::nn::Linear>()->weight));
  }
  w.shutdown();
}

TEST_CASE("nn: a TorchScript module trains like the same module built in C++") {
  World w(2, define);
  {
    auto scripted = RemoteModule::from_torchscript(w[0], "worker1/cpu", kScript);
    RemoteModule twin(w[0], "worker1/cpu", "ScriptTwin");
    auto state = scripted.state_dict();
    CHECK(state.size() == 4);
    CHECK(state.count("fc2.bias"));
    twin.load_state_dict(state);
    auto local = std::make_shared<ScriptTwinImpl>();
    {
      at::NoGradGuard g;
      for (auto& p : local->named_parameters()) p.value().copy_(state.at(p.key()));
    }
    at::Tensor x = at::randn({5, 4});
    CHECK(at::allclose(scripted.forward(x), local->forward(x), 1e-5, 1e-6));

    auto params = scripted.remote_parameters();
    CHECK(params.size() == 4);
    auto twin_params = twin.remote_parameters();
    params.insert(params.end(), twin_params.begin(), twin_params.end());
    optim::Options o;
    o.lr = 0.01;
    {
      optim::DistributedOptimizer opt(w[0], optim::Kind::kAdam, params, o);
      torch::optim::Adam ref(local->parameters(), torch::optim::AdamOptions(0.01));
      for (int step = 0; step < 5; ++step) {
        at::manual_seed(70 + step);
        at::Tensor xs = at::randn({6, 4});
        {
          dist::Context ctx(w[0]);
          at::Tensor loss = scripted.forward(xs).pow(2).sum() + twin.forward(xs).pow(2).sum();
          dist::backward(w[0], ctx.id(), {loss});
          opt.step(ctx.id());
        }
        ref.zero_grad();
        local->forward(xs).pow(2).sum().backward();
        ref.step();
      }
    }
    params.clear();
    twin_params.clear();
    check_same(scripted, *local);
    check_same(twin, *local);
  }
  w.shutdown();
}

TEST_CASE("nn: bad input is refused naming what was wrong, and the owner keeps serving") {
  int gpus = 0;  // (asking starts CUDA's driver where there is one: not this case's leak)
  test::process_lifetime([&] { gpus = at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0; });
  World w(2, define);
  {
    auto refused = [&](const std::function<void()>& f, const std::string& says) {
      CAPTURE(says);
      CHECK_THROWS_WITH(f(), doctest::Contains(says.c_str()));
      // The owner still serves.
      RemoteModule ok(w[0], "worker1/cpu", "Linear", {2, 2});
      CHECK(ok.forward(at::ones({1, 2})).sizes() == at::IntArrayRef{1, 2});
    };
    refused(
        [&] {
          RemoteModule(w[0], "worker1/cpu", "Linaer", {2, 2});
        },
        "no module factory 'Linaer'");
    refused([&] { RemoteModule(w[0], "worker1/cpu", "Linear", {2}); },
            "argument 2 (out_features) is missing");
    refused(
        [&] {
          RemoteModule(w[0], "worker1/cpu", "Linear", {"two", 2});
        },
        "expected int, got String");
    refused(
        [&] {
          RemoteModule(w[0], "worker1/cpu", "Linear", {2, -1});
        },
        "out_features must be positive");
    refused(
        [&] {
          RemoteModule(w[0], "worker1/cpu", "EmbeddingBag", {4, 2, "median"});
        },
        "mode 'median'");
    refused([&] { RemoteModule(w[0], "worker1/cpu", "ScriptTwin", {1}); },
            "module 'ScriptTwin' takes 0 argument(s), got 1");
    // A device one past the last: cuda:0 here, cuda:1 on a machine with one GPU.
    const std::string missing = "cuda:" + std::to_string(gpus);
    refused(
        [&] {
          RemoteModule(w[0], "worker1/" + missing, "Linear", {2, 2});
        },
        "worker1 has no device " + missing);
    refused([&] { RemoteModule(w[0], "worker7/cpu", "Linear", {2, 2}); }, "worker7");
    refused([&] { RemoteModule::from_torchscript(w[0], "worker1/cpu", "/nonexistent/model.pt"); },
            "'/nonexistent/model.pt' cannot be read on worker1");
    const std::string corrupt = "/tmp/tandem_corrupt_" + std::to_string(getpid()) + ".pt";
    std::ofstream(corrupt) << "this is not a TorchScript archive";
    refused([&] { RemoteModule::from_torchscript(w[0], "worker1/cpu", corrupt); },
            "is not a TorchScript module");
    std::remove(corrupt.c_str());

    RemoteModule fc(w[0], "worker1/cpu", "Linear", {3, 2});
    refused(
        [&] {
          fc.forward(at::ones({1, 3}), at::ones({1}));
        },
        "takes at most 1 argument(s), got 2");
    refused([&] { fc.forward(int64_t(3)); },
            "argument 1 of forward of Linear: expected Tensor, got Int");
    refused([&] { fc.forward(at::ones({1, 5})); }, "mat1 and mat2 shapes cannot be multiplied");
    refused([&] { fc.load_state_dict({{"weight", at::ones({2, 3})}}); }, "missing keys: bias");
    refused(
        [&] {
          fc.load_state_dict(
              {{"weight", at::ones({2, 3})}, {"bias", at::ones({2})}, {"extra", at::ones({1})}});
        },
        "unexpected keys: extra");
    auto before = fc.state_dict();
    refused(
        [&] {
          fc.load_state_dict({{"weight", at::ones({2, 3})}, {"bias", at::ones({3})}});
        },
        "size mismatch for bias");
    // A refused load changed nothing; a non-strict one loads what it names.
    CHECK(at::equal(fc.state_dict().at("weight"), before.at("weight")));
    fc.load_state_dict({{"weight", at::ones({2, 3})}}, /*strict=*/false);
    CHECK(at::equal(fc.state_dict().at("weight"), at::ones({2, 3})));
    CHECK(at::equal(fc.state_dict().at("bias"), before.at("bias")));
    // A module never leaves its owner.
    CHECK_THROWS_WITH(fc.get_module_rref().to_here(), doctest::Contains("Capsule"));
    auto scripted = RemoteModule::from_torchscript(w[0], "worker1/cpu", kScript);
    refused(
        [&] {
          scripted.forward(at::ones({2, 4}), at::ones({2}));
        },
        "forward of TorchScript module");
  }
  w.shutdown();
}

TEST_CASE(
    "nn: a module handed to a third worker serves it there, and goes with its last reference") {
  World w(3, define);
  {
    RemoteModule fc(w[0], "worker1/cpu", "Linear", {3, 2});
    at::Tensor x = at::randn({4, 3});
    at::Tensor here = fc.forward(x);
    // worker2 builds a RemoteModule from the RRef and runs it on worker1.
    at::Tensor there = w[0].rpc_sync<at::Tensor>("worker2", "apply", fc.get_module_rref(), x);
    CHECK(at::equal(here, there));
    // Differentiable through the hop, as any nested call.
    dist::Context ctx(w[0]);
    at::Tensor xg = x.clone().requires_grad_();
    at::Tensor y = w[0].rpc_sync<at::Tensor>("worker2", "apply", fc.get_module_rref(), xg);
    dist::backward(w[0], ctx.id(), {y.sum()});
    auto grads = dist::get_gradients(w[0], ctx.id());
    at::Tensor weight = fc.state_dict().at("weight");
    CHECK(at::allclose(grads.at(xg), weight.sum(0).expand({4, 3})));
  }
  // The module went with the RemoteModule: the owner holds nothing.
  CHECK(test::eventually([&] { return w[1].rrefs().owned_values() == 0; }));
  w.shutdown();
}

TEST_CASE("nn: a module on cuda:0 answers on the GPU where a device map goes, else on the CPU") {
  if (!test::cuda_or_skip()) return;
  // worker0 maps its cuda:0 to worker1's; worker2 has no map.
  World w(3, define, [](rpc::AgentOptions& o) {
    if (o.rank == 0) o.set_device_map("worker1", {{0, 0}});
  });
  {
    RemoteModule fc(w[0], "worker1/cuda:0", "Linear", {4, 3});
    torch::nn::Linear local(4, 3);
    copy_into(fc, *local);
    at::Tensor x = at::randn({5, 4});
    at::Tensor y = fc.forward(x);
    CHECK(y.device().is_cuda());
    CHECK(at::allclose(y.cpu(), local(x), 1e-4, 1e-5));
    // A CUDA input travels by the map too.
    CHECK(at::allclose(fc.forward(x.to(at::kCUDA)).cpu(), local(x), 1e-4, 1e-5));
    // Without a map, the answer comes by way of the CPU.
    RemoteModule from_2(w[2], "worker1/cuda:0", "Linear", {4, 3});
    CHECK(from_2.forward(x).device().is_cpu());
    auto params = fc.remote_parameters();
    CHECK(params[0].to_here().device().is_cuda());
    // Trains there: the gradient crosses back to the module's device and
    // to the GPU input's.
    dist::Context ctx(w[0]);
    at::Tensor xg = x.to(at::kCUDA).requires_grad_();
    dist::backward(w[0], ctx.id(), {fc.forward(xg).sum()});
    auto g = dist::get_gradients(w[0], ctx.id()).at(xg);
    CHECK(g.is_cuda());
    CHECK(at::allclose(g.cpu(), local->weight.detach().sum(0).expand({5, 4}), 1e-4, 1e-5));
  }
  w.shutdown();
}

TEST_CASE("nn: a RemoteModule that outlives its agent fails cleanly, and goes quietly") {
  World w(2, define);
  auto fc =
      std::make_unique<RemoteModule>(w[0], "worker1/cpu", "Linear", std::vector<c10::IValue>{2, 2});
  CHECK(fc->forward(at::ones({1, 2})).numel() == 2);
  // Alive at a graceful shutdown: reported like any RRef left behind.
  CHECK_THROWS_WITH(w.shutdown_unchecked(true), doctest::Contains("leak"));
  CHECK_THROWS_AS(fc->forward(at::ones({1, 2})), rpc::ShutdownError);
  fc.reset();  // after shutdown: nothing to tell the owner, nothing to crash
}
