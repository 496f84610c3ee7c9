// The replicas' liveness (ft/heartbeat.h).
#include "tandem/ft/heartbeat.h"

#include <unistd.h>

#include <sstream>

#include "tandem/ddp/peers.h"

namespace tandem::ft {

Heartbeat::Heartbeat(c10::intrusive_ptr<c10d::Store> store, int id, int max_replicas,
                     std::chrono::milliseconds interval, std::chrono::milliseconds timeout,
                     int per_replica)
    : store_(std::move(store)),
      id_(id),
      max_(max_replicas),
      per_replica_(per_replica),
      interval_(interval),
      timeout_(timeout),
      my_host_(ddp::this_host()),
      peers_(static_cast<size_t>(max_replicas)) {
  const std::string pid = std::to_string(::getpid());
  const std::string me = my_host_ + "\n" + pid + "\n" + ddp::proc_start_and_state(pid).first;
  store_->set("who/" + std::to_string(id_), std::vector<uint8_t>(me.begin(), me.end()));
  // This process's incarnation: one above the previous process's of this id
  // (who/<id> is written first, so a reader that sees the new incarnation
  // reads this process there).
  const std::string key = "hb/" + std::to_string(id_);
  for (;;) {
    const int64_t before = store_->add(key, 0);
    const std::string was = std::to_string(before);
    const std::string now = std::to_string((((before >> 32) + 1) << 32) + 1);
    const auto got = store_->compareSet(key, std::vector<uint8_t>(was.begin(), was.end()),
                                        std::vector<uint8_t>(now.begin(), now.end()));
    if (std::string(got.begin(), got.end()) == now) break;
  }
  tick();
  thread_ = std::thread([this] { run(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Heartbeat::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, interval_);
    if (stop_) break;
    lock.unlock();
    tick();
    lock.lock();
  }
}

void Heartbeat::tick() {
  try {
    store_->add("hb/" + std::to_string(id_), 1);
    const int64_t epoch = store_->add("epoch", 0);
    std::vector<int64_t> counts(static_cast<size_t>(max_), -1);
    for (int j = 0; j < max_; ++j) {
      if (j != id_) counts[static_cast<size_t>(j)] = store_->add("hb/" + std::to_string(j), 0);
    }
    const Clock::time_point now = Clock::now();
    std::vector<int> reread;
    {
      std::lock_guard<std::mutex> lock(mu_);
      epoch_.store(epoch);
      store_error_.clear();
      // This process did not look for a while (it was stopped, or starved):
      // what it saw before says nothing of the others' silence since.
      if (looked_ != Clock::time_point{} && now - looked_ > 2 * interval_ + timeout_ / 4) {
        for (Peer& p : peers_) p.changed = now;
      }
      looked_ = now;
      for (int j = 0; j < max_; ++j) {
        Peer& p = peers_[static_cast<size_t>(j)];
        const int64_t c = counts[static_cast<size_t>(j)];
        if (j == id_) continue;
        // Another process of this id (or one not read yet): read who it is.
        if (c > 0 && (c >> 32) != p.inc) reread.push_back(j);
        if (c == p.count) continue;
        if (c > 0) p.changed = now;  // moved (or seen for the first time): alive from now
        p.count = c;
      }
    }
    for (int j : reread) {
      const std::string key = "who/" + std::to_string(j);
      if (!store_->check({key})) continue;
      const auto bytes = store_->get(key);
      std::istringstream in(std::string(bytes.begin(), bytes.end()));
      std::string host, pid, start;
      std::getline(in, host);
      std::getline(in, pid);
      std::getline(in, start);
      std::lock_guard<std::mutex> lock(mu_);
      Peer& p = peers_[static_cast<size_t>(j)];
      p.inc = counts[static_cast<size_t>(j)] >> 32;
      const int64_t n = std::strtoll(pid.c_str(), nullptr, 10);
      if (n != p.pid || start != p.start || host != p.host) {
        p.host = host;
        p.pid = n;
        p.start = start;
        p.exited = false;
      }
    }
    std::vector<std::string> discard;
    {
      std::lock_guard<std::mutex> lock(mu_);
      discard.swap(discard_);
    }
    for (const std::string& key : discard) store_->deleteKey(key);
    // A process on this host that has exited is gone at once.
    std::lock_guard<std::mutex> lock(mu_);
    for (int j = 0; j < max_; ++j) {
      Peer& p = peers_[static_cast<size_t>(j)];
      if (j == id_ || p.exited || p.pid <= 0 || p.host != my_host_ ||
          p.pid == static_cast<int64_t>(::getpid())) {
        continue;
      }
      auto [start, state] = ddp::proc_start_and_state(std::to_string(p.pid));
      if (start.empty() || state == 'Z' || state == 'X' || start != p.start) p.exited = true;
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu_);
    store_error_ = e.what();
  }
}

std::string Heartbeat::me() const {
  const std::string pid = std::to_string(::getpid());
  return pid + " " + ddp::proc_start_and_state(pid).first + " " + my_host_;
}

void Heartbeat::members(const std::vector<Process>& members) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int j = 0; j < max_; ++j) {
    Peer& p = peers_[static_cast<size_t>(j)];
    p.member_host.clear();
    p.member_pid = 0;
    p.member_start.clear();
  }
  for (const Process& m : members) {
    if (m.id == id_ || m.id < 0 || m.id >= max_) continue;
    Peer& p = peers_[static_cast<size_t>(m.id)];
    p.member_host = m.host;
    p.member_pid = m.pid;
    p.member_start = m.start;
    if (p.pid != m.pid || p.start != m.start || p.host != m.host) {
      // Newer than what this thread read: who/<id> is read again at the
      // next tick (it may name a process newer still).
      p.host = m.host;
      p.pid = m.pid;
      p.start = m.start;
      p.exited = false;
      p.inc = -1;
    }
    if (!p.exited) {
      p.changed = Clock::now();
      if (p.count <= 0) p.count = 1;
    }
  }
}

