// ft::etcd_store (ft/etcd_store.h): c10d's Store over rpc::EtcdClient.
#include "tandem/ft/etcd_store.h"

#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "tandem/rpc/rendezvous/etcd_client.h"

namespace tandem::ft {

namespace {

class EtcdStore : public c10d::Store {
 public:
  EtcdStore(const std::string& endpoints, std::string prefix, std::chrono::milliseconds timeout,
            std::chrono::milliseconds call_timeout)
      : c10d::Store(timeout), client_(endpoints, call_timeout), prefix_(std::move(prefix)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    client_.put(prefix_ + key, std::string(value.begin(), value.end()));
  }

  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string now =
        client_.compare_and_set(prefix_ + key, std::string(expected.begin(), expected.end()),
                                std::string(desired.begin(), desired.end()));
    return std::vector<uint8_t>(now.begin(), now.end());
  }

  std::vector<uint8_t> get(const std::string& key) override {
    wait({key});
    std::lock_guard<std::mutex> lock(mu_);
    const auto v = client_.get(prefix_ + key);
    if (!v) throw std::runtime_error("etcd store: key '" + key + "' vanished");
    return std::vector<uint8_t>(v->begin(), v->end());
  }

  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    // Read, then a transaction that writes the sum only if nobody wrote
    // meanwhile; adding 0 to a key that exists only reads (a heartbeat's look
    // at the others' counters writes nothing: etcd's revisions grow with the
    // writes alone).
    for (;;) {
      const auto v = client_.get(prefix_ + key);
      int64_t before = 0;
      if (v && !v->empty()) {
        char* end = nullptr;
        before = std::strtoll(v->c_str(), &end, 10);
        if (*end != '\0') {
          throw std::runtime_error("etcd store: add to key '" + key + "', whose value '" +
                                   v->substr(0, 20) + "' is not a number");
        }
      }
      if (delta == 0 && v) return before;  // (a missing key is made, as TCPStore's add does)
      if (client_.swap(prefix_ + key, v, std::to_string(before + delta))) return before + delta;
    }
  }

  bool deleteKey(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return client_.erase(prefix_ + key);
  }

  bool check(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& k : keys) {
      if (!client_.get(prefix_ + k)) return false;
    }
    return true;
  }

  int64_t getNumKeys() override {
    std::lock_guard<std::mutex> lock(mu_);
    return client_.count(prefix_);
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::milliseconds(2);
    while (!check(keys)) {
      if (std::chrono::steady_clock::now() + pause > deadline) {
        std::string names;
        for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
        throw std::runtime_error("etcd store: wait for " + names + " timed out after " +
                                 std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(20));
    }
  }

 private:
  std::mutex mu_;
  rpc::EtcdClient client_;
  std::string prefix_;
};

}  // namespace

c10::intrusive_ptr<c10d::Store> etcd_store(const std::string& endpoints, const std::string& prefix,
                                           std::chrono::milliseconds timeout,
                                           std::chrono::milliseconds call_timeout) {
  return c10::make_intrusive<EtcdStore>(endpoints, prefix, timeout, call_timeout);
}

}  // namespace tandem::ft
