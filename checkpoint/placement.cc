// Tensors that are pieces of larger ones (checkpoint/placement.h).
#include "tandem/checkpoint/placement.h"

#include <c10/util/StringUtil.h>
#include <c10/util/accumulate.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
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

std::vector<std::pair<int64_t, int64_t>> flat_ranges(const Placement& p, int64_t lo, int64_t hi) {
  const size_t d = static_cast<size_t>(p.dim);
  const int64_t outer = product(p.whole, 0, d), inner = product(p.whole, d + 1, p.whole.size());
  const int64_t width = p.whole[d];
  const std::vector<int64_t> shape = piece_shape(p);
  const int64_t numel = product(shape, 0, shape.size());
  if (hi < 0 || hi > numel) hi = numel;
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;  // the piece's elements before this range
  auto add = [&](int64_t a, int64_t b) {
    const int64_t from = std::max(a, a + lo - at), to = std::min(b, a + hi - at);
    at += b - a;
    if (from >= to) return;
    if (!out.empty() && out.back().second == from) {
      out.back().second = to;
    } else {
      out.emplace_back(from, to);
    }
  };
  for (int64_t i = 0; i < outer && at < hi; ++i) {
    for (const auto& [a, b] : p.ranges) add((i * width + a) * inner, (i * width + b) * inner);
  }
  return out;
}

std::vector<PieceEntry> piece_entries(const Placement& p, int64_t lo, int64_t hi) {
  const size_t d = static_cast<size_t>(p.dim);
  const int64_t inner = product(p.whole, d + 1, p.whole.size());
  const std::vector<int64_t> shape = piece_shape(p);
  const int64_t numel = product(shape, 0, shape.size());
  if (hi < 0 || hi > numel) hi = numel;
  lo = std::max<int64_t>(lo, 0);
  std::vector<PieceEntry> out;
  if (p.dim == 0) {
    int64_t at = 0;
    for (const auto& [a, b] : p.ranges) {
      const int64_t n = (b - a) * inner;
      const int64_t from = std::max(lo, at), to = std::min(hi, at + n);
      if (from < to) {
        const int64_t start = a * inner + (from - at);
        out.push_back({"#" + std::to_string(start) + ":" + std::to_string(start + (to - from)),
                       from, to - from});
      }
      at += n;
    }
    return out;
  }
  if (lo >= hi) return out;
  const auto& [a, b] = p.ranges.front();
  std::string suffix = "#d" + std::to_string(p.dim) + ":" + std::to_string(a) + ":" + std::to_string(b);
  if (lo > 0 || hi < numel) suffix += "@" + std::to_string(lo) + ":" + std::to_string(hi);
  out.push_back({suffix, lo, hi - lo});
  return out;
}

}  // namespace tandem::checkpoint
