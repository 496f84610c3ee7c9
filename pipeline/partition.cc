#include "tandem/pipeline/partition.h"

#include <ATen/ops/ones_like.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <stdexcept>

#include "tandem/remote_module/served.h"
#include "tandem/rpc/api.h"

namespace tandem::pipeline {

std::vector<nn::RemoteModule> partition(const std::vector<c10::IValue>& layers,
                                        const std::vector<std::string>& devices,
                                        const std::vector<int>& counts) {
  return partition(*rpc::current_agent(), layers, devices, counts);
}

std::vector<nn::RemoteModule> partition(rpc::Agent& agent, const std::vector<c10::IValue>& layers,
                                        const std::vector<std::string>& devices,
                                        const std::vector<int>& counts) {
  if (devices.size() != counts.size()) {
    throw std::invalid_argument("partition: " + std::to_string(counts.size()) +
                                " stage counts but " + std::to_string(devices.size()) + " devices");
  }
  size_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 1) {
      throw std::invalid_argument("partition: stage " + std::to_string(i) + " has " +
                                  std::to_string(counts[i]) + " layers; each needs at least 1");
    }
    total += static_cast<size_t>(counts[i]);
  }
  if (counts.empty() || total != layers.size()) {
    throw std::invalid_argument("partition: the counts add up to " + std::to_string(total) +
                                " layers, the model has " + std::to_string(layers.size()));
  }
  std::vector<nn::RemoteModule> stages;
  size_t next = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    std::vector<c10::IValue> run(layers.begin() + static_cast<std::ptrdiff_t>(next),
                                 layers.begin() + static_cast<std::ptrdiff_t>(next + counts[i]));
    next += static_cast<size_t>(counts[i]);
    stages.emplace_back(agent, devices[i], "Sequential",
                        std::vector<c10::IValue>{nn::list(std::move(run))});
  }
  return stages;
}

std::vector<int> balance(const std::vector<double>& costs, int stages) {
  const int n = static_cast<int>(costs.size());
  if (stages < 1 || stages > n) {
    throw std::invalid_argument("balance: " + std::to_string(stages) + " stages for " +
                                std::to_string(n) + " layers (each stage needs a layer)");
  }
  for (double c : costs) {
    if (!(c >= 0)) throw std::invalid_argument("balance: costs must be >= 0");
  }
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  // best[k][i]: the smallest largest stage cost of the first i layers in k stages.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k) {
    for (int i = k; i <= n; ++i) {
      for (int j = k - 1; j < i; ++j) {  // the last stage takes layers j .. i - 1
        const double v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) {
          best[k][i] = v;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int> counts(stages);
  for (int k = stages, i = n; k >= 1; --k) {
    counts[k - 1] = i - cut[k][i];
    i = cut[k][i];
  }
  return counts;
}

namespace {

// Layer i of `layers`, built here by its factory. `who` begins the error.
std::shared_ptr<nn::Served> build_layer(const std::vector<c10::IValue>& layers, size_t i,
                                        const char* who) {
  const auto& l = layers[i];
  if (!l.isTuple() || l.toTupleRef().elements().size() != 2 ||
      !l.toTupleRef().elements()[0].isString() || !l.toTupleRef().elements()[1].isList()) {
    throw std::invalid_argument(std::string(who) + ": layer " + std::to_string(i) +
                                " is not an nn::spec(factory, args)");
  }
  const auto& e = l.toTupleRef().elements();
  auto list = e[1].toList();
  std::vector<c10::IValue> args(list.begin(), list.end());
  return nn::make_module(e[0].toStringRef(), args);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

std::vector<int> balance_by_parameters(const std::vector<c10::IValue>& layers, int stages) {
  std::vector<double> costs;
  for (size_t i = 0; i < layers.size(); ++i) {
    auto served = build_layer(layers, i, "balance_by_parameters");
    double count = 0;
    for (const auto& [_, p] : served->parameters()) count += static_cast<double>(p.numel());
    costs.push_back(count);
  }
  return balance(costs, stages);
}

std::vector<double> layer_times(const std::vector<c10::IValue>& layers, const at::Tensor& sample,
                                int repeats, c10::Device device) {
  if (repeats < 1) {
    throw std::invalid_argument("layer_times: repeats must be >= 1, not " +
                                std::to_string(repeats));
  }
  if (!sample.defined())
    throw std::invalid_argument("layer_times: the sample is an undefined tensor");
  std::vector<std::shared_ptr<nn::Served>> built;
  for (size_t i = 0; i < layers.size(); ++i) {
    built.push_back(build_layer(layers, i, "layer_times"));
    built.back()->to(device);
  }
  using Clock = std::chrono::steady_clock;
  auto us_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  };
  c10::AutoGradMode grad_on(true);
  std::vector<std::vector<double>> runs(layers.size());
  for (int r = 0; r < repeats + 1; ++r) {  // run 0 warms up
    at::Tensor x = sample.to(device);
    for (size_t i = 0; i < built.size(); ++i) {
      at::Tensor in = x.detach();
      // As in a Pipe: the model's input needs no gradient, a later layer's does.
      if (i > 0 && in.is_floating_point()) in.requires_grad_(true);
      std::vector<c10::IValue> args{in};
      auto t0 = Clock::now();
      c10::IValue out;
      try {
        out = built[i]->forward(args);
      } catch (const std::exception& e) {
        throw std::invalid_argument("layer_times: layer " + std::to_string(i) + " (" +
                                    built[i]->what + ") failed on its input of shape " +
                                    c10::str(in.sizes()) + ": " + e.what());
      }
      if (!out.isTensor()) {
        throw std::invalid_argument("layer_times: layer " + std::to_string(i) + " (" +
                                    built[i]->what + ") gave a " + out.tagKind() +
                                    ", not one tensor");
      }
      at::Tensor y = out.toTensor();
      // On a GPU the kernels run behind the launches: wait for them.
      auto sync = [&](const at::Tensor& t) {
        if (t.defined() && !t.device().is_cpu()) (void)t.sum().item<double>();
      };
      sync(y);
      double us = us_since(t0);
      std::vector<at::Tensor> wrt;
      for (auto& [_, p] : built[i]->parameters()) {
        if (p.requires_grad()) wrt.push_back(p);
      }
      if (in.requires_grad()) wrt.push_back(in);
      if (y.requires_grad() && !wrt.empty()) {
        t0 = Clock::now();
        auto grads = torch::autograd::grad({y}, wrt, {at::ones_like(y)}, /*retain_graph=*/false,
                                           /*create_graph=*/false, /*allow_unused=*/true);
        for (const auto& g : grads) sync(g);
        us += us_since(t0);
      }
      if (r > 0) runs[i].push_back(us);
      x = y.detach();
    }
  }
  std::vector<double> times;
  for (auto& r : runs) times.push_back(median(r));
  return times;
}

std::vector<int> balance_by_time(const std::vector<c10::IValue>& layers, int stages,
                                 const at::Tensor& sample, int repeats, c10::Device device) {
  if (stages < 1 || stages > static_cast<int>(layers.size())) {
    return balance(std::vector<double>(layers.size(), 0), stages);  // its error, before any work
  }
  return balance(layer_times(layers, sample, repeats, device), stages);
}

}  // namespace tandem::pipeline
