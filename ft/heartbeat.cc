// The replicas' liveness (ft/heartbeat.h).
#include "tandem/ft/heartbeat.h"

#include <unistd.h>

#include <sstream>

#include "tandem/ddp/peers.h"

namespace tandem::ft {

Heartbeat::Heartbeat(c10::intrusive_ptr<c10d::Store> store, int id, int max_replicas,
                     std::chrono::milliseconds interval, std::chrono::milliseconds timeout)
    : store_(std::move(store)),
      id_(id),
      max_(max_replicas),
      interval_(interval),
      timeout_(timeout),
      my_host_(ddp::this_host()),
      peers_(static_cast<size_t>(max_replicas)) {
  const std::string pid = std::to_string(::getpid());
  const std::string me = my_host_ + "\n" + pid + "\n" + ddp::proc_start_and_state(pid).first;
  store_->set("who/" + std::to_string(id_), std::vector<uint8_t>(me.begin(), me.end()));
  store_->add("hb/" + std::to_string(id_), 1);
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

void Heartbeat::read_who(int id, Peer& peer) {
  const std::string key = "who/" + std::to_string(id);
  if (!store_->check({key})) return;
  const auto bytes = store_->get(key);
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  std::string pid;
  std::getline(in, peer.host);
  std::getline(in, pid);
  std::getline(in, peer.start);
  peer.pid = std::strtoll(pid.c_str(), nullptr, 10);
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
        if (j == id_ || c == p.count) continue;
        // Moved (or seen for the first time): alive from now; a new
        // incarnation of the replica may have published itself anew.
        if (c > 0) {
          p.changed = now;
          if (p.exited || p.pid == 0) reread.push_back(j);
        }
        p.count = c;
      }
    }
    for (int j : reread) {
      Peer fresh;
      read_who(j, fresh);
      std::lock_guard<std::mutex> lock(mu_);
      Peer& p = peers_[static_cast<size_t>(j)];
      if (fresh.pid != p.pid || fresh.start != p.start) {
        p.host = fresh.host;
        p.pid = fresh.pid;
        p.start = fresh.start;
        p.exited = false;
      }
    }
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

void Heartbeat::saw(int id, const std::string& host, int64_t pid, const std::string& start) {
  if (id == id_ || id < 0 || id >= max_) return;
  std::lock_guard<std::mutex> lock(mu_);
  Peer& p = peers_[static_cast<size_t>(id)];
  if (p.pid != pid || p.start != start || p.host != host) {
    p.host = host;
    p.pid = pid;
    p.start = start;
    p.exited = false;
  }
  if (!p.exited) {
    p.changed = Clock::now();
    if (p.count <= 0) p.count = 1;
  }
}

bool Heartbeat::alive(int id) const {
  if (id == id_) return true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (id < 0 || id >= max_ || peers_[static_cast<size_t>(id)].count <= 0) return false;
  }
  return why_gone(id).empty();
}

std::string Heartbeat::why_gone(int id) const {
  if (id == id_) return {};
  std::lock_guard<std::mutex> lock(mu_);
  if (id < 0 || id >= max_) return "replica " + std::to_string(id) + " does not exist";
  const Peer& p = peers_[static_cast<size_t>(id)];
  const std::string who = "replica " + std::to_string(id);
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

std::string Heartbeat::store_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return store_error_;
}

}  // namespace tandem::ft
