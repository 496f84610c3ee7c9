// The quorum (ft/manager.h 1., 5.): joining, proposing, the rules that
// keep a quorum honest, and the group its members make. The keys are
// listed in manager.cc.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <map>
#include <cstdio>
#include <sstream>
#include <thread>

#include "tandem/ddp/process_group.h"
#include "tandem/ft/common.h"
#include "tandem/ft/heartbeat.h"
#include "tandem/ft/joined.h"
#include "tandem/ft/manager.h"
#include "tandem/ft/watched_store.h"

namespace tandem::ft {

using namespace detail;

namespace {

// What must match between replicas: the options that shape the job, and
// the model's tensors (names, dtypes, shapes).
std::string signature_of(const ManagerOptions& o, int max, int size,
                         const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::ostringstream s;
  s << "replicas " << max << ", batch " << o.batch_size << ", dataset " << o.dataset_size
    << ", seed " << o.seed << ", shuffle " << o.shuffle;
  if (size > 1) s << ", processes a replica " << size;
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
  // "<step>\n<mac>". One without this replica's token's proof was written
  // with another token (this replica's is not the job's) or by something
  // outside the job: nothing to go by.
  const std::string mark = get_if(*store_, key);
  if (mark.empty()) return 0;
  const auto nl = mark.find('\n');
  if (nl == std::string::npos || nl == 0 || nl > 18 || mark.find_first_not_of("0123456789") != nl ||
      !rpc::constant_time_equal(mark.substr(nl + 1), sign(key + " " + mark.substr(0, nl)))) {
    throw QuorumError("ft::Manager: the job's '" + key +
                      "' mark at the store does not carry this replica's cluster token's proof "
                      "(this replica has another job's token, or something outside the job "
                      "wrote it)");
  }
  return std::stoll(mark.substr(0, nl));
}

bool Manager::join_quorum() {
  const auto t0 = Clock::now();
  const auto deadline = t0 + options_.quorum_timeout;
  const auto& model = state_.model ? state_.model() : state_.save();
  const std::string signature = signature_of(options_, max_, size_, model);
  const int nprocs = max_ * size_;
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
    store_->set(q + "join/" + std::to_string(proc_),
                bytes_of(record + "\n" + sign(q + std::to_string(proc_) + "\n" + record)));
    // "any" tells the running quorum that a replica waits: once the whole of
    // this one has joined (a replica short of a process would make the
    // members form quorums without it step after step).
    bool told = false;
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
        // The job may have finished while this replica was held (in a
        // group that could not meet, or with a stale view of who is
        // alive): then it came late, and nobody is left to train with.
        const int64_t committed = mark("committed");
        const int64_t finished = mark("finished");
        if (finished > 0 && finished >= committed && step_ < finished) {
          throw JobFinished("ft::Manager: " + name_of(proc_) +
                                " found the job's replicas finished at step " +
                                std::to_string(finished) + " when its quorum timed out",
                            finished);
        }
        throw QuorumError("ft::Manager: " + name_of(proc_) + " found no quorum of " +
                          std::to_string(options_.min_replicas) + " or more within " +
                          std::to_string(options_.quorum_timeout.count()) + " ms" +
                          (blocked.empty() ? "" : ": " + blocked));
      }
      // Who has joined, with a valid proof.
      std::vector<Joined> joined;
      std::vector<std::pair<int, std::string>> refused;
      for (int j = 0; j < nprocs; ++j) {
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
      // The replicas whose every process joined, each's processes by rank.
      std::map<int, std::vector<const Joined*>> whole;
      {
        std::map<int, std::vector<const Joined*>> by_replica;
        for (const Joined& r : joined) {
          auto& procs = by_replica[r.id / size_];
          procs.resize(static_cast<size_t>(size_), nullptr);
          procs[static_cast<size_t>(r.id % size_)] = &r;
        }
        for (auto& [replica, procs] : by_replica) {
          if (std::all_of(procs.begin(), procs.end(), [](const Joined* r) { return r; })) {
            whole.emplace(replica, std::move(procs));
          }
        }
      }
      if (!told && whole.count(id_)) {
        store_->set(q + "any", bytes_of("1"));
        told = true;
      }
      bool may_propose =
          std::any_of(joined.begin(), joined.end(), [&](const Joined& r) { return r.id == proc_; });
      // Only a member of the previous quorum (this process, not an earlier
      // one of its index) proposes while another member of it is alive
      // (that process itself: a replacement under its index is not it).
      const bool previous_alive =
          std::any_of(previous.begin(), previous.end(), [&](const Joined& r) {
            return r.id != proc_ && heartbeat_->alive_as(r.id, r.host, r.pid, r.start);
          });
      const bool am_previous = epoch_ == target - 1 && epoch_ > 0;
      if (previous_alive && !am_previous) may_propose = false;
      // The ranks whose every process of the last quorum is gone for good
      // (exited, or its index another process's; this process counts by its
      // step: a member whose heal failed holds nothing).
      std::vector<int> orphaned;
      if (!previous.empty()) {
        for (int r = 0; r < size_; ++r) {
          bool any = false, all_gone = true;
          for (const Joined& p : previous) {
            if (p.id % size_ != r) continue;
            any = true;
            if (p.id != proc_ && !heartbeat_->gone_for_good(p.id, p.host, p.pid, p.start)) {
              all_gone = false;
            }
          }
          if (any && all_gone) orphaned.push_back(r);
        }
      }
      // Nobody of the last quorum is alive, or some shard's holders are all
      // gone: the job may be over, or its newest state lost (the store's
      // marks, read once, tell which).
      if ((!previous_alive && !previous.empty()) || !orphaned.empty()) {
        const int64_t committed = mark("committed");
        const int64_t finished = mark("finished");
        auto behind = [&](int64_t step, int rank) {
          return std::all_of(joined.begin(), joined.end(), [&](const Joined& r) {
            return (rank >= 0 && r.id % size_ != rank) || r.step < step;
          });
        };
        if (!previous_alive && finished > 0 && finished >= committed) {
          // Marked finished further on than anyone here: a replacement came late.
          if (behind(finished, -1)) {
            throw JobFinished("ft::Manager: " + name_of(proc_) +
                                  " came after the job's replicas finished at step " +
                                  std::to_string(finished),
                              finished);
          }
        } else {
          for (int r : orphaned) {
            // The newest committed step of shard r is nowhere any more: no
            // quorum can go on from it, unless the job finished there (a
            // replica ended at it, and the last holders of r went as the
            // others finished up: a replacement came late).
            if (!behind(committed, r)) continue;
            if (finished > 0 && finished >= committed && behind(finished, -1)) {
              throw JobFinished("ft::Manager: " + name_of(proc_) +
                                    " came after the job's replicas finished at step " +
                                    std::to_string(finished),
                                finished);
            }
            throw QuorumError(
                "ft::Manager: every " + std::string(size_ > 1 ? "rank-" + std::to_string(r) +
                                                                    " process"
                                                              : "replica") +
                " of quorum " + std::to_string(target - 1) +
                " is gone, and with them the job's newest committed step, " +
                std::to_string(committed) +
                ": no quorum can go on (restart the job from its checkpoint)");
          }
        }
      }
      const bool waited_out = Clock::now() - joined_at > options_.join_timeout;
      bool all_in = true;
      for (int j = 0; j < nprocs; ++j) {
        const bool in =
            std::any_of(joined.begin(), joined.end(), [&](const Joined& r) { return r.id == j; });
        const bool expected = target == 1 ? true : heartbeat_->alive(j);
        if (expected && !in) all_in = false;
      }
      if (may_propose && whole.empty()) {
        blocked = "no replica has all its " + std::to_string(size_) + " processes joined";
      } else if (may_propose && (all_in || waited_out)) {
        // The reference: the whole replica furthest on (its processes' least
        // step; the lowest id among equals).
        auto step_of = [](const std::vector<const Joined*>& procs) {
          int64_t s = procs.front()->step;
          for (const Joined* p : procs) s = std::min(s, p->step);
          return s;
        };
        const std::vector<const Joined*>* ref = nullptr;
        for (const auto& [replica, procs] : whole) {
          if (!ref || step_of(procs) > step_of(*ref)) ref = &procs;
        }
        std::vector<const Joined*> in;  // processes, replica by replica
        int replicas_in = 0;
        for (const auto& [replica, procs] : whole) {
          std::string differs;
          for (int r = 0; r < size_ && differs.empty(); ++r) {
            const std::string& want = (*ref)[static_cast<size_t>(r)]->signature;
            const std::string& got = procs[static_cast<size_t>(r)]->signature;
            if (got != want) {
              differs = std::string(size_ > 1 ? "its rank " + std::to_string(r) + "'s" : "its") +
                        " model or options differ from the quorum's: " +
                        first_difference(want, got);
            }
          }
          if (!differs.empty()) {
            for (const Joined* p : procs) refused.emplace_back(p->id, differs);
            continue;
          }
          in.insert(in.end(), procs.begin(), procs.end());
          ++replicas_in;
        }
        // Someone must hold the job's newest committed step.
        const int64_t committed = mark("committed");
        const bool has_newest = step_of(*ref) >= committed;
        if (replicas_in < options_.min_replicas) {
          blocked = std::to_string(replicas_in) + " whole replica(s) of a matching model joined";
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
      } else if (kind == "refused" && j == proc_) {
        std::string why;
        std::getline(words, why);
        throw std::invalid_argument("ft::Manager: " + name_of(proc_) + " was refused by quorum " +
                                    std::to_string(target) + ":" + why);
      }
    }
    // The newest quorum's number moves on (never back).
    for (int64_t cur = store_->add("epoch", 0); cur < target; cur = store_->add("epoch", 0)) {
      store_->compareSet("epoch", bytes_of(std::to_string(cur)), bytes_of(std::to_string(target)));
    }
    const auto me =
        std::find_if(members.begin(), members.end(), [&](const Joined& r) { return r.id == proc_; });
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
    procs_.clear();
    std::vector<Joined> mine;  // the members' processes of this one's rank
    for (const Joined& r : members) {
      procs_.push_back(r.id);
      if (members_.empty() || members_.back() != r.id / size_) members_.push_back(r.id / size_);
      if (r.id % size_ == rank_) mine.push_back(r);
    }
    rank_in_quorum_ = static_cast<int>(
        std::find(members_.begin(), members_.end(), id_) - members_.begin());
    // The group of the members' rank-r processes, on a store client of its
    // own (a group that cannot meet leaves its client unusable).
    ddp::ProcessGroupOptions po;
    po.backend = options_.backend;
    po.rank = rank_in_quorum_;
    po.world_size = static_cast<int>(members_.size());
    po.timeout = options_.collective_timeout;

    po.group_name = "ft";
    po.member_name = name_of(proc_);
    const int64_t my_epoch = epoch_;
    std::vector<int> ids = procs_;
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
    stalled_ = po.stalled;
    group_store_ = c10::make_intrusive<WatchedStore>(
        c10::make_intrusive<c10d::PrefixStore>(q + "r" + std::to_string(rank_) + "/",
                                               options_.connect()),
        po.stalled);
    po.store = group_store_;
    try {
      group_ = ddp::ProcessGroup::create(po);
      if (size_ > 1) {
        // The replica's own processes.
        ddp::ProcessGroupOptions ro = po;
        ro.rank = rank_;
        ro.world_size = size_;
        ro.group_name = "ft-replica";
        replica_group_store_ = c10::make_intrusive<WatchedStore>(
            c10::make_intrusive<c10d::PrefixStore>(q + "replica" + std::to_string(id_) + "/",
                                                   options_.connect()),
            po.stalled);
        ro.store = replica_group_store_;
        replica_group_ = ddp::ProcessGroup::create(ro);
      }
    } catch (const std::exception& e) {
      // A member went before the groups met: the next quorum.
      error_ =
          std::string("quorum ") + std::to_string(target) + "'s group did not meet: " + e.what();
      if (group_) group_->abandon();
      group_.reset();
      group_store_.reset();
      replica_group_.reset();
      replica_group_store_.reset();
      ++target;
      continue;
    }
    replica_prefix_ = q + "replica" + std::to_string(id_) + "/";
    ++metrics_.quorums;
    metrics_.last_quorum_ms = static_cast<double>(ms_since(t0));
    if (log_on()) {
      std::string ids;
      for (int j : members_) ids += (ids.empty() ? "" : ",") + std::to_string(j);
      std::fprintf(stderr, "ft: %s in quorum %lld of replicas %s at step %lld (%lld ms)\n",
                   name_of(proc_).c_str(), static_cast<long long>(epoch_), ids.c_str(),
                   static_cast<long long>(step_), ms_since(t0));
    }
    auto leave = [this] {
      replica_prefix_.clear();
      group_->abandon();
      group_.reset();
      group_store_.reset();
      if (replica_group_) replica_group_->abandon();
      replica_group_.reset();
      replica_group_store_.reset();
    };
    try {
      if (options_.on_quorum) options_.on_quorum(*this);
      heal(mine, members);
    } catch (const std::logic_error&) {
      leave();
      throw;
    } catch (const std::exception& e) {
      error_ = std::string("healing in quorum ") + std::to_string(target) + " failed: " + e.what();
      leave();
      ++target;
      continue;
    }
    return true;
  }
}

}  // namespace tandem::ft
