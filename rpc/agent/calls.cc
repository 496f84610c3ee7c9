// The agent's outgoing side: a call from its arguments to its frame on the
// wire, registered in the call table until its reply, deadline or failure.
#include "tandem/rpc/agent/agent_impl.h"
#include "tandem/rpc/agent/call_table.h"
#include "tandem/rpc/agent/spin.h"
#include "tandem/rpc/rref_context.h"
#include "tandem/rpc/stages.h"
#include "tandem/rpc/transport.h"

namespace tandem::rpc {
namespace {
using Clock = std::chrono::steady_clock;
// One sleep on a connection at most (rpc/transport.h, 10.). Whatever
// completes the call rings the bell; the bound is only a backstop.
constexpr std::chrono::microseconds kConnectionSleepSlice{1000000};
}  // namespace

void AgentImpl::spin_until_done(const RawFuture& f) const {
  // A blocked caller is woken by the loop thread when its reply lands. On an
  // idle core that wake-up costs more than a whole loopback round trip, so
  // keep the core busy for a short while first (see AgentOptions::sync_spin).
  // While it spins it reads its connection itself where that can be done
  // (rpc/transport.h, 8.), saving the loop thread's wake-up too.
  PollingSpin polling;
  const auto done = [&] { return f->completed(); };
  if (spin_until(options_.sync_spin, [&] {
        poll_this_threads_connection();
        return done();
      })) {
    TANDEM_STAGE(kSpinDone);
    return;
  }
  // Nothing yet: sleep on the connection itself (rpc/transport.h, 10.), so
  // that the answer wakes this thread and not the loop thread first, which
  // would then wake this one. Whatever else completes the call (the loop
  // thread reading it, its deadline, the connection's end) rings the bell.
  ConnectionSleep sleep;
  if (!sleep.ok() || options_.sync_spin.count() == 0) return;
  f->addCallback([wake = sleep.waker()](c10::ivalue::Future&) { wake(); });
  while (!done() && sleep.wait(kConnectionSleepSlice, done)) {
  }
  // The connection's messages went to the loop thread (an answer carrying
  // RRefs is delivered there): it completes the call soon.
  spin_until(options_.sync_spin, done);
}

Future<c10::IValue> AgentImpl::call(const std::string& to, const std::string& fn,
                                    std::vector<c10::IValue> args,
                                    std::chrono::milliseconds timeout) {
  return Future<c10::IValue>(start_call(to, fn, std::move(args), timeout), pool_);
}

OutFrame AgentImpl::encode_with_extensions(Message& m, int dest, const Connection* via) {
  for (const auto& e : extensions_) e->before_send(m, dest);
  // Forks made here are undone if anything below throws (Forks is RAII).
  const std::vector<DeviceMap>& maps = m.kind == MessageKind::kResponse ? answer_maps_ : send_maps_;
  const DeviceMap* devices =
      dest >= 0 && static_cast<size_t>(dest) < maps.size() ? &maps[dest] : nullptr;
  OutFrame frame = encode(m, options_.limits, rrefs_.get(), dest, devices, ipc_to(dest, via));
  for (const auto& e : extensions_) e->after_encode(m, frame, dest);
  if (frame.ipc) {
    // Held until the receiver's copies are done (it releases the token), or
    // its connection closes; a frame that is never sent is held until then.
    std::lock_guard<std::mutex> lock(ipc_mu_);
    ipc_held_[frame.ipc_token] = IpcHeld{dest, std::move(frame.ipc)};
  }
  return frame;
}

RawFuture AgentImpl::start_call(const std::string& to, const std::string& fn,
                                std::vector<c10::IValue> args, std::chrono::milliseconds timeout) {
  TANDEM_STAGE(kCallStart);
  RawFuture fut = make_raw_future();
  const WorkerInfo& dest = get_worker_info(to);
  if (timeout.count() < 0) timeout = options_.rpc_timeout;
  timeout = std::min(timeout, kMaxTimeout);
  CallTable::Call call;
  call.future = fut;
  call.peer = dest.rank;
  call.callee = fn;
  auto now = Clock::now();
  if (timeout.count() > 0) {
    call.has_deadline = true;
    call.deadline = now + timeout;
  }
  const CallScope& scope = current_scope();
  if (scope.agent == &self_ && scope.has_deadline &&
      (!call.has_deadline || scope.deadline < call.deadline)) {
    call.has_deadline = true;  // a call made by a handler inherits what its caller has left
    call.deadline = scope.deadline;
  }

  Message req;
  req.kind = MessageKind::kRequest;
  req.id = next_id_.fetch_add(1);
  req.callee = fn;
  req.values = std::move(args);
  if (call.has_deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(call.deadline - now).count();
    req.timeout_ms = static_cast<uint64_t>(std::max<int64_t>(left, 1));
  }
  req.autograd_context = autograd_context_for(self_);
  // Bad arguments (and a failed RRef passed on) throw here, in the caller.
  OutFrame frame = encode_with_extensions(req, dest.rank);
  Forks forks = std::move(frame.forks);  // undone unless the frame is written

  auto shut_down = [&] {
    return std::make_exception_ptr(
        ShutdownError("agent " + name() + " is shut down; cannot call '" + fn + "' on " + to));
  };
  if (!calls_->accepting()) {
    fut->setError(shut_down());
    return fut;
  }
  const bool has_deadline = call.has_deadline;
  const auto deadline = call.deadline;
  for (int attempt = 0;; ++attempt) {
    ConnectionPtr conn;
    try {
      auto connect_timeout =
          has_deadline
              ? std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now())
              : std::chrono::milliseconds(30000);
      conn = connection_to(dest.rank, std::max(connect_timeout, std::chrono::milliseconds(1)));
    } catch (...) {
      if (attempt == 0) {
        fut->setError(std::current_exception());
      } else {
        calls_->fail(req.id, std::current_exception(), 0);
      }
      return fut;
    }
    if (attempt == 0) {
      call.conn_id = conn->id();
      call.started = Clock::now();
      if (trace_) call.tid = Tracer::this_thread();
      metrics_->call_sent();
      if (!calls_->add(req.id, std::move(call))) {
        fut->setError(shut_down());
        return fut;
      }
    } else if (!calls_->move_to(req.id, conn->id())) {
      return fut;  // completed meanwhile (its deadline passed)
    }
    try {
      TANDEM_STAGE(kCallEncoded);
      conn->send(std::move(frame));
      remember_connection_for_polling(conn);
      forks.commit();
      calls_->mark_sent(req.id);
      // A close that ran before the mark did not fail the call (it was not
      // sent yet, as far as it knew): fail it here.
      if (conn->closed()) {
        calls_->fail(req.id,
                     std::make_exception_ptr(
                         DisconnectedError("connection to " + to + " lost during '" + fn + "'")),
                     0);
      }
    } catch (const RetiredError&) {
      // That connection was retired (a crossed dial, connection_table.h 4.)
      // after we took it: the frame is still ours, send it on the current one.
      if (attempt < 16) continue;
      calls_->fail(req.id,
                   std::make_exception_ptr(DisconnectedError("cannot send '" + fn + "' to " + to +
                                                             ": its connections keep retiring")),
                   0);
    } catch (const Error& e) {
      // The connection broke under us (a frame cut short is dropped by the
      // peer); on_closed may already have failed the call, in which case this
      // finds nothing to complete. The forks are undone as `forks` goes; the
      // table's to() skips the closed connection from now on.
      calls_->fail(req.id,
                   std::make_exception_ptr(
                       DisconnectedError("cannot send '" + fn + "' to " + to + ": " + e.what())),
                   0);
    }
    return fut;
  }
}

