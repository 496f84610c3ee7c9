// Tensors that are pieces of larger ones (checkpoint/placement.h).
#include "tandem/checkpoint/placement.h"

#include <c10/util/StringUtil.h>
#include <c10/util/accumulate.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <stdexcept>
#include <unordered_map>

namespace tandem::checkpoint {

namespace {

struct Held {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  std::optional<Placement> placement;  // (none: a replica)
  int copy = 0;
};

std::mutex g_mu;
std::unordered_map<const c10::TensorImpl*, Held>& table() {
  static auto* t = new std::unordered_map<const c10::TensorImpl*, Held>();
  return *t;
}

int64_t product(const std::vector<int64_t>& v, size_t from, size_t to) {
  int64_t n = 1;
  for (size_t i = from; i < to; ++i) n *= v[i];
  return n;
}

// (g_mu held)
void remember(const at::Tensor& t, Held held) {
  auto& table_ = table();
  for (auto it = table_.begin(); it != table_.end();) {  // (the tensors gone)
    it = it->second.impl.expired() ? table_.erase(it) : std::next(it);
  }
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  table_.erase(impl);
  table_.emplace(impl, std::move(held));
}

// (g_mu held) What is kept for `t`, if anything.
const Held* find(const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  auto it = table().find(t.unsafeGetTensorImpl());
  if (it == table().end() || it->second.impl.expired()) return nullptr;
  return &it->second;
}

}  // namespace

void set_placement(const at::Tensor& piece, Placement p) {
  const std::string what = "checkpoint::set_placement: ";
  if (!piece.defined()) throw std::invalid_argument(what + "an undefined tensor");
  const auto nd = static_cast<int64_t>(p.whole.size());
  if (p.dim < 0 || p.dim >= nd) {
    throw std::invalid_argument(what + "dimension " + std::to_string(p.dim) +
                                " of a whole tensor of " + std::to_string(nd));
  }
  if (p.ranges.empty()) throw std::invalid_argument(what + "no ranges");
  if (p.dim != 0 && p.ranges.size() != 1) {
    throw std::invalid_argument(what + std::to_string(p.ranges.size()) +
                                " ranges along dimension " + std::to_string(p.dim) +
                                " (several are taken along dimension 0 only)");
  }
  int64_t at = 0;
  for (const auto& [a, b] : p.ranges) {
    if (a < at || b <= a || b > p.whole[static_cast<size_t>(p.dim)]) {
      throw std::invalid_argument(what + "the range [" + std::to_string(a) + ", " +
                                  std::to_string(b) + ") of dimension " + std::to_string(p.dim) +
                                  " (size " + std::to_string(p.whole[static_cast<size_t>(p.dim)]) +
                                  ") is empty, outside it, or overlaps or precedes the one before");
    }
    at = b;
  }
  const std::vector<int64_t> want = piece_shape(p);
  if (piece.sizes().vec() != want) {
    throw std::invalid_argument(what + "a piece of " + c10::str(piece.sizes()) + " is not " +
                                c10::str(at::IntArrayRef(want)) + ", the ranges' share of " +
                                c10::str(at::IntArrayRef(p.whole)));
  }
  std::lock_guard<std::mutex> lock(g_mu);
  remember(piece, Held{c10::weak_intrusive_ptr<c10::TensorImpl>(piece.getIntrusivePtr()),
                       std::move(p), 0});
}

void set_replica(const at::Tensor& t, int copy) {
  if (!t.defined()) throw std::invalid_argument("checkpoint::set_replica: an undefined tensor");
  if (copy < 0) {
    throw std::invalid_argument("checkpoint::set_replica: copy " + std::to_string(copy));
  }
  std::lock_guard<std::mutex> lock(g_mu);
  remember(t, Held{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), std::nullopt,
                   copy});
}

std::optional<Placement> placement_of(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(g_mu);
  const Held* h = find(t);
  return h ? h->placement : std::nullopt;
}

int replica_of(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(g_mu);
  const Held* h = find(t);
  return h ? h->copy : 0;
}

std::vector<int64_t> piece_shape(const Placement& p) {
  std::vector<int64_t> shape = p.whole;
  int64_t along = 0;
  for (const auto& [a, b] : p.ranges) along += b - a;
  shape[static_cast<size_t>(p.dim)] = along;
  return shape;
}

std::vector<std::pair<int64_t, int64_t>> flat_ranges(const Placement& p) {
  const size_t d = static_cast<size_t>(p.dim);
  const int64_t outer = product(p.whole, 0, d), inner = product(p.whole, d + 1, p.whole.size());
  const int64_t width = p.whole[d];
  std::vector<std::pair<int64_t, int64_t>> out;
  auto add = [&](int64_t a, int64_t b) {
    if (!out.empty() && out.back().second == a) {
      out.back().second = b;
    } else {
      out.emplace_back(a, b);
    }
  };
  for (int64_t i = 0; i < outer; ++i) {
    for (const auto& [a, b] : p.ranges) add((i * width + a) * inner, (i * width + b) * inner);
  }
  return out;
}

std::vector<PieceEntry> piece_entries(const Placement& p) {
  const size_t d = static_cast<size_t>(p.dim);
  const int64_t inner = product(p.whole, d + 1, p.whole.size());
  std::vector<PieceEntry> out;
  if (p.dim == 0) {
    int64_t at = 0;
    for (const auto& [a, b] : p.ranges) {
      out.push_back({"#" + std::to_string(a * inner) + ":" + std::to_string(b * inner), at,
                     (b - a) * inner});
      at += (b - a) * inner;
    }
    return out;
  }
  const auto& [a, b] = p.ranges.front();
  out.push_back({"#d" + std::to_string(p.dim) + ":" + std::to_string(a) + ":" + std::to_string(b),
                 0, product(p.whole, 0, d) * (b - a) * inner});
  return out;
}

}  // namespace tandem::checkpoint
