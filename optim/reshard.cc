// reshard_state (optim/reshard.h): every saved part loaded into a LibTorch
// optimizer over stand-in tensors of the right shapes, each parameter's
// state moved by name into optimizers laid out as now, and those saved.
#include "tandem/optim/reshard.h"

#include <ATen/ops/zeros.h>
#include <c10/util/StringUtil.h>

#include <map>
#include <memory>
#include <set>
#include <stdexcept>

#include "tandem/optim/owner/local_optimizer.h"

namespace tandem::optim {

namespace {

std::string who(const OwnerLayout& o, size_t index) {
  return "part " + std::to_string(index) + " (rank " + std::to_string(o.rank) +
         (o.worker.empty() ? "" : ", " + o.worker) + ")";
}

std::vector<at::Tensor> stand_ins(const OwnerLayout& o, const std::string& what) {
  if (o.names.size() != o.shapes.size()) {
    throw std::invalid_argument("reshard_state: " + what + " gives " +
                                std::to_string(o.names.size()) + " names but " +
                                std::to_string(o.shapes.size()) + " shapes");
  }
  std::vector<at::Tensor> out;
  for (const auto& shape : o.shapes) out.push_back(at::zeros(shape));
  return out;
}

}  // namespace

OptimizerState reshard_state(const OptimizerState& state, const std::vector<OwnerLayout>& saved,
                             const std::vector<OwnerLayout>& now, const Options& options) {
  if (saved.size() != state.parts.size()) {
    throw std::invalid_argument("reshard_state: the checkpoint has " +
                                std::to_string(state.parts.size()) +
                                " parts, the saved layout names " + std::to_string(saved.size()));
  }
  Options o = options;
  o.lr = state.lr;
  // Each saved part, loaded; where each name's state is.
  struct Source {
    torch::optim::Optimizer* optimizer;
    at::Tensor param;
    std::string part;
  };
  std::vector<std::unique_ptr<torch::optim::Optimizer>> loaded;
  std::vector<std::vector<at::Tensor>> keep;  // the stand-ins the states are keyed by
  std::map<std::string, Source> by_name;
  for (size_t i = 0; i < saved.size(); ++i) {
    const std::string what = "the saved layout's " + who(saved[i], i);
    const auto& part = state.parts[i];
    if (part.rank != saved[i].rank) {
      throw std::invalid_argument("reshard_state: the checkpoint's part " + std::to_string(i) +
                                  " is rank " + std::to_string(part.rank) + "'s, " + what +
                                  " is another's");
    }
    if (static_cast<int64_t>(saved[i].names.size()) != part.num_params) {
      throw std::invalid_argument("reshard_state: " + what + " names " +
                                  std::to_string(saved[i].names.size()) +
                                  " parameters, the checkpoint's part " + std::to_string(i) +
                                  " steps " + std::to_string(part.num_params));
    }
    keep.push_back(stand_ins(saved[i], what));
    auto opt = owner::make_optimizer(state.kind, keep.back(), o);
    if (!part.bytes.empty()) {
      try {
        owner::load_state_bytes(*opt, part.bytes);
      } catch (const c10::Error& e) {
        throw std::invalid_argument("reshard_state: the checkpoint's part " + std::to_string(i) +
                                    " is not the state of " + kind_name(state.kind) +
                                    " over the parameters " + what +
                                    " names: " + e.what_without_backtrace());
      }
    }
    for (size_t j = 0; j < saved[i].names.size(); ++j) {
      const std::string& name = saved[i].names[j];
      if (!by_name.emplace(name, Source{opt.get(), keep.back()[j], what}).second) {
        throw std::invalid_argument("reshard_state: '" + name +
                                    "' is named twice in the saved layout");
      }
    }
    loaded.push_back(std::move(opt));
  }
  // The new parts: each name's state moved over whole.
  OptimizerState out;
  out.kind = state.kind;
  out.lr = state.lr;
  std::set<std::string> placed;
  for (size_t i = 0; i < now.size(); ++i) {
    const std::string what = "the new layout's " + who(now[i], i);
    std::vector<at::Tensor> params = stand_ins(now[i], what);
    auto opt = owner::make_optimizer(state.kind, params, o);
    for (size_t j = 0; j < now[i].names.size(); ++j) {
      const std::string& name = now[i].names[j];
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        throw std::invalid_argument("reshard_state: " + what + " holds '" + name +
                                    "', which the checkpoint has no state for");
      }
      if (!placed.insert(name).second) {
        throw std::invalid_argument("reshard_state: '" + name +
                                    "' is named twice in the new layout");
      }
      if (!it->second.param.sizes().equals(params[j].sizes())) {
        throw std::invalid_argument("reshard_state: '" + name + "' is " +
                                    c10::str(params[j].sizes()) + " in " + what + ", " +
                                    c10::str(it->second.param.sizes()) + " in the checkpoint");
      }
      owner::move_state(*it->second.optimizer, *opt, it->second.param, params[j]);
    }
    OptimizerState::Part p;
    p.rank = now[i].rank;
    p.worker = now[i].worker;
    p.num_params = static_cast<int64_t>(params.size());
    p.bytes = owner::state_bytes(*opt);
    out.parts.push_back(std::move(p));
  }
  for (const auto& [name, source] : by_name) {
    if (!placed.count(name)) {
      throw std::invalid_argument("reshard_state: '" + name + "' (" + source.part +
                                  ") has no place in the new layout");
    }
  }
  return out;
}

}  // namespace tandem::optim