void AgentImpl::notify(const std::string& to, const std::string& fn,
                       std::vector<c10::IValue> args) {
  const WorkerInfo& dest = get_worker_info(to);
  Message req;
  req.kind = MessageKind::kRequest;
  req.id = 0;  // no reply: nobody waits for one
  req.callee = fn;
  req.values = std::move(args);
  req.autograd_context = autograd_context_for(self_);
  OutFrame frame = encode_with_extensions(req, dest.rank);
  Forks forks = std::move(frame.forks);
  if (!calls_->accepting())
    throw ShutdownError("agent " + name() + " is shut down; cannot notify " + to);
  for (int attempt = 0;; ++attempt) {
    try {
      auto timeout = options_.rpc_timeout.count() > 0 ? options_.rpc_timeout
                                                      : std::chrono::milliseconds(30000);
      connection_to(dest.rank, timeout)->send(std::move(frame));
      forks.commit();
      return;
    } catch (const RetiredError&) {
      if (attempt < 16) continue;  // retired after we took it: the current one
      throw DisconnectedError("cannot send '" + fn + "' to " + to +
                              ": its connections keep retiring");
    } catch (const Error& e) {
      throw DisconnectedError("cannot send '" + fn + "' to " + to + ": " + e.what());
    }
  }
}

}  // namespace tandem::rpc
