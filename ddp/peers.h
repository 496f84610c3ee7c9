// A process group's members (ddp/process_group.h): who each rank is, and,
// after a failure, which of them are gone (exited, or silent at the group's
// store) or stalled (found so by this process's RPC agent, which watches
// them). Internal to ddp/: process_group.cc uses it, peers.cc makes it.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/ddp/process_group.h"
#include "tandem/rpc/agent.h"

namespace tandem::ddp {

std::string this_host();
// Field 22 of /proc/<pid>/stat (when the process started, in clock ticks
// since boot) and its state (field 3); empty when there is no such process.
// Together with the pid, the start time tells a process from a later one
// that reused its number.
std::pair<std::string, char> proc_start_and_state(const std::string& pid);

// Waits at most `limit` for `work` to end, looking every 200 ms at whether
// `stalled` names a member: returns that, or "" once the work ended or the
// time is up (Work::wait then says how it went).
std::string wait_watching(c10d::Work& work, const std::function<std::string()>& stalled,
                          std::chrono::milliseconds limit);

// Who the ranks are (published at creation under who/<incarnation>/<rank>),
// and, once a collective has failed, which of them are gone: worked out
// once per group, by the first failure, and given to every later one.
struct ProcessGroup::Peers {
  int rank = 0;
  int64_t incarnation = 0;
  std::string my_host;
  std::vector<Member> members;
  std::vector<std::string> starts;  // per rank: its process's start time, for the liveness check
  c10::intrusive_ptr<c10d::Store> store;
  std::mutex mu;
  std::optional<std::string> verdict;
  // The agent that watches the members (rpc::Agent::watch), when this
  // process has one and the group is gloo's: a member it finds stalled
  // (stopped, frozen: its connection silent past the peer timeout) fails the
  // collectives that wait for it, instead of their timeout.
  std::weak_ptr<rpc::Agent> watcher;
  // ProcessGroupOptions::stalled, when given.
  std::function<std::string()> also_stalled;
  bool watched() const { return !watcher.expired() || static_cast<bool>(also_stalled); }
  // A collective failed for a stalled member: gloo's operation still waits
  // for it until the group's timeout, and tearing the group down would wait
  // with it.
  std::atomic<bool> stalled_out{false};

  // "rank 1 (worker "w1", ...) is stalled: <why>" for the first member the
  // watcher found stalled; empty when none is (or nothing watches). Asked
  // of the agent at most every 50 ms (polling loops call it through done()).
  std::string stalled() {
    auto agent = watcher.lock();
    if (!agent && !also_stalled) return {};
    std::lock_guard<std::mutex> lock(stalled_mu);
    const auto now = std::chrono::steady_clock::now();
    if (!stalled_text.empty() || now < stalled_next) return stalled_text;
    stalled_next = now + std::chrono::milliseconds(50);
    if (also_stalled) {
      stalled_text = also_stalled();
      if (!stalled_text.empty() || !agent) return stalled_text;
    }
    for (int r = 0; r < static_cast<int>(members.size()); ++r) {
      const Member& m = members[static_cast<size_t>(r)];
      if (r == rank || m.name.empty()) continue;
      try {
        if (std::string why = agent->stalled(m.name); !why.empty()) {
          stalled_text = describe(r) + " is stalled: " + why;
          break;
        }
      } catch (const std::exception&) {
        // (not a worker of this agent's world)
      }
    }
    return stalled_text;
  }
  std::mutex stalled_mu;
  std::string stalled_text;  // once found, for good: the group is broken
  std::chrono::steady_clock::time_point stalled_next{};

  std::string key(const char* what, int r) const {
    return std::string(what) + "/" + std::to_string(incarnation) + "/" + std::to_string(r);
  }

  std::string describe(int r) const {
    std::string s = "rank " + std::to_string(r);
    if (static_cast<size_t>(r) >= members.size()) return s;
    const Member& m = members[static_cast<size_t>(r)];
    s += " (";
    if (!m.name.empty()) s += "worker \"" + m.name + "\", ";
    s += "pid " + std::to_string(m.pid) + " on " + m.host + ")";
    return s;
  }

  // A process on this host that has exited (or is a zombie, or whose
  // number now belongs to another process).
  bool exited(int r) const {
    const Member& m = members[static_cast<size_t>(r)];
    if (m.host != my_host || m.pid <= 0) return false;
    if (m.pid == static_cast<int64_t>(::getpid())) return false;  // ranks as threads of one process
    auto [start, state] = proc_start_and_state(std::to_string(m.pid));
    return start.empty() || state == 'Z' || state == 'X' || start != starts[static_cast<size_t>(r)];
  }

  // "rank 2 (worker "w2", pid 42 on h) is gone (its process exited)", or
  // what else is known; empty when every peer checked in.
  std::string gone() {
    std::lock_guard<std::mutex> lock(mu);
    if (verdict) return *verdict;
    const int n = static_cast<int>(members.size());
    std::vector<int> exited_ranks, silent;
    std::vector<bool> settled(static_cast<size_t>(n), false);
    settled[static_cast<size_t>(rank)] = true;
    for (int r = 0; r < n; ++r) {
      if (r != rank && exited(r)) {
        exited_ranks.push_back(r);
        settled[static_cast<size_t>(r)] = true;
      }
    }
    bool store_lost = false;
    if (also_stalled) {
      // The other watcher knows who is gone: no check-in round at the store.
      std::string text;
      for (int r : exited_ranks) text += (text.empty() ? "" : "; ") + describe(r) + " is gone (its process exited)";
      if (std::string more = also_stalled(); !more.empty()) text += (text.empty() ? "" : "; ") + more;
      verdict = text;
      return text;
    }
    try {
      store->set(key("down", rank), std::vector<uint8_t>{1});
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      for (;;) {
        bool all = true;
        for (int r = 0; r < n; ++r) {
          if (settled[static_cast<size_t>(r)]) continue;
          if (store->check({key("down", r)})) {
            settled[static_cast<size_t>(r)] = true;
          } else {
            all = false;
          }
        }
        if (all || std::chrono::steady_clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    } catch (const std::exception&) {
      store_lost = true;
    }
    if (!store_lost) {
      for (int r = 0; r < n; ++r) {
        if (!settled[static_cast<size_t>(r)]) silent.push_back(r);
      }
    }
    std::string text;
    auto add = [&](const std::string& part) { text += (text.empty() ? "" : "; ") + part; };
    for (int r : exited_ranks) add(describe(r) + " is gone (its process exited)");
    if (!silent.empty()) {
      std::string who;
      for (int r : silent) who += (who.empty() ? "" : ", ") + describe(r);
      add(who + (silent.size() == 1 ? " did" : " did") +
          " not check in within 2 s of the failure (gone, or stuck elsewhere)");
    }
    if (store_lost) {
      add("the group's store cannot be reached (its host, the job's rank 0, may be gone)");
    }
    verdict = text;
    return text;
  }
};

}  // namespace tandem::ddp
