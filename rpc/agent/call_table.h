// CallTable: the calls one agent has in flight, their deadlines, and the
// agent's timer thread.
//
//  1. add() registers a call (id -> its future, peer, connection, deadline)
//     before its request is written; it refuses once close_new() was called.
//  2. Each call completes exactly once, by whichever comes first: its reply
//     (complete / fail with the connection it came on: a reply from another
//     connection is dropped), its deadline (TimeoutError from the timer
//     thread), its connection closing, or shutdown (fail_where). An id no
//     longer in the table is a late reply: dropped.
//  3. The future is completed outside the table's lock, on the thread that
//     completed the call (loop, timer or caller); Future::then moves user
//     callbacks to the pool.
//  4. The timer thread also runs schedule_after() tasks, by posting them.
//     It sleeps until the earliest deadline, but never longer than a tick, so
//     a call whose deadline is further off need not wake it.
// One mutex guards the table; nothing else in the agent takes it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tandem/rpc/future.h"
#include "tandem/rpc/metrics.h"
#include "tandem/rpc/trace.h"

namespace tandem::rpc {

// A call's timeout is capped here (a year): longer ones, and deadlines a
// peer sends, are treated as this and cannot overflow the clock.
constexpr std::chrono::milliseconds kMaxTimeout{365ll * 24 * 3600 * 1000};

class CallTable {
 public:
  using Clock = std::chrono::steady_clock;
  struct Call {
    RawFuture future;
    int peer = -1;
    uint64_t conn_id = 0;
    // Its request was written to conn_id (a call registered on a connection
    // that turned out to be retired is sent again elsewhere: losing that
    // connection must not fail it).
    bool sent = false;
    std::string callee;
    bool has_deadline = false;
    Clock::time_point deadline;
    Clock::time_point started;  // for the callee's latency (metrics.h)
    uint64_t id = 0;            // set by add()
    long tid = 0;               // the calling thread, for the trace (rpc/trace.h)
    bool overlapped = false;    // another call of tid was in flight meanwhile
  };

  // `post` runs a due schedule_after() task (on the agent's pool);
  // `worker_name` names a rank in timeout messages.
  CallTable(std::function<void(std::function<void()>)> post,
            std::function<std::string(int)> worker_name, MetricsRecorder* metrics = nullptr);
  ~CallTable();
  CallTable(const CallTable&) = delete;
  CallTable& operator=(const CallTable&) = delete;

  // False (and nothing added) once close_new() was called.
  bool add(uint64_t id, Call call);
  // Completes call `id` if it is still in the table (and, with from_conn
  // set, was sent on that connection).
  void complete(uint64_t id, c10::IValue value, uint64_t from_conn);
  void fail(uint64_t id, std::exception_ptr error, uint64_t from_conn);
  // Fails every call for which `pred` holds with `error(call)`.
  void fail_where(const std::function<bool(const Call&)>& pred,
                  const std::function<std::exception_ptr(const Call&)>& error);
  // Runs `fn` (through `post`) after `delay`; dropped once stopped.
  void schedule_after(std::chrono::microseconds delay, std::function<void()> fn);

  // True while a call sent on connection `conn_id` waits for its answer.
  bool any_on(uint64_t conn_id) const;
  // Call `id` goes on connection `conn_id` now (its request is sent again
  // there); false when it is no longer in the table.
  bool move_to(uint64_t id, uint64_t conn_id);
  // Call `id`'s request was written to its connection.
  void mark_sent(uint64_t id);
  // The calls in flight now, oldest first (Agent::debug_info).
  struct Pending {
    uint64_t id;
    std::string callee;
    int peer;
    bool sent;
    std::chrono::milliseconds age;
    std::optional<std::chrono::milliseconds> left;  // until the deadline
  };
  std::vector<Pending> snapshot() const;
  bool accepting() const;
  void close_new();  // add() refuses from now on
  void wait_idle();  // until no call is in flight
  size_t size() const;
  void stop();  // stops and joins the timer thread; idempotent

  // With tracing on (rpc/trace.h): each call that ends becomes a slice on
  // its thread, or a send slice and an async span when it overlapped
  // another call of that thread; its flow id is self_rank << 48 | call id.
  // Set before the first call.
  void set_tracer(Tracer* tracer, int self_rank) {
    tracer_ = tracer;
    self_rank_ = self_rank;
  }

 private:
  // Takes `id` out of the table (mu_ held); false when it is not there.
  bool take_locked(uint64_t id, uint64_t from_conn, Call& out);
  void timer_loop();

  const std::function<void(std::function<void()>)> post_;
  const std::function<std::string(int)> worker_name_;
  MetricsRecorder* const metrics_;  // told of every call that ends; may be null
  void count(const Call& c, const std::exception_ptr& error);

  Tracer* tracer_ = nullptr;
  int self_rank_ = 0;
  // Per calling thread, with tracing on: its calls in flight, and when the
  // last one began (a call overlapping another becomes an async span).
  struct ThreadCalls {
    int in_flight = 0;
    Clock::time_point last_start;
  };
  std::unordered_map<long, ThreadCalls> threads_;  // under mu_
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;   // calls_ became empty
  std::condition_variable timer_cv_;  // a new earliest deadline, or stopping
  std::unordered_map<uint64_t, Call> calls_;
  std::multimap<Clock::time_point, uint64_t> deadlines_;
  std::multimap<Clock::time_point, std::function<void()>> timers_;
  bool accepting_ = true;
  bool timer_stop_ = false;
  // When the sleeping timer thread will wake by itself (min: it is awake).
  Clock::time_point timer_wake_ = Clock::time_point::min();
  std::thread timer_;
};

}  // namespace tandem::rpc
