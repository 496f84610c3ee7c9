#include "tandem/rpc/agent/call_table.h"

#include "tandem/rpc/errors.h"

#include <algorithm>

namespace tandem::rpc {
namespace {
// The timer thread wakes at least this often (so far-off deadlines need not
// wake it when they are set).
constexpr std::chrono::milliseconds kTimerTick{20};
}  // namespace

CallTable::CallTable(std::function<void(std::function<void()>)> post,
                     std::function<std::string(int)> worker_name, MetricsRecorder* metrics)
    : post_(std::move(post)), worker_name_(std::move(worker_name)), metrics_(metrics) {
  timer_ = std::thread([this] { timer_loop(); });
}

CallTable::~CallTable() { stop(); }

void CallTable::count(const Call& c, const std::exception_ptr& error) {
  const auto now = Clock::now();
  if (metrics_) metrics_->call_done(c.callee, now - c.started, error);
  if (tracer_) {
    const uint64_t flow = (static_cast<uint64_t>(self_rank_) << 48) | c.id;
    const std::string args = std::string("{\"to\":") + std::to_string(c.peer) +
                             ",\"ok\":" + (error ? "false" : "true") + "}";
    if (!c.overlapped) {
      tracer_->slice(c.callee, "rpc", c.started, now, {flow, 0, 0, flow | Tracer::kReplyFlow}, args,
                     c.tid);
    } else {
      // Overlapping slices on one thread do not nest: the send stays on the
      // thread (where the flow starts), the wait gets a track of its own.
      tracer_->slice(c.callee, "rpc", c.started, c.started + std::chrono::microseconds(1),
                     {flow, 0, 0, 0}, args, c.tid);
      tracer_->span(c.callee, "rpc.async", flow, c.started, now, args);
    }
  }
}

bool CallTable::add(uint64_t id, Call call) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!accepting_) return false;
  if (call.has_deadline) {
    deadlines_.emplace(call.deadline, id);
    // The timer thread wakes by timer_wake_ anyway; waking it for a later
    // deadline would cost a context switch per call.
    if (call.deadline < timer_wake_) timer_cv_.notify_one();
  }
  call.id = id;
  if (tracer_ && call.tid) {
    auto& t = threads_[call.tid];
    if (t.in_flight++ > 0) call.overlapped = true;
    t.last_start = call.started;
  }
  calls_.emplace(id, std::move(call));
  return true;
}

bool CallTable::take_locked(uint64_t id, uint64_t from_conn, Call& out) {
  auto it = calls_.find(id);
  // Unknown ids are late replies to calls that already timed out (or replies
  // from a connection the call was not sent on): dropped.
  if (it == calls_.end() || (from_conn != 0 && it->second.conn_id != from_conn)) return false;
  out = std::move(it->second);
  calls_.erase(it);
  if (tracer_ && out.tid) {
    auto t = threads_.find(out.tid);
    if (t != threads_.end()) {
      // Another call of the thread is in flight, or began after this one.
      if (--t->second.in_flight > 0 || t->second.last_start > out.started) out.overlapped = true;
      if (t->second.in_flight == 0) threads_.erase(t);
    }
  }
  if (out.has_deadline) {
    auto range = deadlines_.equal_range(out.deadline);
    for (auto d = range.first; d != range.second; ++d) {
      if (d->second == id) {
        deadlines_.erase(d);
        break;
      }
    }
  }
  if (calls_.empty()) idle_cv_.notify_all();
  return true;
}

void CallTable::complete(uint64_t id, c10::IValue value, uint64_t from_conn) {
  Call c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!take_locked(id, from_conn, c)) return;
  }
  count(c, nullptr);
  c.future->markCompleted(std::move(value));
}

void CallTable::fail(uint64_t id, std::exception_ptr error, uint64_t from_conn) {
  Call c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!take_locked(id, from_conn, c)) return;
  }
  count(c, error);
  c.future->setError(std::move(error));
}

