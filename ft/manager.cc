// Per-step fault tolerance (ft/manager.h): setting up, the step's frame,
// and the sample stream. The quorum is quorum.cc's, the vote vote.cc's,
// healing heal.cc's.
//
// The store's keys, under "tandem/ft/<job>/<run>.<round>/" (a run's and a
// launcher round's own, so that keys an earlier run left in a lasting store
// such as etcd mislead nobody):
// A process's index <p> is its replica's id x replica_size + its replica_rank
// (the replica's id, with replicas of one process).
//   who/<p>, hb/<p>            each process's identity and heartbeat (ft/heartbeat.h)
//   epoch                      the newest quorum's number (0: none yet)
//   q/<e>/join/<p>             a process's join of quorum e: its committed step,
//                              its sample position, its model's signature; MAC'd
//   q/<e>/any                  a whole replica joined quorum e (the members look at commit)
//   q/<e>/members              the quorum's processes: the first proposal written
//                              wins; MAC'd
//   q/<e>/r<r>/tandem/pg/ft/.. the group of the members' rank-r processes
//   q/<e>/replica<id>/...      replica id's own group (replicas of several processes)
//   q/<e>/v/<n>/fp/<i>         vote n's fingerprints (i: the process's place in the quorum)
//   q/<e>/v/<n>/ok             how many voted that their step went well
//   q/<e>/v/<n>/decision       "commit", "commit join", "abort <why>" or
//                              "diverged <who>": the first written wins; MAC'd
//                              (a vote's keys are deleted once every member
//                              has voted in the next)
//   committed                  the job's newest committed step; MAC'd
//   finished                   the step the job's replicas ended at; MAC'd
#include "tandem/ft/manager.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <exception>

#include "tandem/ddp/process_group.h"
#include "tandem/ft/common.h"
#include "tandem/ft/etcd_store.h"
#include "tandem/ft/heartbeat.h"
#include "tandem/ft/watched_store.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rendezvous/store_server.h"

