#include "tandem/pipeline/partition.h"

#include <algorithm>
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
    throw std::invalid_argument("partition: " + std::to_string(counts.size()) + " stage counts but " +
                                std::to_string(devices.size()) + " devices");
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

std::vector<int> balance_by_parameters(const std::vector<c10::IValue>& layers, int stages) {
  std::vector<double> costs;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& l = layers[i];
    if (!l.isTuple() || l.toTupleRef().elements().size() != 2 ||
        !l.toTupleRef().elements()[0].isString() || !l.toTupleRef().elements()[1].isList()) {
      throw std::invalid_argument("balance_by_parameters: layer " + std::to_string(i) +
                                  " is not an nn::spec(factory, args)");
    }
    const auto& e = l.toTupleRef().elements();
    auto list = e[1].toList();
    std::vector<c10::IValue> args(list.begin(), list.end());
    auto served = nn::make_module(e[0].toStringRef(), args);
    double count = 0;
    for (const auto& [_, p] : served->parameters()) count += static_cast<double>(p.numel());
    costs.push_back(count);
  }
  return balance(costs, stages);
}

}  // namespace tandem::pipeline
