// Gradients and the vote (ft/manager.h 2. to 4.): the mean over the
// quorum, the two-phase vote at the store, the fingerprint. The keys are
// listed in manager.cc.
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>

#include "tandem/ddp/process_group.h"
#include "tandem/ft/common.h"
#include "tandem/ft/heartbeat.h"
#include "tandem/ft/manager.h"

namespace tandem::ft {

using namespace detail;

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
        error_ = name_of(proc_) +
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
  if (error_.empty()) error_ = name_of(proc_) + " reported: " + why;
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
  // Every process of the quorum votes; fingerprints are compared among the
  // processes of one replica_rank (each holds its shard of the model).
  const int k = static_cast<int>(procs_.size());
  const int my_place = static_cast<int>(std::find(procs_.begin(), procs_.end(), proc_) -
                                        procs_.begin());
  auto decide = [&](const std::string& what) {
    store_->compareSet(v + "decision", {}, bytes_of(what + "\n" + sign(v + what)));
  };
  std::string decision;
  bool deciding = false;
  try {
    if (error_.empty()) {
      store_->set(v + "fp/" + std::to_string(my_place), bytes_of(fingerprint()));
      if (store_->add(v + "ok", 1) >= k) {
        deciding = true;
        // The last to vote well decides: every fingerprint must agree. (A
        // count that an add retried through an etcd election counted twice
        // is caught here: a vote missing its fingerprint decides nothing.)
        // (replica_rank, fingerprint) -> the replicas holding it
        std::map<std::pair<int, std::string>, std::vector<int>> by_fp;
        bool all_voted = true;
        for (int r = 0; r < k && all_voted; ++r) {
          const std::string fp = get_if(*store_, v + "fp/" + std::to_string(r));
          if (fp.empty()) all_voted = false;
          const int p = procs_[static_cast<size_t>(r)];
          by_fp[{p % size_, fp}].push_back(p / size_);
        }
        std::map<int, int> kinds;  // fingerprints a rank
        for (const auto& entry : by_fp) ++kinds[entry.first.first];
        const bool agree = std::all_of(kinds.begin(), kinds.end(),
                                       [](const auto& rank_kinds) { return rank_kinds.second == 1; });
        if (!all_voted) {
          deciding = false;
        } else if (agree) {
          const bool join = store_->check({"q/" + std::to_string(epoch_ + 1) + "/any"});
          decide(join ? "commit join" : "commit");
        } else {
          std::string who;
          for (const auto& [rank_fp, ids] : by_fp) {
            if (kinds[rank_fp.first] == 1) continue;
            who += who.empty() ? "" : "; ";
            who += "replica";
            who += ids.size() > 1 ? "s " : " ";
            for (size_t i = 0; i < ids.size(); ++i) who += (i ? ", " : "") + std::to_string(ids[i]);
            if (size_ > 1) who += " (rank " + std::to_string(rank_fp.first) + ")";
            who += " hold" + std::string(ids.size() > 1 ? "" : "s") + " fingerprint " +
                   rank_fp.second;
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
    const std::vector<int> ids = procs_;
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
    cursor_ += static_cast<int64_t>(members_.size()) * options_.batch_size;
    ++metrics_.steps_committed;
    if (decision == "commit join") reform_ = true;
    return true;
  }
  ++metrics_.steps_failed;
  reform_ = true;
  if (error_.empty()) error_ = decision.substr(decision.find(' ') + 1);
  if (log_on()) {
    std::fprintf(stderr, "ft: %s: step %lld failed: %s\n", name_of(proc_).c_str(),
                 static_cast<long long>(step_ + 1), decision.c_str());
  }
  if (group_) group_->abandon();
  if (decision.rfind("diverged ", 0) == 0) {
    throw DivergenceError("ft::Manager: " + decision.substr(9));
  }
  return false;
}

}  // namespace tandem::ft