namespace tandem::ft {

using namespace detail;

namespace {

// The default store client: etcd's when TANDEM_ETCD names its members, else
// tandem-run's, at MASTER_ADDR:MASTER_PORT.
c10::intrusive_ptr<c10d::Store> launcher_store() {
  if (const char* etcd = std::getenv("TANDEM_ETCD"); etcd && *etcd) {
    return etcd_store(etcd, "tandem/", std::chrono::seconds(60));
  }
  const rpc::WorldEnv env = rpc::world_from_env();
  if (env.master_addr.empty() || env.master_port <= 0) {
    throw std::invalid_argument(
        "ft::Manager: no store to meet at: run under tandem-run (it sets MASTER_ADDR and "
        "MASTER_PORT and hosts the store), set TANDEM_ETCD to an etcd cluster's members, or "
        "give ManagerOptions::connect");
  }
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(env.master_port);
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(60);
  auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  // On another node than the launcher's, TORCHELASTIC_USE_AGENT_STORE may be
  // unset: the key the launcher's store holds from its start tells.
  if (!rpc::store_hosted_by_launcher() && !store->check({rpc::StoreServer::kLauncherKey})) {
    throw std::invalid_argument(
        "ft::Manager: the store at MASTER_ADDR:MASTER_PORT is not hosted by a launcher "
        "(TORCHELASTIC_USE_AGENT_STORE is unset and the store does not say so): a replica that "
        "hosted it would end the job by dying; run under tandem-run, give TANDEM_ETCD, or give "
        "ManagerOptions::connect");
  }
  return store;
}

}  // namespace

// ---- set-up ----------------------------------------------------------------------------

Manager::Manager(ManagerOptions options, State state)
    : options_(std::move(options)), state_(std::move(state)) {
  const rpc::WorldEnv env = rpc::world_from_env();
  size_ = options_.replica_size;
  if (size_ < 1) {
    throw std::invalid_argument("ft::Manager: replica_size " + std::to_string(size_) +
                                " must be >= 1");
  }
  if (options_.replica_id < 0 || options_.replica_rank < 0 || options_.max_replicas <= 0) {
    if (env.world_size > 0 && env.world_size % size_ != 0) {
      throw std::invalid_argument("ft::Manager: WORLD_SIZE " + std::to_string(env.world_size) +
                                  " is not a multiple of replica_size " + std::to_string(size_));
    }
  }
  id_ = options_.replica_id >= 0 ? options_.replica_id : env.rank / size_;
  rank_ = options_.replica_rank >= 0 ? options_.replica_rank : env.rank % size_;
  max_ = options_.max_replicas > 0 ? options_.max_replicas : env.world_size / size_;
  if (max_ <= 0) {
    throw std::invalid_argument(
        "ft::Manager: ManagerOptions::max_replicas is unset and WORLD_SIZE is not in the "
        "environment");
  }
  if (rank_ >= size_) {
    throw std::invalid_argument("ft::Manager: replica_rank " + std::to_string(rank_) +
                                " is outside 0.." + std::to_string(size_ - 1));
  }
  if (id_ < 0 || id_ >= max_) {
    throw std::invalid_argument("ft::Manager: replica_id " + std::to_string(id_) +
                                " is outside 0.." + std::to_string(max_ - 1) +
                                " (ManagerOptions::replica_id, or RANK)");
  }
  proc_ = id_ * size_ + rank_;
  if (options_.min_replicas < 1 || options_.min_replicas > max_) {
    throw std::invalid_argument("ft::Manager: min_replicas " +
                                std::to_string(options_.min_replicas) + " is outside 1.." +
                                std::to_string(max_));
  }
  if (!state_.save || !state_.load) {
    throw std::invalid_argument("ft::Manager: State needs both save and load");
  }
  if (options_.batch_size < 0 || options_.dataset_size < 0 ||
      (options_.batch_size > 0) != (options_.dataset_size > 0)) {
    throw std::invalid_argument(
        "ft::Manager: dataset_size and batch_size go together, both > 0 (or both 0: no "
        "sample stream)");
  }
  for (auto [name, t] : {std::pair{"heartbeat_interval", options_.heartbeat_interval},
                         {"heartbeat_timeout", options_.heartbeat_timeout},
                         {"join_timeout", options_.join_timeout},
                         {"quorum_timeout", options_.quorum_timeout},
                         {"collective_timeout", options_.collective_timeout}}) {
    if (t.count() <= 0) {
      throw std::invalid_argument(std::string("ft::Manager: ") + name + " must be > 0 ms");
    }
  }
  if (options_.heartbeat_timeout <= options_.heartbeat_interval) {
    throw std::invalid_argument("ft::Manager: heartbeat_timeout must exceed heartbeat_interval");
  }
  if (options_.token.empty()) {
    if (const char* t = std::getenv("TANDEM_TOKEN")) options_.token = t;
  }
  auto connect = options_.connect ? options_.connect : launcher_store;
  if (options_.run_id.empty()) {
    const char* run = std::getenv("TANDEM_RUN_ID");
    options_.run_id = run && *run ? run : "run";
  }
  const char* round = std::getenv("TANDEM_RESTART_COUNT");
  prefix_ = "tandem/ft/" + options_.job + "/" + options_.run_id + "." +
            std::to_string(round ? std::atoll(round) : 0);
  const std::string& prefix = prefix_;
  store_ = c10::make_intrusive<c10d::PrefixStore>(prefix, connect());
  heartbeat_ = std::make_shared<Heartbeat>(
      c10::make_intrusive<c10d::PrefixStore>(prefix, connect()), proc_, max_ * size_,
      options_.heartbeat_interval, options_.heartbeat_timeout, size_);
  options_.connect = [connect, prefix] {
    return c10::intrusive_ptr<c10d::Store>(
        c10::make_intrusive<c10d::PrefixStore>(prefix, connect()));
  };
}

Manager::~Manager() {
  try {
    drop_group();
  } catch (...) {
  }
  // Only a process at the job's newest committed step marks it finished
  // (one that left behind it, such as a replica's process that learned the
  // job had finished while it waited to rejoin, must not move the mark
  // back), and the mark only moves on.
  if (std::uncaught_exceptions() == 0 && epoch_ > 0) {
    try {
      if (step_ >= mark("committed") && step_ > mark("finished")) {
        const std::string at = std::to_string(step_);
        store_->set("finished", bytes_of(at + "\n" + sign("finished " + at)));
      }
    } catch (...) {
    }
  }
  heartbeat_.reset();
}

c10::intrusive_ptr<c10d::Store> Manager::replica_store(const std::string& name) const {
  if (!group_ || replica_prefix_.empty()) {
    throw std::logic_error("ft::Manager::replica_store: outside a quorum (call it in on_quorum)");
  }
  if (name.empty() || name.find('/') != std::string::npos) {
    throw std::invalid_argument(
        "ft::Manager::replica_store: the name must be non-empty, without '/'"
        " (got '" +
        name + "')");
  }
  return c10::make_intrusive<WatchedStore>(
      c10::make_intrusive<c10d::PrefixStore>(replica_prefix_ + "own/" + name + "/",
                                             options_.connect()),
      stalled_);
}

std::shared_ptr<ddp::ProcessGroup> Manager::replica_subgroup(const std::string& name,
                                                             const std::vector<int>& ranks) const {
  std::string bad;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size_ ||
        std::find(ranks.begin(), ranks.begin() + static_cast<long>(i), ranks[i]) !=
            ranks.begin() + static_cast<long>(i)) {
      bad = "rank " + std::to_string(ranks[i]) + " is not a replica rank (0 to " +
            std::to_string(size_ - 1) + ") or is given twice";
      break;
    }
  }
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (bad.empty() && me == ranks.end()) {
    bad = "this process's replica rank " + std::to_string(rank_) + " is not among them";
  }
  if (!bad.empty()) {
    throw std::invalid_argument("ft::Manager::replica_subgroup '" + name + "': " + bad);
  }
  ddp::ProcessGroupOptions o;
  o.store = replica_store(name);  // (checks the name, and that there is a quorum)
  o.backend = options_.backend;
  o.rank = static_cast<int>(me - ranks.begin());
  o.world_size = static_cast<int>(ranks.size());
  o.timeout = options_.collective_timeout;
  o.group_name = "ft-" + name;
  o.member_name = name_of(proc_);
  o.stalled = stalled_;
  return ddp::ProcessGroup::create(o);
}

