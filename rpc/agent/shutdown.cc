// Shutting an agent down: graceful (wait for this worker's work, meet every
// worker at a store barrier so nobody closes while someone still calls it,
// then close) or not (fail everything pending and close now).
#include "tandem/rpc/agent/agent_impl.h"

#include <cstdio>
#include <thread>

#include "tandem/rpc/agent/call_table.h"
#include "tandem/rpc/agent/connection_table.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/rendezvous/worker_entry.h"
#include "tandem/rpc/rref_context.h"

namespace tandem::rpc {
namespace {

// The first line of a (c10) error message, which goes on with a C++ trace.
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

void AgentImpl::barrier(const std::string& key, bool wait) {
  const std::string k = "tandem/barrier/" + key;
  const std::string done = k + "/done";
  const std::string where =
      (store_address_.empty() ? "the rendezvous store"
                              : "the rendezvous store at " + store_address_) +
      (store_hosted_by_launcher() ? " (hosted by the launcher)"
                                  : " (hosted by " + workers_[0].name + ", rank 0)");
  auto store_lost = [&](const std::exception& e) {
    return DisconnectedError("graceful shutdown of " + name() + " lost " + where + ": " +
                             printable(first_line(e.what())));
  };
  try {
    store_->set(k + "/" + std::to_string(rank_), store_bytes("1"));  // who arrived
    if (store_->add(k, 1) == world_size()) store_->set(done, store_bytes("1"));
  } catch (const std::exception& e) {
    throw store_lost(e);
  }
  if (!wait) return;
  // Poll rather than wait: a c10d wait that times out cannot be taken back
  // (its late answer would be read as the next command's), and between
  // polls the workers that have not arrived are checked. One that no longer
  // accepts connections has died, and will never arrive: say so at once
  // instead of waiting out init_timeout. A worker may sit here for a whole
  // training run (a parameter server, a bench's peer), so the polls thin
  // out to ten a second, each one small request to the store, and the
  // check of who is missing runs once a second. The thinning waits two
  // seconds: a job's workers mostly arrive within milliseconds of each
  // other, and a pause that had already doubled to 64 ms made rank 0, which
  // waits for every worker to leave, see the last one up to that late (a
  // 16-worker job's shutdown lost about 60 ms that way).
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + options_.init_timeout;
  auto pause = std::chrono::milliseconds(1);
  auto next_probe = start + std::chrono::milliseconds(200);
  auto missing = [&] {
    std::vector<int> out;
    for (int r = 0; r < world_size(); ++r) {
      if (r != rank_ && !store_->check({k + "/" + std::to_string(r)})) out.push_back(r);
    }
    return out;
  };
  for (;;) {
    try {
      if (store_->check({done})) return;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        std::string names;
        for (int r : missing()) names += (names.empty() ? "" : ", ") + workers_[r].name;
        throw TimeoutError("graceful shutdown of " + name() +
                           " did not meet the other workers within " +
                           std::to_string(options_.init_timeout.count()) + " ms" +
                           (names.empty() ? "" : ": not arrived: " + names));
      }
      if (now >= next_probe) {
        next_probe = now + std::chrono::seconds(1);
        std::string gone;
        for (int r : missing()) {
          const std::string why = unreachable_reason(r);
          if (why.empty()) continue;
          // It may have arrived, and closed, since the check above.
          if (store_->check({done})) return;
          if (store_->check({k + "/" + std::to_string(r)})) continue;
          gone += (gone.empty() ? "" : "; ") + workers_[r].name + " (" + why + ")";
        }
        if (!gone.empty()) {
          throw DisconnectedError("graceful shutdown of " + name() +
                                  ": worker(s) gone before reaching shutdown: " + gone);
        }
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw store_lost(e);
    }
    std::this_thread::sleep_for(pause);
    const bool early = std::chrono::steady_clock::now() - start < std::chrono::seconds(2);
    pause = std::min(pause * 2, std::chrono::milliseconds(early ? 5 : 100));
  }
}

std::string AgentImpl::unreachable_reason(int rank) {
  {
    std::lock_guard<std::mutex> lock(stalled_mu_);
    if (!stalled_[static_cast<size_t>(rank)].empty()) return stalled_[static_cast<size_t>(rank)];
  }
  // An open connection to it is answer enough: its silence would close it
  // (rpc/transport.h, 9.). A worker this one holds none to is dialed, and
  // the connection kept, so that a stopped one (whose kernel still accepts)
  // is found out by its handshake that never comes, then its silence.
  if (auto c = conns_->to(rank); c && !c->closed()) return "";
  if (options_.limits.peer_timeout.count() == 0) {
    // Nothing would find a stalled worker out: a bare TCP connection,
    // closed again at once, tells the dead from the living.
    const WorkerInfo& w = workers_[rank];
    try {
      transport_->connect(w.host, w.port, std::chrono::milliseconds(500))->close("");
      return "";
    } catch (const std::exception& e) {
      return printable(e.what());
    }
  }
  try {
    connection_to(rank, std::chrono::milliseconds(500));
    return "";
  } catch (const std::exception& e) {
    return printable(e.what());
  }
}

void AgentImpl::shutdown(bool graceful) {
  if (pool_ && pool_->in_pool()) {
    throw std::logic_error(
        "shutdown() cannot run on the agent's own pool (inside a handler or callback)");
  }
  std::lock_guard<std::mutex> serial(shutdown_mu_);
  if (shut_down_) return;
  // Where shutdown's time goes, for the trace: drain, meet, close, leave.
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t_start = Clock::now();
  Clock::time_point t_drained = t_start, t_met = t_start;
  std::exception_ptr barrier_error;
  if (graceful && transport_ && calls_) {
    calls_->wait_idle();
    // RRef deletes, confirmations and hand-overs still in flight.
    rrefs_->wait_idle(options_.init_timeout);
    calls_->wait_idle();
    t_drained = Clock::now();
    try {
      barrier("shutdown");
    } catch (const std::exception&) {
      barrier_error = std::current_exception();
    }
    t_met = Clock::now();
  }
  std::vector<std::string> leaked;
  if (graceful && !barrier_error) {
    if (rrefs_) leaked = rrefs_->live_user_refs();
    for (const auto& e : extensions_) {
      for (auto& l : e->live_objects()) leaked.push_back(std::move(l));
    }
  }
  if (rrefs_) rrefs_->close();
  for (const auto& e : extensions_) e->close();
  if (calls_) {
    calls_->close_new();
    calls_->fail_where([](const CallTable::Call&) { return true; },
                       [this](const CallTable::Call& c) {
                         return std::make_exception_ptr(ShutdownError(
                             "agent " + name() + " shut down during '" + c.callee + "'"));
                       });
  }
  if (transport_) transport_->close();
  drop_ipc_held(-1);  // nobody is left to copy from them
  if (calls_) calls_->stop();
  if (pool_) pool_->stop();
  if (conns_) conns_->clear();
  const Clock::time_point t_closed = Clock::now();
  if (graceful && store_ && !barrier_error) {
    // Rank 0 hosts the store when it made it: it stays up until everyone has
    // left the barrier above.
    try {
      barrier("left", /*wait=*/owns_store_ && rank_ == 0);
    } catch (const std::exception&) {
      barrier_error = std::current_exception();
    }
  }
  store_.reset();
  shut_down_ = true;
  if (trace_) {
    const Clock::time_point end = Clock::now();
    trace_->slice(graceful ? "shutdown" : "shutdown (not graceful)", "agent", t_start, end);
    if (graceful) {
      trace_->slice("shutdown: drain", "agent", t_start, t_drained);
      // Waiting at the store until every worker has drained.
      trace_->slice("shutdown: barrier", "agent", t_drained, t_met);
    }
    trace_->slice("shutdown: close", "agent", t_met, t_closed);
    // Saying so at the store; rank 0, which hosts it, waits for everyone.
    if (graceful) trace_->slice("shutdown: leave", "agent", t_closed, end);
    try {
      trace_->write();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tandem[%s]: %s\n", printable(name()).c_str(), e.what());
    }
  }
  if (!leaked.empty()) {
    std::string list;
    for (const auto& l : leaked) list += (list.empty() ? "" : ", ") + l;
    throw ShutdownError("graceful shutdown of " + name() + " found " +
                        std::to_string(leaked.size()) + " object(s) still alive (leaks): " + list);
  }
  if (barrier_error) std::rethrow_exception(barrier_error);
}

}  // namespace tandem::rpc
