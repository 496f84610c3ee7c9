// Helpers shared by the three parts of the RRef implementation (owner.cc,
// user.cc, control.cc). Not installed.
#pragma once

#include <atomic>
#include <chrono>
#include <tuple>
#include <vector>

#include "tandem/rpc/common/bounded_set.h"
#include "tandem/rpc/errors.h"
#include "tandem/rpc/rref_core.h"

namespace tandem::rpc {

// RRefContext's forks deleted before they arrived (rpc/rref_context.h).
struct Tombstones {
  static constexpr size_t kMax = 1 << 16;
  BoundedSet<ForkId, GloballyUniqueIdHash> forks{kMax};
};

}  // namespace tandem::rpc

namespace tandem::rpc::rref_detail {

// Ids travel as (worker, local) tuples.
using WireId = std::tuple<int64_t, int64_t>;

inline WireId wire(const GloballyUniqueId& id) {
  return {static_cast<int64_t>(id.worker), static_cast<int64_t>(id.local)};
}

// The id a peer sent, checked against the world's size.
inline GloballyUniqueId id_of(const WireId& w, int world_size) {
  const int64_t worker = std::get<0>(w);
  if (worker < 0 || worker >= world_size) {
    throw std::invalid_argument("malformed RRef id: worker " + std::to_string(worker) +
                                " is outside the world");
  }
  return {static_cast<int32_t>(worker), static_cast<uint64_t>(std::get<1>(w))};
}

inline std::vector<c10::IValue> items_of(const c10::IValue& v) {
  if (!v.isList()) throw std::invalid_argument("malformed RRef control message: expected a list");
  auto l = v.toList();
  return std::vector<c10::IValue>(l.begin(), l.end());
}

inline RawFuture completed_future() {
  auto f = make_raw_future();
  f->markCompleted(c10::IValue());
  return f;
}

constexpr int kControlAttempts = 3;
constexpr auto kControlBackoff = std::chrono::microseconds(50000);
constexpr auto kDeleteBatchDelay = std::chrono::microseconds(500);

}  // namespace tandem::rpc::rref_detail
