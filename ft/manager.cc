// Per-step fault tolerance (ft/manager.h): the quorum, the vote, healing.
//
// The store's keys, under "tandem/ft/<job>/<run>.<round>/" (a run's and a
// launcher round's own, so that keys an earlier run left in a lasting store
// such as etcd mislead nobody):
//   who/<id>, hb/<id>          each replica's process and heartbeat (ft/heartbeat.h)
//   epoch                      the newest quorum's number (0: none yet)
//   q/<e>/join/<id>            a replica's join of quorum e: its committed step,
//                              its sample position, its model's signature; MAC'd
//   q/<e>/any                  someone joined quorum e (the members look at commit)
//   q/<e>/members              the quorum: the first proposal written wins; MAC'd
//   q/<e>/tandem/pg/ft/...     the quorum's process group
//   q/<e>/v/<n>/fp/<rank>      vote n's fingerprints
//   q/<e>/v/<n>/ok             how many voted that their step went well
//   q/<e>/v/<n>/decision       "commit", "commit join", "abort <why>" or
//                              "diverged <who>": the first written wins; MAC'd
//                              (a vote's keys are deleted once every member
//                              has voted in the next)
//   committed                  the job's newest committed step; MAC'd
#include "tandem/ft/manager.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>

#include "tandem/ddp/process_group.h"
#include "tandem/ft/etcd_store.h"
#include "tandem/ft/heartbeat.h"
#include "tandem/ft/joined.h"
#include "tandem/ft/watched_store.h"
#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/rendezvous.h"