void Manager::drop_group() {
  replica_prefix_.clear();
  const bool abandon = !reform_ || !error_.empty();
  if (replica_group_ && abandon) replica_group_->abandon();
  replica_group_.reset();
  replica_group_store_.reset();
  if (!group_) return;
  if (abandon) group_->abandon();
  group_.reset();
  group_store_.reset();
}

std::string Manager::name_of(int process) const {
  std::string name = "replica " + std::to_string(process / size_);
  if (size_ > 1) name += " rank " + std::to_string(process % size_);
  return name;
}

int Manager::participants() const { return static_cast<int>(members_.size()); }
int Manager::participant_rank() const { return rank_in_quorum_; }
std::vector<int> Manager::members() const { return members_; }

void Manager::restore(int64_t step, int64_t samples_done) {
  if (epoch_ > 0) throw std::logic_error("ft::Manager::restore after the first quorum");
  if (step < 0 || samples_done < 0) {
    throw std::invalid_argument("ft::Manager::restore: step and samples_done must be >= 0");
  }
  step_ = step;
  cursor_ = samples_done;
}

void Manager::start_step() {
  if (!reform_ && group_) {
    error_.clear();
    voted_ = false;
    return;
  }
  drop_group();
  error_.clear();
  join_quorum();
  reform_ = false;
  group_failed_ = false;
  error_.clear();
  voted_ = false;
}

// ---- the sample stream -----------------------------------------------------------------

std::vector<int64_t> sample_stream(int64_t dataset_size, uint64_t seed, bool shuffle, int64_t first,
                                   int64_t count) {
  if (dataset_size <= 0 || first < 0 || count < 0) {
    throw std::invalid_argument(
        "ft::sample_stream: dataset_size must be > 0, first and count >= 0");
  }
  std::vector<int64_t> out;
  std::vector<int64_t> perm;
  int64_t perm_epoch = -1;
  const int64_t n = dataset_size;
  for (int64_t p = first; p < first + count; ++p) {
    const int64_t epoch = p / n;
    if (epoch != perm_epoch) {
      perm.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) perm[static_cast<size_t>(i)] = i;
      if (shuffle) {
        // A seeded Fisher-Yates with splitmix64: the same on every replica and build.
        uint64_t x = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(epoch) + 1;
        auto next = [&x] {
          uint64_t z = (x += 0x9e3779b97f4a7c15ull);
          z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
          z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
          return z ^ (z >> 31);
        };
        for (int64_t i = n - 1; i > 0; --i) {
          const auto j = static_cast<size_t>(next() % static_cast<uint64_t>(i + 1));
          std::swap(perm[static_cast<size_t>(i)], perm[j]);
        }
      }
      perm_epoch = epoch;
    }
    out.push_back(perm[static_cast<size_t>(p % n)]);
  }
  return out;
}

std::vector<int64_t> Manager::batch_indices() const {
  if (options_.batch_size <= 0) return {};
  const int64_t first =
      cursor_ + static_cast<int64_t>(std::max(rank_in_quorum_, 0)) * options_.batch_size;
  return sample_stream(options_.dataset_size, options_.seed, options_.shuffle, first,
                       options_.batch_size);
}

}  // namespace tandem::ft
