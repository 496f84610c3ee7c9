// FullyShardedDataParallel's clipping, state dicts and stats
// (ddp/fsdp/impl.h).
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <sstream>
#include <unordered_map>

#include "tandem/ddp/fsdp/impl.h"

namespace tandem::ddp {

double FullyShardedDataParallel::clip_grad_norm(double max_norm) {
  return clip_grad_norm(max_norm, ClipOptions{});
}

double FullyShardedDataParallel::clip_grad_norm(double max_norm, const ClipOptions& options) {
  Impl& m = *impl_;
  std::vector<at::Tensor> mine, grads;  // each rank's shards: every element counted once
  for (const auto& u : m.units) {
    if (!u.shard.defined()) continue;
    const at::Tensor g = u.shard.grad();
    grads.push_back(g);
    if (!options.counted || !g.defined()) {
      mine.push_back(g);
      continue;
    }
    // Only the elements of the parameters this rank counts (a tensor-
    // parallel copy of a replicated parameter is counted by another rank).
    const int64_t size = u.shard.numel(), lo = static_cast<int64_t>(m.rank()) * size;
    for (size_t i : u.params) {
      const Impl::Param& p = m.params[i];
      const int64_t a = std::max(p.offset, lo), b = std::min(p.offset + p.numel, lo + size);
      if (a < b && options.counted(p.tensor)) mine.push_back(g.narrow(0, a - lo, b - a));
    }
  }
  return m.pg().clip_grad_norm(mine, grads, max_norm, "FullyShardedDataParallel::clip_grad_norm",
                                 m.timeout(), options.group.get());
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::full_state_dict(int to) {
  Impl& m = *impl_;
  if (to < 0 || to >= m.size()) {
    throw std::invalid_argument("FullyShardedDataParallel::full_state_dict: rank " +
                                std::to_string(to) + " is not in [0, " + std::to_string(m.size()) +
                                ")");
  }
  c10::AutoGradMode no_grad(false);
  std::vector<at::Tensor> flats(m.units.size());
  for (size_t k = 0; k < m.units.size(); ++k) {
    const auto& u = m.units[k];
    if (!u.shard.defined()) continue;
    if (m.size() == 1) {
      flats[k] = u.shard.detach().clone();
      continue;
    }
    auto parts = m.pg().gather(u.shard.detach(), to, m.timeout());
    if (!parts.empty()) flats[k] = at::cat(parts);
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (m.rank() != to) return out;
  for (const auto& p : m.params) {
    out.emplace_back(p.name, flats[p.unit].narrow(0, p.offset, p.numel).view(p.shape).clone());
  }
  for (const auto& [name, b] : m.buffers) out.emplace_back(name, b.detach().clone());
  return out;
}

void FullyShardedDataParallel::load_full_state_dict(
    const std::vector<std::pair<std::string, at::Tensor>>& state) {
  Impl& m = *impl_;
  const std::string who = "FullyShardedDataParallel::load_full_state_dict: ";
  std::unordered_map<std::string, const at::Tensor*> by_name;
  for (const auto& [name, t] : state) by_name[name] = &t;
  c10::AutoGradMode no_grad(false);
  // Everything checked before anything changes.
  auto find = [&](const std::string& name, at::IntArrayRef shape) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw std::invalid_argument(who + "no '" + name + "' in the state");
    if (it->second->sizes() != shape) {
      std::ostringstream s;
      s << who << "'" << name << "' has shape " << it->second->sizes() << ", the model's " << shape;
      throw std::invalid_argument(s.str());
    }
    return it->second;
  };
  for (const auto& p : m.params) find(p.name, p.shape);
  for (const auto& [name, b] : m.buffers) find(name, b.sizes());
  for (auto& u : m.units) {
    if (!u.shard.defined()) continue;
    const int64_t lo = static_cast<int64_t>(m.rank()) * u.shard_numel;
    at::Tensor shard = u.shard.detach();
    shard.zero_();
    for (size_t i : u.params) {
      const auto& p = m.params[i];
      // The part of [p.offset, p.offset + numel) that is in [lo, lo + shard_numel).
      const int64_t a = std::max(p.offset, lo),
                    b = std::min(p.offset + p.numel, lo + u.shard_numel);
      if (a >= b) continue;
      shard.narrow(0, a - lo, b - a)
          .copy_(find(p.name, p.shape)->reshape({-1}).narrow(0, a - p.offset, b - a));
    }
  }
  for (auto& [name, b] : m.buffers) b.copy_(*find(name, b.sizes()));
}

std::vector<UnitShard> FullyShardedDataParallel::sharded_state_dict() const {
  std::vector<UnitShard> out = shards();
  for (UnitShard& s : out) s.shard = s.shard.clone();
  return out;
}

std::shared_ptr<ProcessGroup> FullyShardedDataParallel::replicate_group() const {
  return impl_->opt.replicate_group;
}

std::vector<UnitShard> FullyShardedDataParallel::shards() const {
  const Impl& m = *impl_;
  std::vector<UnitShard> out;
  for (const auto& u : m.units) {
    if (!u.shard.defined()) continue;
    UnitShard s;
    s.unit = u.name;
    for (size_t i : u.params) {
      s.names.push_back(m.params[i].name);
      s.shapes.push_back(m.params[i].shape);
      s.params.push_back(m.params[i].tensor);
    }
    s.numel = u.numel;
    s.rank = m.rank();
    s.world_size = m.size();
    s.shard = u.shard.detach();
    out.push_back(std::move(s));
  }
  return out;
}

void FullyShardedDataParallel::load_sharded_state_dict(const std::vector<UnitShard>& shards) {
  Impl& m = *impl_;
  const std::string who = "FullyShardedDataParallel::load_sharded_state_dict: ";
  auto mine = this->shards();
  if (shards.size() != mine.size()) {
    throw std::invalid_argument(who + std::to_string(shards.size()) + " shards, this model has " +
                                std::to_string(mine.size()) + " units with parameters");
  }
  for (size_t k = 0; k < mine.size(); ++k) {
    const UnitShard& s = shards[k];
    const UnitShard& want = mine[k];
    const std::string unit = want.unit.empty() ? "the root unit" : "unit '" + want.unit + "'";
    if (s.rank != want.rank || s.world_size != want.world_size) {
      throw std::invalid_argument(
          who + "the shard of " + unit + " was saved by rank " + std::to_string(s.rank) + " of " +
          std::to_string(s.world_size) + ", this is rank " + std::to_string(want.rank) + " of " +
          std::to_string(want.world_size) + " (full_state_dict() loads into another layout)");
    }
    if (s.unit != want.unit || s.names != want.names || s.shapes != want.shapes ||
        s.numel != want.numel) {
      throw std::invalid_argument(who + "shard #" + std::to_string(k) + " is of unit '" + s.unit +
                                  "' with other parameters than " + unit + " of this model");
    }
    if (!s.shard.defined() || s.shard.sizes() != want.shard.sizes() ||
        s.shard.scalar_type() != want.shard.scalar_type()) {
      throw std::invalid_argument(who + "the shard of " + unit + " has the wrong size or dtype");
    }
  }
  c10::AutoGradMode no_grad(false);
  size_t k = 0;
  for (auto& u : m.units) {
    if (!u.shard.defined()) continue;
    u.shard.detach().copy_(shards[k++].shard);
  }
}

FullyShardedDataParallel::Stats FullyShardedDataParallel::stats() const {
  const Impl& m = *impl_;
  Stats s;
  for (size_t k : m.order) s.units.push_back(m.units[k].name);
  for (const auto& u : m.units) {
    if (!u.shard.defined()) continue;
    s.largest_unit_bytes = std::max<int64_t>(
        s.largest_unit_bytes, u.padded * static_cast<int64_t>(u.full.element_size()));
    s.shard_bytes += u.shard.numel() * static_cast<int64_t>(u.shard.element_size());
    if (u.shard.grad().defined()) {
      s.shard_bytes += u.shard.grad().numel() * static_cast<int64_t>(u.shard.element_size());
    }
  }
  s.gathers = m.gathers;
  s.reduce_scatters = m.reduce_scatters;
  return s;
}

}  // namespace tandem::ddp
