// Healing (ft/manager.h, 5.): a member behind the quorum receives the whole
// state from one up-to-date member over the quorum's group (with replicas of
// several processes, rank r of it from rank r of an up-to-date replica, over
// the group of the rank-r processes).
//
// The source sends, with point-to-point sends on the group: the header's
// length, the header ("<step> <cursor>" and a line per tensor: its name,
// dtype and shape), then each tensor that has elements, in the header's
// order. Every byte goes once, to the one member that needs it.
#include <ATen/ops/empty.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <optional>
#include <sstream>

#include "tandem/ddp/process_group.h"
#include "tandem/ft/joined.h"

namespace tandem::ft {

namespace {

using Clock = std::chrono::steady_clock;

// A heal's transfers, watched: a thread asks `stalled` every 50 ms while
// one is in flight and aborts it once the peer is gone (stopped, cut off,
// or the quorum moved on), so that neither end waits out the collective
// timeout for a peer that will not come (a send to a stopped process blocks
// once the socket's buffer is full; a receive from one never ends).
class Watch {
 public:
  explicit Watch(std::function<std::string()> stalled) : stalled_(std::move(stalled)) {
    if (!stalled_) return;
    thread_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!stop_) {
        cv_.wait_for(lock, std::chrono::milliseconds(50));
        if (stop_ || !work_) continue;
        lock.unlock();
        std::string why = stalled_();
        lock.lock();
        if (!why.empty() && work_ && why_.empty()) {
          why_ = std::move(why);
          work_->abort();
        }
      }
    });
  }
  ~Watch() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

  void wait(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout,
            const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!why_.empty()) throw ddp::CollectiveError(what + " failed: " + why_);
      work_ = work;
    }
    std::string error;
    bool completed = false;
    try {
      completed = work->wait(timeout);
    } catch (const std::exception& e) {
      error = e.what();
      if (auto nl = error.find('\n'); nl != std::string::npos) error.resize(nl);
    }
    std::lock_guard<std::mutex> lock(mu_);
    work_.reset();
    if (!why_.empty()) throw ddp::CollectiveError(what + " failed: " + why_);
    if (!error.empty()) throw ddp::CollectiveError(what + " failed: " + error);
    if (!completed) throw ddp::CollectiveError(what + " failed: aborted");
  }

 private:
  std::function<std::string()> stalled_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  c10::intrusive_ptr<c10d::Work> work_;
  std::string why_;
  std::thread thread_;
};

}  // namespace

void Manager::heal(const std::vector<Joined>& members, const std::vector<Joined>& all) {
  int64_t newest = 0;
  for (const Joined& m : all) newest = std::max(newest, m.step);
  // Up to date: at the newest step. A job's first quorum (no step yet) takes
  // its first member's state, as DDP broadcasts rank 0's.
  std::vector<int> sources, behind;  // places in the quorum
  for (int i = 0; i < static_cast<int>(members.size()); ++i) {
    const bool fresh = newest > 0 ? members[static_cast<size_t>(i)].step == newest : i == 0;
    (fresh ? sources : behind).push_back(i);
  }
  if (behind.empty()) return;
  if (sources.empty()) {
    // (the proposer takes a whole replica at the newest step as reference:
    // one of its processes is here, at that step)
    throw ddp::CollectiveError("healing: no member of this rank holds step " +
                               std::to_string(newest));
  }
  auto& pg = group_->c10d();
  const auto timeout = options_.collective_timeout;
  Watch watch(stalled_);
  // A source's state, taken once for all the members it heals (saving
  // serialises each parameter's optimizer state).
  std::optional<std::vector<std::pair<std::string, at::Tensor>>> saved;
  for (size_t b = 0; b < behind.size(); ++b) {
    const int to = behind[b];
    const int from = sources[b % sources.size()];
    if (rank_in_quorum_ == from) {
      if (!saved) saved = state_.save();
      const auto& tensors = *saved;
      std::ostringstream header;
      header << step_ << " " << cursor_ << "\n";
      int64_t bytes = 0;
      for (const auto& [name, t] : tensors) {
        header << name << "\t" << static_cast<int>(t.scalar_type());
        for (int64_t d : t.sizes()) header << "\t" << d;
        header << "\n";
        bytes += static_cast<int64_t>(t.numel()) * t.element_size();
      }
      const std::string h = header.str();
      std::vector<at::Tensor> len{at::empty({1}, at::kLong)};
      len[0].fill_(static_cast<int64_t>(h.size()));
      watch.wait(pg.send(len, to, 0), timeout, "sending the state's header");
      std::vector<at::Tensor> head{at::empty({static_cast<int64_t>(h.size())}, at::kByte)};
      std::memcpy(head[0].data_ptr(), h.data(), h.size());
      watch.wait(pg.send(head, to, 1), timeout, "sending the state's header");
      int tag = 2;
      for (const auto& [name, t] : tensors) {
        if (t.numel() == 0) continue;
        std::vector<at::Tensor> one{t.detach().contiguous().cpu()};
        watch.wait(pg.send(one, to, tag++), timeout, "sending " + name);
      }
      metrics_.heal_bytes_sent += bytes + static_cast<int64_t>(h.size()) + 8;
      metrics_.state_bytes = bytes;
    } else if (rank_in_quorum_ == to) {
      const auto t0 = Clock::now();
      std::vector<at::Tensor> len{at::empty({1}, at::kLong)};
      watch.wait(pg.recv(len, from, 0), timeout, "receiving the state's header");
      const int64_t n = len[0].item<int64_t>();
      if (n <= 0 || n > (int64_t{1} << 30)) {
        throw ddp::CollectiveError("healing: the source sent a header of " + std::to_string(n) +
                                   " bytes");
      }
      std::vector<at::Tensor> head{at::empty({n}, at::kByte)};
      watch.wait(pg.recv(head, from, 1), timeout, "receiving the state's header");
      std::istringstream in(
          std::string(static_cast<const char*>(head[0].data_ptr()), static_cast<size_t>(n)));
      int64_t step = 0, cursor = 0;
      in >> step >> cursor;
      std::string line;
      std::getline(in, line);
      std::vector<std::pair<std::string, at::Tensor>> received;
      int64_t bytes = 0;
      int tag = 2;
      while (std::getline(in, line)) {
        std::istringstream fields(line);
        std::string name, field;
        std::getline(fields, name, '\t');
        std::getline(fields, field, '\t');
        const auto dtype = static_cast<c10::ScalarType>(std::stoi(field));
        std::vector<int64_t> shape;
        while (std::getline(fields, field, '\t')) shape.push_back(std::stoll(field));
        at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
        if (t.numel() > 0) {
          std::vector<at::Tensor> one{t};
          watch.wait(pg.recv(one, from, tag++), timeout, "receiving " + name);
        }
        bytes += static_cast<int64_t>(t.numel()) * t.element_size();
        received.emplace_back(std::move(name), std::move(t));
      }
      state_.load(received);
      step_ = step;
      cursor_ = cursor;
      ++metrics_.heals;
      metrics_.heal_bytes_received += bytes + n + 8;
      metrics_.state_bytes = bytes;
      metrics_.last_heal_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    }
  }
}

}  // namespace tandem::ft
