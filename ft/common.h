// What ft/'s sources share (internal to ft/): store values as text, hex,
// the log switch, and waiting for a key.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tandem/rpc/common/auth.h"

namespace tandem::ft::detail {

using Clock = std::chrono::steady_clock;

inline std::string text_of(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}
inline std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

inline std::string hex(const rpc::Sha256Digest& d) { return rpc::to_hex(d.data(), d.size()); }

// TANDEM_FT_LOG=1: each quorum, heal and failed step on stderr.
inline bool log_on() {
  static const bool on = [] {
    const char* v = std::getenv("TANDEM_FT_LOG");
    return v && *v && std::string(v) != "0";
  }();
  return on;
}

inline long long ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// A store's value that may not exist yet: empty when it does not.
inline std::string get_if(c10d::Store& store, const std::string& key) {
  if (!store.check({key})) return {};
  return text_of(store.get(key));
}

// Waits, polling, until `key` exists or `give_up` says why not (its text);
// returns "" once it exists. Polls fast at first (the answer usually comes
// within the step's last collective) and then every millisecond.
inline std::string wait_for_key(c10d::Store& store, const std::string& key,
                                const std::function<std::string()>& give_up) {
  auto pause = std::chrono::microseconds(20);
  int since_give_up = 0;
  for (;;) {
    if (store.check({key})) return {};
    if (++since_give_up >= 8) {
      since_give_up = 0;
      if (std::string why = give_up(); !why.empty()) return why;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace tandem::ft::detail