bool Heartbeat::alive(int id) const {
  if (id == id_) return true;
  std::lock_guard<std::mutex> lock(mu_);
  if (id < 0 || id >= max_ || peers_[static_cast<size_t>(id)].count <= 0) return false;
  return why_gone_locked(id).empty();
}

bool Heartbeat::alive_as(int id, const std::string& host, int64_t pid,
                         const std::string& start) const {
  if (id == id_) return pid == static_cast<int64_t>(::getpid());
  std::lock_guard<std::mutex> lock(mu_);
  if (id < 0 || id >= max_) return false;
  const Peer& p = peers_[static_cast<size_t>(id)];
  if (p.count <= 0 || p.pid != pid || p.start != start || p.host != host) return false;
  return why_gone_locked(id, false).empty();
}

bool Heartbeat::gone_for_good(int id, const std::string& host, int64_t pid,
                              const std::string& start) const {
  if (id == id_) return pid != static_cast<int64_t>(::getpid());
  std::lock_guard<std::mutex> lock(mu_);
  if (id < 0 || id >= max_) return true;
  const Peer& p = peers_[static_cast<size_t>(id)];
  if (p.pid == 0) return false;  // not read yet
  if (p.pid != pid || p.start != start || p.host != host) return true;
  return p.exited;
}

std::string Heartbeat::why_gone(int id) const {
  if (id == id_) return {};
  std::lock_guard<std::mutex> lock(mu_);
  return why_gone_locked(id);
}

std::string Heartbeat::why_gone_locked(int id, bool as_member) const {
  if (id < 0 || id >= max_) return "process " + std::to_string(id) + " does not exist";
  const Peer& p = peers_[static_cast<size_t>(id)];
  std::string who = "replica " + std::to_string(id / per_replica_);
  if (per_replica_ > 1) who += " rank " + std::to_string(id % per_replica_);
  if (as_member && p.member_pid != 0 &&
      (p.member_pid != p.pid || p.member_start != p.start || p.member_host != p.host)) {
    return who + " is gone (its process " + std::to_string(p.member_pid) + " on " + p.member_host +
           " was replaced by process " + std::to_string(p.pid) + " on " + p.host + ")";
  }
  if (p.exited) return who + " is gone (its process " + std::to_string(p.pid) + " exited)";
  // Not seen yet (it started after this replica's last look): no verdict.
  if (p.count <= 0) return {};
  // A view older than a few intervals is no ground for a verdict (this
  // process was stopped: its heartbeat thread has not looked since).
  if (Clock::now() - looked_ > 2 * interval_ + timeout_ / 4) return {};
  const auto silent =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - p.changed);
  if (silent > timeout_) {
    return who + " sent no heartbeat for " + std::to_string(silent.count()) + " ms";
  }
  return {};
}

void Heartbeat::discard(std::vector<std::string> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  discard_.insert(discard_.end(), keys.begin(), keys.end());
}

std::string Heartbeat::store_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_error_;
}

}  // namespace tandem::ft
