#pragma once
// A c10d::Store kept in an etcd cluster, so that the replicas' quorum, and
// the process groups they make, outlive any one machine: with three etcd
// members on three machines, losing one of them (or node 0's launcher, with
// its store) ends nothing.
//
//   ft::ManagerOptions o;
//   o.connect = [] { return ft::etcd_store("10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"); };
//
// or TANDEM_ETCD=host:port,... in the environment, which ft::Manager's
// default connect uses before the launcher's store. Each call is one
// request to a member (the one that answered last, else the next): reads
// are linearizable, add() and compareSet() are etcd transactions, wait()
// and a get() of a key not yet there poll (2 to 20 ms) until the key exists
// or the store's timeout passes. When no member answers, a call throws
// rpc::EtcdError naming each member and what went wrong. One store is one
// connection; calls on it are serialised. A call whose answer is lost in
// an election is sent again: set() and compareSet() are the same twice, but
// an add() applied and unanswered counts twice (ft::Manager's vote is
// checked against every voter's own key, so a double count decides
// nothing).
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace tandem::ft {

// Keys go under `prefix` in etcd. `timeout`: how long get() and wait() wait
// for a key (c10d's store timeout); `call_timeout`: one request's.
c10::intrusive_ptr<c10d::Store> etcd_store(
    const std::string& endpoints, const std::string& prefix = "tandem/",
    std::chrono::milliseconds timeout = std::chrono::seconds(300),
    std::chrono::milliseconds call_timeout = std::chrono::seconds(5));

}  // namespace tandem::ft
