// EtcdClient: a small client of etcd's v3 API through its JSON gateway
// (HTTP/1.1 POST /v3/kv/..., keys and values base64), enough for a
// rendezvous store and a quorum: put, get, compare-and-set, delete, count.
// Plain POSIX (no LibTorch), so that tandem-run can use it too.
//
// Endpoints are "host:port" of the cluster's members; a call goes to the
// member that answered last and, when it cannot be reached, answers 5xx or
// is silent for a second (an election under way), to the next, round and
// round until one answers or the call's timeout has passed (then EtcdError
// names each member and what went wrong last). etcd's reads are linearizable
// by default and its transactions atomic, so the cluster stays one store
// whatever member a call reaches. One client is one connection at a time:
// it is not shared between threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem::rpc {

class EtcdError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class EtcdClient {
 public:
  // "host:port,host:port,..." (an "etcd://" in front is allowed). Throws
  // std::invalid_argument for an empty or malformed list. Connects lazily.
  explicit EtcdClient(const std::string& endpoints,
                      std::chrono::milliseconds call_timeout = std::chrono::seconds(5));
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  void put(const std::string& key, const std::string& value);
  // The value, or nothing when the key does not exist.
  std::optional<std::string> get(const std::string& key);
  // Sets `desired` when the key holds `expected` (an absent key matches
  // nothing but an empty `expected`, which matches only absence). Returns
  // the value after: `desired` when it was set, else the current one
  // (empty when absent), as c10d's compareSet.
  std::string compare_and_set(const std::string& key, const std::string& expected,
                              const std::string& desired);
  // Sets `desired` when the key holds `*expected`, or, with no `expected`,
  // when the key does not exist; whether it did.
  bool swap(const std::string& key, const std::optional<std::string>& expected,
            const std::string& desired);
  // Whether it deleted the key.
  bool erase(const std::string& key);
  // Keys under `prefix`.
  int64_t count(const std::string& prefix);

  const std::vector<std::string>& endpoints() const { return endpoints_; }

 private:
  // POSTs `body` to `path`; returns the answer's body. Fails over (above).
  std::string call(const std::string& path, const std::string& body);
  std::string call_once(size_t member, const std::string& path, const std::string& body,
                        std::chrono::milliseconds timeout);
  void disconnect();

  std::vector<std::string> endpoints_;
  std::chrono::milliseconds timeout_;
  size_t current_ = 0;    // the member that answered last
  size_t connected_ = 0;  // the member fd_ is connected to
  int fd_ = -1;
};

// Base64 (RFC 4648, with padding), as etcd's gateway takes keys and values.
std::string base64_encode(const std::string& bytes);
std::string base64_decode(const std::string& text);

}  // namespace tandem::rpc
