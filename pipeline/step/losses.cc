#include "tandem/pipeline/step/losses.h"

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/mse_loss.h>

#include <map>
#include <mutex>
#include <stdexcept>

namespace tandem::pipeline {

namespace {

std::mutex g_losses_mu;
std::map<std::string, LossFn>& losses() {
  static std::map<std::string, LossFn> all = {
      {"cross_entropy",
       [](const at::Tensor& out, const at::Tensor& target) {
         return at::cross_entropy_loss(out, target);
       }},
      {"mse",
       [](const at::Tensor& out, const at::Tensor& target) { return at::mse_loss(out, target); }}};
  return all;
}

}  // namespace

void register_loss(const std::string& name, LossFn fn) {
  std::lock_guard<std::mutex> lock(g_losses_mu);
  if (!losses().emplace(name, std::move(fn)).second) {
    throw std::invalid_argument("pipeline loss '" + name + "' is registered already");
  }
}

LossFn step::loss_named(const std::string& name, const std::string& where) {
  std::lock_guard<std::mutex> lock(g_losses_mu);
  auto it = losses().find(name);
  if (it == losses().end()) {
    std::string known;
    for (const auto& [n, _] : losses()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("no pipeline loss '" + name + "' on " + where +
                                " (known: " + known + "; pipeline::register_loss adds one)");
  }
  return it->second;
}

}  // namespace tandem::pipeline