void CallTable::fail_where(const std::function<bool(const Call&)>& pred,
                           const std::function<std::exception_ptr(const Call&)>& error) {
  std::vector<Call> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint64_t> ids;
    for (const auto& [id, c] : calls_) {
      if (pred(c)) ids.push_back(id);
    }
    for (uint64_t id : ids) {
      failed.emplace_back();
      take_locked(id, 0, failed.back());
    }
  }
  for (auto& c : failed) {
    auto e = error(c);
    count(c, e);
    c.future->setError(std::move(e));
  }
}

void CallTable::schedule_after(std::chrono::microseconds delay, std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (timer_stop_) return;
  auto at = Clock::now() + delay;
  timers_.emplace(at, std::move(fn));
  if (at < timer_wake_) timer_cv_.notify_one();
}

bool CallTable::accepting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return accepting_;
}

void CallTable::close_new() {
  std::lock_guard<std::mutex> lock(mu_);
  accepting_ = false;
}

void CallTable::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return calls_.empty(); });
}

size_t CallTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_.size();
}

void CallTable::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    timer_stop_ = true;
    timer_cv_.notify_all();
  }
  if (timer_.joinable() && timer_.get_id() != std::this_thread::get_id()) timer_.join();
}

void CallTable::timer_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!timer_stop_) {
    // Sleep until the earliest deadline or timer, but never longer than
    // kTimerTick: then a call whose deadline is further away than that need
    // not wake this thread (see add()).
    auto now = Clock::now();
    auto first = now + kTimerTick;
    if (!deadlines_.empty()) first = std::min(first, deadlines_.begin()->first);
    if (!timers_.empty()) first = std::min(first, timers_.begin()->first);
    if (now < first) {
      timer_wake_ = first;
      timer_cv_.wait_until(lock, first);
      timer_wake_ = Clock::time_point::min();  // awake: nothing needs to wake it
      continue;
    }
    std::vector<Call> expired;
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      expired.emplace_back();
      if (!take_locked(deadlines_.begin()->second, 0, expired.back())) {
        deadlines_.erase(deadlines_.begin());  // cannot happen: taken calls lose their deadline
        expired.pop_back();
      }
    }
    std::vector<std::function<void()>> due;
    while (!timers_.empty() && timers_.begin()->first <= now) {
      due.push_back(std::move(timers_.begin()->second));
      timers_.erase(timers_.begin());
    }
    lock.unlock();
    for (auto& c : expired) {
      auto e = std::make_exception_ptr(
          TimeoutError("call to '" + c.callee + "' on " + worker_name_(c.peer) + " timed out"));
      count(c, e);
      c.future->setError(std::move(e));
    }
    for (auto& fn : due) post_(std::move(fn));
    lock.lock();
  }
}

bool CallTable::any_on(uint64_t conn_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, call] : calls_) {
    if (call.conn_id == conn_id) return true;
  }
  return false;
}

void CallTable::mark_sent(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(id);
  if (it != calls_.end()) it->second.sent = true;
}

bool CallTable::move_to(uint64_t id, uint64_t conn_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(id);
  if (it == calls_.end()) return false;
  it->second.conn_id = conn_id;
  return true;
}

std::vector<CallTable::Pending> CallTable::snapshot() const {
  const auto now = Clock::now();
  std::vector<Pending> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, c] : calls_) {
    Pending p{id,
              c.callee,
              c.peer,
              c.sent,
              std::chrono::duration_cast<std::chrono::milliseconds>(now - c.started),
              std::nullopt};
    if (c.has_deadline) {
      p.left = std::chrono::duration_cast<std::chrono::milliseconds>(c.deadline - now);
    }
    out.push_back(std::move(p));
  }
  std::sort(out.begin(), out.end(),
            [](const Pending& a, const Pending& b) { return a.age > b.age; });
  return out;
}

}  // namespace tandem::rpc
