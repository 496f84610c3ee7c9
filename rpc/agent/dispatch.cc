// The agent's incoming side: what the transport delivers, on its loop
// thread, goes to the call table (replies), to the loop's own internal
// handlers, or to the pool, where a handler runs in its request's scope
// (rpc/scope.h) and its result goes back as a response or a typed error.
#include "tandem/rpc/agent/agent_impl.h"
#include "tandem/rpc/agent/call_table.h"
#include "tandem/rpc/agent/connection_table.h"
#include "tandem/rpc/rref_context.h"
#include "tandem/rpc/stages.h"
#include "tandem/rpc/wire/device.h"

#include <cassert>

namespace tandem::rpc {
namespace {
using Clock = std::chrono::steady_clock;
constexpr uint64_t kNoReply = 0;  // the call id of a notify(): no reply goes back
}  // namespace

Agent* handler_agent() { return current_scope().agent; }

std::string handler_caller() {
  const CallScope& s = current_scope();
  if (!s.agent || s.caller < 0) return {};
  return s.agent->get_worker_info(s.caller).name;
}

uint64_t handler_autograd_context(const Agent& agent) { return autograd_context_for(agent); }

bool AgentImpl::inline_ok(const Message& m) const {
  // rpc/transport.h, 8.: what needs no loop-thread state may be delivered on
  // a polling thread: answers, requests for the pool, and the layers' loop
  // handlers (bounded work that only needs to run where messages are
  // delivered, in order). Handshakes, retirement and RRefs (adopted in
  // frame order) stay on the loop thread.
  if (!ready_.load(std::memory_order_acquire) || !m.rrefs.empty() ||
      retiring_count_.load(std::memory_order_acquire) > 0) {
    return false;
  }
  switch (m.kind) {
    case MessageKind::kResponse:
    case MessageKind::kError:
      return true;
    case MessageKind::kRequest:
      return m.callee != kRetireCallee;
    case MessageKind::kHello:
      return false;
  }
  return false;
}

bool& AgentImpl::delivering_here() {
  thread_local bool delivering = false;
  return delivering;
}

// On the loop thread, or on a thread polling its connection for a message
// inline_ok() accepted (one connection's messages come one at a time, in order).
void AgentImpl::on_message_from_loop(const ConnectionPtr& conn, Message&& msg) {
  TANDEM_STAGE(kDelivered);
  // Loop handlers ask where they run (layer::on_loop_thread): here.
  struct Delivering {
    bool& flag = delivering_here();
    const bool was = flag;
    Delivering() { flag = true; }
    ~Delivering() { flag = was; }
  } delivering;
  if (!ready_.load(std::memory_order_acquire)) {
    // A peer that finished rendezvous first may greet us before we know the
    // world; hold this (loop) thread until start() is done, one way or the other.
    std::unique_lock<std::mutex> lock(ready_mu_);
    ready_cv_.wait(lock, [this] { return ready_.load(); });
    if (workers_.empty() || !conns_) {
      conn->close("agent failed to start");
      return;
    }
  }
  if (msg.kind == MessageKind::kHello) {
    on_hello_from_loop(conn, msg);
    return;
  }
  const int from = conns_->rank_of(*conn);
  if (from < 0) {
    conn->close("protocol error from " + conn->peer_address() +
                ": the first frame must be a handshake");
    return;
  }
  if (!msg.rrefs.empty()) {
    try {
      for (const auto& d : msg.rrefs) rrefs_->validate(d, from);  // all, before any is adopted
      std::vector<RRefPtr> handles;
      handles.reserve(msg.rrefs.size());
      for (const auto& d : msg.rrefs) handles.push_back(rrefs_->adopt_received(d));
      fill_rrefs(msg.values, handles);
    } catch (const std::exception& e) {
      conn->close("protocol error from " + conn->peer_address() + ": " + e.what());
      return;
    }
  }
  if (msg.ipc_release != 0) {  // copied (or failed): done with the sender's memory
    send_ipc_release(conn, from, msg.ipc_release, !msg.arrival_error.empty());
  }
  if (!msg.arrival_error.empty()) {
    // Its tensors could not be placed on their devices here: it fails
    // alone (its RRefs, adopted above, go with it).
    const std::string why =
        "could not place its tensors on their devices on " + name() + ": " + msg.arrival_error;
    if (msg.kind == MessageKind::kRequest) {
      metrics_->request_served(/*failed=*/true);
      send_error(conn, msg.id, ErrorCode::kRemote, "the request " + why);
    } else if (msg.kind == MessageKind::kResponse) {
      calls_->fail(msg.id, make_error(ErrorCode::kRemote, name(), "the answer " + why), conn->id());
      maybe_close_retired(conn->id());
    }
    return;
  }
  switch (msg.kind) {
    case MessageKind::kRequest: {
      if (msg.callee.rfind("tandem.", 0) == 0) {
        if (msg.callee == kRetireCallee && msg.id == kNoReply) {
          on_retire_from_loop(conn);
          return;
        }
        if (msg.callee == kIpcReleaseCallee && msg.id == kNoReply && msg.values.size() == 2 &&
            msg.values[0].isInt() && msg.values[1].isBool()) {
          release_ipc(from, static_cast<uint64_t>(msg.values[0].toInt()), msg.values[1].toBool());
          return;
        }
        if (auto on_loop = loop_internal_->find(msg.callee)) {
          handle_request(conn, from, std::move(msg), on_loop);  // bounded internal work: here
          return;
        }
      }
      auto shared = std::make_shared<Message>(std::move(msg));
      pool_->post([this, conn, from, shared] { handle_request(conn, from, std::move(*shared)); });
      return;
    }
    case MessageKind::kResponse: {
      if (!extensions_.empty()) {
        try {
          for (const auto& e : extensions_) e->after_receive(msg, from);
        } catch (...) {
          calls_->fail(msg.id, std::current_exception(), conn->id());
          maybe_close_retired(conn->id());
          return;
        }
      }
      // Its CUDA tensors are ready when the future completes: wait for
      // their copies (those events only; the copies were queued when the
      // frame ended, so this is their remaining time).
      if (msg.arrival) msg.arrival->wait();
      c10::IValue value = msg.values.empty() ? c10::IValue() : std::move(msg.values[0]);
      calls_->complete(msg.id, std::move(value), conn->id());
      TANDEM_STAGE(kCallDone);
      maybe_close_retired(conn->id());
      return;
    }
    case MessageKind::kError:
      calls_->fail(msg.id, make_error(msg.error_code, msg.error_worker, msg.error_message),
                   conn->id());
      maybe_close_retired(conn->id());
      return;
    case MessageKind::kHello:
      return;
  }
}

std::shared_ptr<const Handler> AgentImpl::find_handler(const std::string& fn) const {
  const bool internal = fn.rfind("tandem.", 0) == 0;
  return (internal ? internal_ : registry_)->find(fn);
}

void AgentImpl::handle_request(const ConnectionPtr& conn, int from, Message msg,
                               std::shared_ptr<const Handler> handler) {
  TANDEM_STAGE(kRequestTaken);
  remember_connection_for_polling(conn);  // the pool thread polls it while idle
  if (!handler) handler = find_handler(msg.callee);
  if (!handler) {
    metrics_->request_served(/*failed=*/true);
    send_error(conn, msg.id, ErrorCode::kUnknownFunction,
               "no function '" + msg.callee + "' is registered");
    return;
  }
  CallScope scope;
  scope.agent = &self_;
  scope.context_agent = &self_;
  scope.autograd_context = msg.autograd_context;
  scope.caller = from;
  if (msg.timeout_ms > 0) {
    scope.has_deadline = true;
    scope.deadline =
        Clock::now() +
        std::min(std::chrono::milliseconds(std::min<uint64_t>(msg.timeout_ms, kMaxTimeout.count())),
                 kMaxTimeout);
  }
  ScopeGuard guard(scope);
  // Its CUDA arguments are on their way: the default stream, where it runs,
  // waits for their copies (rpc/wire/device.h), so there is nothing to wait for.
  RawFuture result;
  const uint64_t autograd_context = msg.autograd_context;
  const auto started = trace_ ? Clock::now() : Clock::time_point{};
  try {
    for (const auto& e : extensions_) e->after_receive(msg, from);
    TANDEM_STAGE(kHandlerIn);
    HandlerResult r = (*handler)(msg.values);
    TANDEM_STAGE(kHandlerOut);
    if (r.future) {
      // Asynchronous: this pool thread is free now; reply when it completes.
      uint64_t id = msg.id;
      std::weak_ptr<Agent> weak = self_.weak_from_this();
      std::string callee = trace_ ? msg.callee : std::string();
      r.future->addCallback(
          [this, weak, conn, from, id, autograd_context, callee, started](c10::ivalue::Future& f) {
            // The future may complete after this agent is gone: then nobody is
            // left to answer, and the caller has failed the call already.
            if (auto alive = weak.lock()) {
              reply(conn, from, id, c10::intrusive_ptr<c10::ivalue::Future>::reclaim_copy(&f),
                    autograd_context, callee, started);
            }
          });
      return;
    }
    result = make_raw_future();
    result->markCompleted(std::move(r.value));
  } catch (...) {
    result = make_raw_future();
    result->setError(std::current_exception());
  }
  reply(conn, from, msg.id, result, autograd_context, trace_ ? msg.callee : std::string(), started);
}

void AgentImpl::reply(const ConnectionPtr& conn, int to, uint64_t id, const RawFuture& result,
                      uint64_t autograd_context, const std::string& callee,
                      Clock::time_point started) {
  metrics_->request_served(result->hasError());
  if (trace_ && started != Clock::time_point{}) {
    const uint64_t flow = id == kNoReply ? 0 : (static_cast<uint64_t>(to) << 48) | id;
    trace_->slice(callee, "rpc.serve", started, Clock::now(),
                  {0, flow, flow ? flow | Tracer::kReplyFlow : 0, 0},
                  std::string("{\"from\":") + std::to_string(to) + "}");
  }
  if (id == kNoReply) return;  // notify(): nobody waits for it
  if (result->hasError()) {
    // The error keeps its kind: a handler whose own call timed out fails
    // its caller with TimeoutError (naming this worker), so a layer can
    // rethrow what happened. Anything but a Tandem error is a RemoteError.
    auto [code, text] = describe_error(result->exception_ptr());
    send_error(conn, id, code, text);
    return;
  }
  Message m;
  m.kind = MessageKind::kResponse;
  m.id = id;
  m.values.push_back(result->constValue());
  m.autograd_context = autograd_context;
  OutFrame frame;
  try {
    frame = encode_with_extensions(m, to, conn.get());
  } catch (const std::exception& e) {
    send_error(conn, id, ErrorCode::kRemote, std::string("cannot send the result: ") + e.what());
    return;
  }
  Forks forks = std::move(frame.forks);
  TANDEM_STAGE(kReplyEncoded);
  try {
    conn->send(std::move(frame));
    forks.commit();
  } catch (const Error&) {
    // The caller is gone; it has already failed the call with Disconnected.
  }
  maybe_close_retired(conn->id());
}

void AgentImpl::send_error(const ConnectionPtr& conn, uint64_t id, ErrorCode code,
                           const std::string& message) {
  if (id == kNoReply) return;
  Message m;
  m.kind = MessageKind::kError;
  m.id = id;
  m.error_code = code;
  m.error_worker = name();
  m.error_message = message;
  try {
    conn->send(encode(m, options_.limits));
  } catch (const Error&) {
  }
  maybe_close_retired(conn->id());
}

}  // namespace tandem::rpc
