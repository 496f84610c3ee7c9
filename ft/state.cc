// ft::module_state (ft/manager.h): a module's and its optimizer's state as
// named tensors, for healing and the fingerprint.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstring>
#include <map>
#include <stdexcept>

#include "tandem/ft/manager.h"
#include "tandem/optim/param_state.h"

namespace tandem::ft {

namespace {

at::Tensor bytes_tensor(const std::string& s) {
  at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

std::string tensor_bytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

}  // namespace

State module_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  torch::nn::Module* m = &module;
  torch::optim::Optimizer* opt = &optimizer;
  State s;
  s.model = [m] {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& p : m->named_parameters(true)) out.emplace_back("param/" + p.key(), p.value());
    for (const auto& b : m->named_buffers(true)) out.emplace_back("buffer/" + b.key(), b.value());
    return out;
  };
  s.save = [m, opt, model = s.model] {
    auto out = model();
    for (const auto& p : m->named_parameters(true)) {
      out.emplace_back("optim/" + p.key(), bytes_tensor(optim::param_state_bytes(*opt, p.value())));
    }
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace_back("rng/cpu", gen.get_state());
    return out;
  };
  s.load = [m, opt](const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
    std::map<std::string, at::Tensor> by_name(tensors.begin(), tensors.end());
    auto take = [&](const std::string& name) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        throw std::invalid_argument("ft::module_state: the state received has no '" + name + "'");
      }
      return it->second;
    };
    at::NoGradGuard no_grad;
    for (auto& p : m->named_parameters(true)) {
      const at::Tensor t = take("param/" + p.key());
      if (!t.sizes().equals(p.value().sizes())) {
        throw std::invalid_argument("ft::module_state: '" + p.key() +
                                    "' received with another shape");
      }
      p.value().copy_(t);
    }
    for (auto& b : m->named_buffers(true)) b.value().copy_(take("buffer/" + b.key()));
    for (auto& p : m->named_parameters(true)) {
      optim::load_param_state(*opt, p.value(), tensor_bytes(take("optim/" + p.key())));
    }
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(take("rng/cpu"));
  };
  return s;
}

}  // namespace tandem::ft
