// BoundedSet<T>: a set that remembers at most `capacity` elements, forgetting
// the oldest first. Layers use it for ids that must not come back once gone
// (RRef forks deleted before their fork arrived, released autograd contexts)
// without growing for ever. Not thread-safe: its owner locks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <unordered_map>
#include <utility>

namespace tandem::rpc {

template <class T, class Hash = std::hash<T>>
class BoundedSet {
 public:
  explicit BoundedSet(size_t capacity) : capacity_(capacity) {}

  // False when `x` was already there.
  bool insert(const T& x) {
    auto [it, fresh] = items_.try_emplace(x, next_);
    if (!fresh) return false;
    order_.emplace_back(x, next_++);
    while (items_.size() > capacity_) forget_oldest();
    // Entries erased by hand stay in order_ until they age out: bound that too.
    while (order_.size() > 2 * capacity_ + 16) forget_oldest();
    return true;
  }
  bool contains(const T& x) const { return items_.count(x) > 0; }
  // True when `x` was there.
  bool erase(const T& x) { return items_.erase(x) > 0; }
  size_t size() const { return items_.size(); }

 private:
  void forget_oldest() {
    auto [x, stamp] = order_.front();
    order_.pop_front();
    auto it = items_.find(x);
    if (it != items_.end() && it->second == stamp) items_.erase(it);  // not re-inserted since
  }

  const size_t capacity_;
  uint64_t next_ = 0;
  std::unordered_map<T, uint64_t, Hash> items_;  // element -> when it was inserted
  std::deque<std::pair<T, uint64_t>> order_;
};

}  // namespace tandem::rpc
