// The quorum (ft/manager.h 1., 5.): joining, proposing, the rules that
// keep a quorum honest, and the group its members make. The keys are
// listed in manager.cc.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
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
      // Nobody of the last quorum is alive: the job may be over, or its
      // newest state lost (the store's marks, read once, tell which).
      if (!previous_alive && !previous.empty()) {
        const int64_t committed = mark("committed");
        const int64_t finished = mark("finished");
        auto behind = [&](int64_t step) {
          return std::all_of(joined.begin(), joined.end(),
                             [&](const Joined& r) { return r.step < step; });
        };
        if (finished > 0 && finished >= committed) {
          // Marked finished further on than anyone here: a replacement came late.
          if (behind(finished)) {
            throw JobFinished("ft::Manager: replica " + std::to_string(id_) +
                                  " came after the job's replicas finished at step " +
                                  std::to_string(finished),
                              finished);
          }
        } else if (behind(committed) &&
                   std::all_of(previous.begin(), previous.end(), [&](const Joined& r) {
                     // Every other process of it gone for good (exited, or its id
                     // another process's; this replica counts by its step: a
                     // member whose heal failed holds nothing): the newest
                     // committed step is lost, and no quorum can go on from it.
                     return r.id == id_ || heartbeat_->gone_for_good(r.id, r.host, r.pid, r.start);
                   })) {
          throw QuorumError("ft::Manager: every replica of quorum " + std::to_string(target - 1) +
                            " is gone, and with them the job's newest committed step, " +
                            std::to_string(committed) +
                            ": no quorum can go on (restart the job from its checkpoint)");
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

}  // namespace tandem::ft
