// A store client that stops waiting once a member is gone (internal to
// ft/). A quorum's group meets through it: Gloo's rendezvous waits at the
// store for every member's address, and a member that died between the
// quorum's decision and the meeting would hold the others there until the
// store's timeout. Here a wait polls, and asks `gone` (the heartbeat's
// verdicts) between polls: a member gone ends it at once, with the reason.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace tandem::ft {

class WatchedStore : public c10d::Store {
 public:
  WatchedStore(c10::intrusive_ptr<c10d::Store> inner, std::function<std::string()> gone)
      : c10d::Store(inner->getTimeout()), inner_(std::move(inner)), gone_(std::move(gone)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    inner_->set(key, value);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return inner_->compareSet(key, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    wait({key}, timeout_);
    return inner_->get(key);
  }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { return inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(50);
    while (!inner_->check(keys)) {
      if (std::string why = gone_(); !why.empty()) {
        throw std::runtime_error("the group's members did not all meet: " + why);
      }
      if (timeout != kNoTimeout && std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error("waiting for the group's members timed out after " +
                                 std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(2000));
    }
  }

 private:
  c10::intrusive_ptr<c10d::Store> inner_;
  std::function<std::string()> gone_;
};

}  // namespace tandem::ft