namespace tandem::ft {

namespace {

using Clock = std::chrono::steady_clock;

std::string text_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string hex(const rpc::Sha256Digest& d) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (uint8_t b : d) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

// TANDEM_FT_LOG=1: each quorum, heal and failed step on stderr.
bool log_on() {
  static const bool on = [] {
    const char* v = std::getenv("TANDEM_FT_LOG");
    return v && *v && std::string(v) != "0";
  }();
  return on;
}

long long ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// A store's value that may not exist yet: empty when it does not.
std::string get_if(c10d::Store& store, const std::string& key) {
  if (!store.check({key})) return {};
  return text_of(store.get(key));
}

// Waits, polling, until `key` exists or `give_up` says why not (its text);
// returns "" once it exists. Polls fast at first (the answer usually comes
// within the step's last collective) and then every millisecond.
std::string wait_for_key(c10d::Store& store, const std::string& key,
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
  if (!rpc::store_hosted_by_launcher()) {
    throw std::invalid_argument(
        "ft::Manager: the store at MASTER_ADDR:MASTER_PORT is not hosted by the launcher "
        "(TORCHELASTIC_USE_AGENT_STORE is unset): a replica that hosted it would end the job "
        "by dying; run under tandem-run or give ManagerOptions::connect");
  }
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(env.master_port);
  opts.isServer = false;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(60);
  return c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
}

}  // namespace

// ---- set-up ----------------------------------------------------------------------------

Manager::Manager(ManagerOptions options, State state)
    : options_(std::move(options)), state_(std::move(state)) {
  const rpc::WorldEnv env = rpc::world_from_env();
  id_ = options_.replica_id >= 0 ? options_.replica_id : env.rank;
  max_ = options_.max_replicas > 0 ? options_.max_replicas : env.world_size;
  if (max_ <= 0) {
    throw std::invalid_argument(
        "ft::Manager: ManagerOptions::max_replicas is unset and WORLD_SIZE is not in the "
        "environment");
  }
  if (id_ < 0 || id_ >= max_) {
    throw std::invalid_argument("ft::Manager: replica_id " + std::to_string(id_) +
                                " is outside 0.." + std::to_string(max_ - 1) +
                                " (ManagerOptions::replica_id, or RANK)");
  }
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
  heartbeat_ =
      std::make_shared<Heartbeat>(c10::make_intrusive<c10d::PrefixStore>(prefix, connect()), id_,
                                  max_, options_.heartbeat_interval, options_.heartbeat_timeout);
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
  if (std::uncaught_exceptions() == 0 && epoch_ > 0) {
    try {
      const std::string at = std::to_string(step_);
      store_->set("finished", bytes_of(at + "\n" + sign("finished " + at)));
    } catch (...) {
    }
  }
  heartbeat_.reset();
}

void Manager::drop_group() {
  if (!group_) return;
  if (!reform_ || !error_.empty()) group_->abandon();
  group_.reset();
  group_store_.reset();
}

int Manager::participants() const { return static_cast<int>(members_.size()); }
int Manager::participant_rank() const { return rank_in_quorum_; }
std::vector<int> Manager::members() const { return members_; }

// ---- the quorum ------------------------------------------------------------------------

namespace {

// What must match between replicas: the options that shape the job, and
// the model's tensors (names, dtypes, shapes).
std::string signature_of(const ManagerOptions& o, int max,
                         const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::ostringstream s;
  s << "replicas " << max << ", batch " << o.batch_size << ", dataset " << o.dataset_size
    << ", seed " << o.seed << ", shuffle " << o.shuffle;
  for (const auto& [name, t] : tensors) {
    s << "\n"
      << name << " " << (t.defined() ? std::string(c10::toString(t.scalar_type())) : "none");
    if (t.defined()) {
      s << "[";
      for (size_t d = 0; d < t.sizes().size(); ++d) s << (d ? "," : "") << t.sizes()[d];
      s << "]";
    }
  }
  return s.str();
}

// The first line where two signatures differ, for the refusal's text.
std::string first_difference(const std::string& mine, const std::string& theirs) {
  std::istringstream a(mine), b(theirs);
  std::string la, lb;
  for (;;) {
    const bool ga = static_cast<bool>(std::getline(a, la));
    const bool gb = static_cast<bool>(std::getline(b, lb));
    if (!ga && !gb) return "(none)";
    if (!ga) la = "(nothing)";
    if (!gb) lb = "(nothing)";
    if (la != lb) return "the quorum has '" + la + "', it has '" + lb + "'";
  }
}

}  // namespace

std::string Manager::sign(const std::string& what) const {
  return hex(rpc::hmac_sha256(options_.token, prefix_ + "\n" + what));
}

int64_t Manager::mark(const std::string& key) {
  // "<step>\n<mac>"; one without the token's proof (or unreadable) counts as none.
  const std::string mark = get_if(*store_, key);
  const auto nl = mark.find('\n');
  if (nl == std::string::npos || nl == 0 || nl > 18 || mark.find_first_not_of("0123456789") != nl ||
      !rpc::constant_time_equal(mark.substr(nl + 1), sign(key + " " + mark.substr(0, nl)))) {
    return 0;
  }
  return std::stoll(mark.substr(0, nl));
}

bool Manager::join_quorum() {
  const auto t0 = Clock::now();
  const auto deadline = t0 + options_.quorum_timeout;
  const auto& model = state_.model ? state_.model() : state_.save();
  const std::string signature = signature_of(options_, max_, model);
  auto check_store = [&] {
    if (std::string e = heartbeat_->store_error(); !e.empty()) {
      throw QuorumError("ft::Manager: the store is gone: " + e);
    }
  };
  int64_t target = std::max(epoch_, store_->add("epoch", 0)) + 1;
  for (;;) {
    const std::string q = "q/" + std::to_string(target) + "/";
    const std::string record = std::to_string(step_) + " " + std::to_string(cursor_) + " " +
                               heartbeat_->me() + "\n" + signature;
    store_->set(q + "join/" + std::to_string(id_),
                bytes_of(record + "\n" + sign(q + std::to_string(id_) + "\n" + record)));
    store_->set(q + "any", bytes_of("1"));
    const auto joined_at = Clock::now();
    // The newest quorum before this one: while any of its members is alive,
    // only they may propose (a newcomer must not form a quorum of its own
    // beside a running one); before the first quorum, the whole world is
    // waited for (up to join_timeout).
    std::vector<Joined> previous;
    if (target > 1) {
      std::istringstream in(get_if(*store_, "q/" + std::to_string(target - 1) + "/members"));
      std::string line, kind;
      while (std::getline(in, line) && line.rfind("member ", 0) == 0) {
        std::istringstream words(line);
        Joined r;
        words >> kind >> r.id >> r.step >> r.cursor >> r.pid >> r.start >> r.host;
        previous.push_back(std::move(r));
      }
    }
    std::string blocked;  // why no proposal was made, for QuorumError's text
    std::string decided;
    while ((decided = get_if(*store_, q + "members")).empty()) {
      check_store();
      if (Clock::now() > deadline) {
        throw QuorumError("ft::Manager: replica " + std::to_string(id_) + " found no quorum of " +
                          std::to_string(options_.min_replicas) + " or more within " +
                          std::to_string(options_.quorum_timeout.count()) + " ms" +
                          (blocked.empty() ? "" : ": " + blocked));
      }
      // Who has joined, with a valid proof.
      std::vector<Joined> joined;
      std::vector<std::pair<int, std::string>> refused;
      for (int j = 0; j < max_; ++j) {
        const std::string rec = get_if(*store_, q + "join/" + std::to_string(j));
        if (rec.empty()) continue;
        const auto cut = rec.rfind('\n');
        const std::string body = rec.substr(0, cut);
        if (cut == std::string::npos ||
            !rpc::constant_time_equal(rec.substr(cut + 1),
                                      sign(q + std::to_string(j) + "\n" + body))) {
          refused.emplace_back(j,
                               "its join does not carry the cluster token's proof for this "
                               "quorum (forged, replayed, or another job's token)");
          continue;
        }
        Joined r;
        r.id = j;
        std::istringstream in(body);
        in >> r.step >> r.cursor >> r.pid >> r.start >> r.host;
        const auto nl = body.find('\n');
        r.signature = nl == std::string::npos ? "" : body.substr(nl + 1);
        joined.push_back(std::move(r));
      }
      bool may_propose =
          std::any_of(joined.begin(), joined.end(), [&](const Joined& r) { return r.id == id_; });
      // Only a member of the previous quorum (this process, not an earlier
      // one of its id) proposes while another member of it is alive (that
      // process itself: a replacement under its id is not it).
      const bool previous_alive =
          std::any_of(previous.begin(), previous.end(), [&](const Joined& r) {
            return r.id != id_ && heartbeat_->alive_as(r.id, r.host, r.pid, r.start);
          });
      const bool am_previous = epoch_ == target - 1 && epoch_ > 0;
      if (previous_alive && !am_previous) may_propose = false;
      // Every process of the last quorum is gone for good (exited, or its
      // id another process's) and nobody here holds the newest committed
      // step: that state is lost, and no quorum can go on from it.
      if (!previous.empty() && std::all_of(previous.begin(), previous.end(), [&](const Joined& r) {
            return heartbeat_->gone_for_good(r.id, r.host, r.pid, r.start);
          })) {
        const int64_t committed = mark("committed");
        const int64_t finished = mark("finished");
        const bool behind = std::all_of(joined.begin(), joined.end(),
                                        [&](const Joined& r) { return r.step < committed; });
        if (behind && !(finished > 0 && finished >= committed)) {
          throw QuorumError("ft::Manager: every replica of quorum " + std::to_string(target - 1) +
                            " is gone, and with them the job's newest committed step, " +
                            std::to_string(committed) +
                            ": no quorum can go on (restart the job from its checkpoint)");
        }
      }
      // Nobody of the last quorum is alive and the job was marked finished
      // further on than anyone here: it is over (a replacement came late).
      if (!previous_alive && !previous.empty()) {
        const int64_t finished = mark("finished");
        const bool behind = std::all_of(joined.begin(), joined.end(),
                                        [&](const Joined& r) { return r.step < finished; });
        if (finished > 0 && finished >= mark("committed") && behind) {
          throw JobFinished("ft::Manager: replica " + std::to_string(id_) +
                                " came after the job's replicas finished at step " +
                                std::to_string(finished),
                            finished);
        }
      }
      const bool waited_out = Clock::now() - joined_at > options_.join_timeout;
      bool all_in = true;
      for (int j = 0; j < max_; ++j) {
        const bool in =
            std::any_of(joined.begin(), joined.end(), [&](const Joined& r) { return r.id == j; });
        const bool expected = target == 1 ? true : heartbeat_->alive(j);
        if (expected && !in) all_in = false;
      }
      if (may_propose && (all_in || waited_out)) {
        // The reference: the replica furthest on (the lowest id among equals).
        const Joined* ref = nullptr;
        for (const Joined& r : joined) {
          if (!ref || r.step > ref->step) ref = &r;
        }
        std::vector<const Joined*> in;
        for (const Joined& r : joined) {
          if (r.signature != ref->signature) {
            refused.emplace_back(r.id, "its model or options differ from the quorum's: " +
                                           first_difference(ref->signature, r.signature));
          } else {
            in.push_back(&r);
          }
        }
        // Someone must hold the job's newest committed step.
        const int64_t committed = mark("committed");
        const bool has_newest = std::any_of(in.begin(), in.end(),
                                            [&](const Joined* r) { return r->step >= committed; });
        if (static_cast<int>(in.size()) < options_.min_replicas) {
          blocked = std::to_string(in.size()) + " replica(s) of a matching model joined";
        } else if (!has_newest) {
          blocked = "no replica that joined holds the job's newest committed step, " +
                    std::to_string(committed) +
                    " (those that did are gone: the job must restart from its checkpoint)";
        } else {
          std::string proposal;
          for (const Joined* r : in) {
            proposal += "member " + std::to_string(r->id) + " " + std::to_string(r->step) + " " +
                        std::to_string(r->cursor) + " " + std::to_string(r->pid) + " " + r->start +
                        " " + r->host + "\n";
          }
          for (const auto& [j, why] : refused) {
            proposal += "refused " + std::to_string(j) + " " + why + "\n";
          }
          proposal += "proof " + sign(q + "members\n" + proposal);
          store_->compareSet(q + "members", {}, bytes_of(proposal));
          continue;
        }
      } else if (!may_propose) {
        blocked = "a member of the previous quorum is alive and did not form one with it";
      } else {
        blocked = "a replica alive did not join within join_timeout";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    // The decided quorum.
    const auto proof_at = decided.rfind("proof ");
    if (proof_at == std::string::npos ||
        !rpc::constant_time_equal(decided.substr(proof_at + 6),
                                  sign(q + "members\n" + decided.substr(0, proof_at)))) {
      throw QuorumError("ft::Manager: quorum " + std::to_string(target) +
                        "'s members at the store do not carry this replica's cluster token's "
                        "proof (this replica has another job's token, or something outside "
                        "the job wrote them)");
    }
    std::vector<Joined> members;
    std::istringstream in(decided.substr(0, proof_at));
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream words(line);
      std::string kind;
      int j = -1;
      words >> kind >> j;
      if (kind == "member") {
        Joined r;
        r.id = j;
        words >> r.step >> r.cursor >> r.pid >> r.start >> r.host;
        members.push_back(r);
      } else if (kind == "refused" && j == id_) {
        std::string why;
        std::getline(words, why);
        throw std::invalid_argument("ft::Manager: replica " + std::to_string(id_) +
                                    " was refused by quorum " + std::to_string(target) + ":" + why);
      }
    }
    // The newest quorum's number moves on (never back).
    for (int64_t cur = store_->add("epoch", 0); cur < target; cur = store_->add("epoch", 0)) {
      store_->compareSet("epoch", bytes_of(std::to_string(cur)), bytes_of(std::to_string(target)));
    }
    const auto me =
        std::find_if(members.begin(), members.end(), [&](const Joined& r) { return r.id == id_; });
    if (me == members.end()) {
      ++target;  // too late for it: the next
      continue;
    }
    // The members are alive now, as these processes (a replacement's
    // heartbeat may not have been seen yet).
    {
      std::vector<Heartbeat::Process> processes;
      for (const Joined& r : members) processes.push_back({r.id, r.host, r.pid, r.start});
      heartbeat_->members(processes);
    }
    epoch_ = target;
    attempt_ = 0;
    layout_agreed_ = false;
    agreed_sizes_.clear();
    members_.clear();
    for (const Joined& r : members) members_.push_back(r.id);
    rank_in_quorum_ = static_cast<int>(me - members.begin());
    // The quorum's group, on a store client of its own (a group that cannot
    // meet leaves its client unusable).
    ddp::ProcessGroupOptions po;
    po.backend = options_.backend;
    po.rank = rank_in_quorum_;
    po.world_size = static_cast<int>(members.size());
    po.timeout = options_.collective_timeout;

    po.group_name = "ft";
    po.member_name = "replica " + std::to_string(id_);
    const int64_t my_epoch = epoch_;
    std::vector<int> ids = members_;
    std::weak_ptr<Heartbeat> weak = heartbeat_;
    po.stalled = [weak, ids, my_epoch]() -> std::string {
      const std::shared_ptr<Heartbeat> hb = weak.lock();
      if (!hb) return "its ft::Manager is gone";
      for (int j : ids) {
        if (std::string why = hb->why_gone(j); !why.empty()) return why;
      }
      if (hb->newest_epoch() > my_epoch) {
        return "the quorum moved on without this replica (quorum " +
               std::to_string(hb->newest_epoch()) + " is newer than its " +
               std::to_string(my_epoch) + ")";
      }
      return {};
    };
    // (its waits end once a member is gone: one that died since the
    // decision must not hold the others until the store's timeout)
    group_store_ = c10::make_intrusive<WatchedStore>(
        c10::make_intrusive<c10d::PrefixStore>(q, options_.connect()), po.stalled);
    po.store = group_store_;
    try {
      group_ = ddp::ProcessGroup::create(po);
    } catch (const std::exception& e) {
      // A member went before the group met: the next quorum.
      error_ =
          std::string("quorum ") + std::to_string(target) + "'s group did not meet: " + e.what();
      group_.reset();
      group_store_.reset();
      ++target;
      continue;
    }
    ++metrics_.quorums;
    metrics_.last_quorum_ms = static_cast<double>(ms_since(t0));
    if (log_on()) {
      std::string ids;
      for (int j : members_) ids += (ids.empty() ? "" : ",") + std::to_string(j);
      std::fprintf(stderr, "ft: replica %d in quorum %lld of replicas %s at step %lld (%lld ms)\n",
                   id_, static_cast<long long>(epoch_), ids.c_str(), static_cast<long long>(step_),
                   ms_since(t0));
    }
    try {
      heal(members);
    } catch (const std::invalid_argument&) {
      throw;
    } catch (const std::exception& e) {
      error_ = std::string("healing in quorum ") + std::to_string(target) + " failed: " + e.what();
      group_->abandon();
      group_.reset();
      group_store_.reset();
      ++target;
      continue;
    }
    return true;
  }
}

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

// ---- gradients and the vote ---------------------------------------------------------------

bool Manager::allreduce_grads(const std::vector<at::Tensor>& grads) {
  // A replica that reported an error still takes part (its peers wait for
  // it); one whose group failed does not.
  if (group_failed_) return false;
  if (!group_) {
    error_ = "no quorum (call start_step() first)";
    return false;
  }
  // One flat buffer a dtype. Every member's buffers must have the same
  // sizes, or the collective would mix them up (or wait for ever): the
  // layout (each gradient's dtype and size, an undefined one as none) is
  // compared across the quorum at its first step, and after that against
  // what was agreed.
  std::map<c10::ScalarType, std::vector<at::Tensor>> by_dtype;
  uint64_t layout = 0xcbf29ce484222325ull;
  auto mix = [&layout](uint64_t x) { layout = (layout ^ x) * 0x100000001b3ull; };
  for (const at::Tensor& g : grads) {
    mix(g.defined() ? static_cast<uint64_t>(g.scalar_type()) + 1 : 0);
    if (!g.defined()) continue;
    mix(static_cast<uint64_t>(g.dim()));
    for (int64_t d : g.sizes()) mix(static_cast<uint64_t>(d));
    by_dtype[g.scalar_type()].push_back(g);
  }
  layout &= (1ull << 62) - 1;
  const double k = static_cast<double>(members_.size());
  try {
    if (!layout_agreed_) {
      // The quorum's first step: the largest and the smallest layout of the
      // members (the same answer on each).
      at::Tensor both = at::empty({2}, at::kLong);
      both[0] = static_cast<int64_t>(layout);
      both[1] = -static_cast<int64_t>(layout);
      group_->all_reduce_async(both, ddp::ReduceOp::kMax).wait(options_.collective_timeout);
      if (both[0].item<int64_t>() != -both[1].item<int64_t>()) {
        if (error_.empty()) {
          error_ =
              "the members' gradients differ in layout (how many, their dtypes or sizes; an "
              "undefined gradient differs from a defined one): allreduce_grads needs the same "
              "list on every replica";
        }
        return false;
      }
      layout_agreed_ = true;
      agreed_layout_ = layout;
      for (const auto& [dtype, list] : by_dtype) {
        int64_t n = 0;
        for (const at::Tensor& g : list) n += g.numel();
        agreed_sizes_.emplace_back(dtype, n);
      }
    } else if (layout != agreed_layout_) {
      // This replica's layout changed since the quorum agreed on one: it
      // fails the step, taking part with zeros (its peers wait for its share).
      if (error_.empty()) {
        error_ = "replica " + std::to_string(id_) +
                 "'s gradients changed layout since its quorum's first step (how many, their "
                 "dtypes or sizes; an undefined gradient differs from a defined one)";
      }
      for (const auto& [dtype, n] : agreed_sizes_) {
        at::Tensor zeros = at::zeros({n}, at::TensorOptions().dtype(dtype));
        group_->all_reduce_async(zeros, ddp::ReduceOp::kSum).wait(options_.collective_timeout);
      }
      return false;
    }
    for (auto& [dtype, list] : by_dtype) {
      std::vector<at::Tensor> flat;
      for (const at::Tensor& g : list) flat.push_back(g.reshape({-1}));
      at::Tensor buffer = at::cat(flat);
      group_->all_reduce_async(buffer, ddp::ReduceOp::kSum).wait(options_.collective_timeout);
      buffer.div_(k);
      int64_t at = 0;
      for (const at::Tensor& g : list) {
        const_cast<at::Tensor&>(g).copy_(buffer.narrow(0, at, g.numel()).view(g.sizes()));
        at += g.numel();
      }
    }
  } catch (const std::exception& e) {
    group_failed_ = true;
    if (error_.empty()) error_ = e.what();
    return false;
  }
  return error_.empty();
}

void Manager::report_error(const std::string& why) {
  if (error_.empty()) error_ = "replica " + std::to_string(id_) + " reported: " + why;
}

std::string Manager::fingerprint() {
  // A hash of the bytes of the model's tensors: replicas that applied the
  // same updates hold the same bits (a ring all-reduce gives every rank the
  // same sums).
  const auto tensors = state_.model ? state_.model() : state_.save();
  uint64_t lanes[4] = {0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full, 0x165667b19e3779f9ull,
                       0x27d4eb2f165667c5ull};
  for (const auto& [name, t0] : tensors) {
    if (!t0.defined()) continue;
    const at::Tensor t = t0.is_contiguous() && t0.device().is_cpu() ? t0 : t0.contiguous().cpu();
    const auto* p = static_cast<const uint8_t*>(t.data_ptr());
    const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
      for (int l = 0; l < 4; ++l) {
        uint64_t w;
        std::memcpy(&w, p + i + 8 * l, 8);
        lanes[l] = (lanes[l] ^ w) * 0x100000001b3ull;
      }
    }
    for (; i < n; ++i) lanes[0] = (lanes[0] ^ p[i]) * 0x100000001b3ull;
    lanes[1] ^= n;
  }
  std::ostringstream s;
  s << std::hex << (lanes[0] ^ (lanes[1] << 1) ^ (lanes[2] << 2) ^ (lanes[3] << 3));
  return s.str();
}

bool Manager::should_commit() {
  if (voted_) throw std::logic_error("ft::Manager::should_commit called twice in one step");
  voted_ = true;
  if (!group_) {
    reform_ = true;
    if (error_.empty()) error_ = "no quorum";
    ++metrics_.steps_failed;
    return false;
  }
  const std::string v = "q/" + std::to_string(epoch_) + "/v/" + std::to_string(attempt_) + "/";
  ++attempt_;
  const int k = static_cast<int>(members_.size());
  auto decide = [&](const std::string& what) {
    store_->compareSet(v + "decision", {}, bytes_of(what + "\n" + sign(v + what)));
  };
  std::string decision;
  bool deciding = false;
  try {
    if (error_.empty()) {
      store_->set(v + "fp/" + std::to_string(rank_in_quorum_), bytes_of(fingerprint()));
      if (store_->add(v + "ok", 1) >= k) {
        deciding = true;
        // The last to vote well decides: every fingerprint must agree. (A
        // count that an add retried through an etcd election counted twice
        // is caught here: a vote missing its fingerprint decides nothing.)
        std::map<std::string, std::vector<int>> by_fp;
        bool all_voted = true;
        for (int r = 0; r < k && all_voted; ++r) {
          const std::string fp = get_if(*store_, v + "fp/" + std::to_string(r));
          if (fp.empty()) all_voted = false;
          by_fp[fp].push_back(members_[static_cast<size_t>(r)]);
        }
        if (!all_voted) {
          deciding = false;
        } else if (by_fp.size() == 1) {
          const bool join = store_->check({"q/" + std::to_string(epoch_ + 1) + "/any"});
          decide(join ? "commit join" : "commit");
        } else {
          std::string who;
          for (const auto& [fp, ids] : by_fp) {
            who += who.empty() ? "" : "; ";
            who += "replica";
            who += ids.size() > 1 ? "s " : " ";
            for (size_t i = 0; i < ids.size(); ++i) who += (i ? ", " : "") + std::to_string(ids[i]);
            who += " hold" + std::string(ids.size() > 1 ? "" : "s") + " fingerprint " + fp;
          }
          decide("diverged the replicas' parameters differ before step " +
                 std::to_string(step_ + 1) + ": " + who);
        }
      }
    } else {
      decide("abort " + error_);
    }
    // Wait for the decision; a member gone meanwhile, or a vote that takes
    // longer than a collective may, fails the step.
    const auto deadline = Clock::now() + options_.collective_timeout;
    const std::vector<int> ids = members_;
    std::string why = wait_for_key(*store_, v + "decision", [&]() -> std::string {
      if (std::string e = heartbeat_->store_error(); !e.empty()) return "the store is gone: " + e;
      for (int j : ids) {
        if (std::string w = heartbeat_->why_gone(j); !w.empty()) return w;
      }
      if (Clock::now() > deadline) {
        return "the vote took longer than " + std::to_string(options_.collective_timeout.count()) +
               " ms";
      }
      return {};
    });
    if (!why.empty()) decide("abort " + why);
    const std::string raw = text_of(store_->get(v + "decision"));
    const auto nl = raw.rfind('\n');
    decision = raw.substr(0, nl);
    if (nl == std::string::npos ||
        !rpc::constant_time_equal(raw.substr(nl + 1), sign(v + decision))) {
      throw QuorumError("ft::Manager: the decision of step " + std::to_string(step_ + 1) +
                        " at the store does not carry the cluster token's proof (written by "
                        "something outside the job)");
    }
    // The job's newest committed step: no quorum forms without a replica
    // that has it (one stopped and let go must not train on alone from an
    // older state).
    if (deciding && decision.rfind("commit", 0) == 0) {
      const std::string next = std::to_string(step_ + 1);
      store_->set("committed", bytes_of(next + "\n" + sign("committed " + next)));
      // Every member voted in this vote, so each has read the last one's
      // decision: its keys go (off the step's path).
      if (attempt_ >= 2) {
        const std::string last =
            "q/" + std::to_string(epoch_) + "/v/" + std::to_string(attempt_ - 2) + "/";
        std::vector<std::string> keys{last + "ok", last + "decision"};
        for (int r = 0; r < k; ++r) keys.push_back(last + "fp/" + std::to_string(r));
        heartbeat_->discard(std::move(keys));
      }
    }
  } catch (const std::exception& e) {
    // The step is decided by nobody this replica can hear: it leaves the
    // quorum (a later start_step() forms a new one, if the store returns).
    reform_ = true;
    ++metrics_.steps_failed;
    if (group_) group_->abandon();
    if (dynamic_cast<const QuorumError*>(&e)) throw;
    throw QuorumError(std::string("ft::Manager: the vote could not reach the store: ") + e.what());
  }
  if (decision.rfind("commit", 0) == 0) {
    ++step_;
    cursor_ += static_cast<int64_t>(k) * options_.batch_size;
    ++metrics_.steps_committed;
    if (decision == "commit join") reform_ = true;
    return true;
  }
  ++metrics_.steps_failed;
  reform_ = true;
  if (error_.empty()) error_ = decision.substr(decision.find(' ') + 1);
  if (log_on()) {
    std::fprintf(stderr, "ft: replica %d: step %lld failed: %s\n", id_,
                 static_cast<long long>(step_ + 1), decision.c_str());
  }
  if (group_) group_->abandon();
  if (decision.rfind("diverged ", 0) == 0) {
    throw DivergenceError("ft::Manager: " + decision.substr(9));
  }
  return false;
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
