// The read side of a stream connection (stream_connection.h, 2.-4.): the
// one drain that the loop thread and polling threads call, delivery on
// either, and backpressure.
#include "tandem/rpc/transport/uv/stream_connection.h"

#include "tandem/rpc/transport/shm/local_connection.h"
#include "tandem/rpc/transport/uv/uv_transport.h"

#include <sys/socket.h>

#include <cassert>
#include <cerrno>
#include <cstring>

namespace tandem::rpc {
bool& StreamConnection::no_polling_here() {
  thread_local bool inside = false;
  return inside;
}

StreamConnection::PollingState& StreamConnection::polling_state() {
  thread_local PollingState state;
  return state;
}

bool StreamConnection::enter_polling_here() {
  PollingState& s = polling_state();
  if (s.depth == 0 || s.entered.get() == this) return false;
  if (s.entered) std::exchange(s.entered, nullptr)->leave_polling_spin();
  s.entered = shared_from_this();
  return true;
}

bool StreamConnection::poll_if_free() {
  std::unique_lock<std::mutex> lock(read_mu_, std::try_to_lock);
  if (!lock.owns_lock() || !inline_ok_.load(std::memory_order_acquire)) return false;
  return drain_locked(Reader::kPoller);
}

PollingSpin::PollingSpin() { ++StreamConnection::polling_state().depth; }

PollingSpin::~PollingSpin() {
  StreamConnection::PollingState& s = StreamConnection::polling_state();
  if (--s.depth == 0 && s.entered) std::exchange(s.entered, nullptr)->leave_polling_spin();
}

ConnectionSleep::ConnectionSleep() {
  StreamConnection::PollingState& s = StreamConnection::polling_state();
  if (s.depth > 0 && s.entered) sleeper_ = s.entered->sleeper_here();
}

ConnectionSleep::~ConnectionSleep() = default;

std::function<void()> ConnectionSleep::waker() const {
  if (!sleeper_) return [] {};
  return sleeper_->waker();
}

bool ConnectionSleep::wait(std::chrono::microseconds timeout, const std::function<bool()>& done) {
  return sleeper_ && sleeper_->wait(timeout, done);
}

void StreamConnection::read_from_loop() {
  assert(transport_->on_transport_thread());
  if (loop_closed_) return;  // a late post
  if (yield_read_from_loop()) return;
  {
    std::lock_guard<std::mutex> read_lock(read_mu_);
    drain_locked(Reader::kLoop);
  }
  // Our ring's writes that waited for space go on: the peer's 'W' came.
  if (kind_ == Kind::kLocal && local().writes_ring() && !loop_closed_) {
    flush_if_queued_from_loop();
  }
}

bool StreamConnection::drain_locked(Reader who) {
  // What a poll left comes first.
  if (who == Reader::kLoop) deliver_deferred_locked();
  const bool delivered =
      kind_ == Kind::kLocal ? local().read_local_locked(who) : read_socket_locked(who);
  if (who == Reader::kLoop) update_inline_locked();
  return delivered;
}

char* StreamConnection::staging(Reader who) {
  if (who == Reader::kLoop) return transport_->staging_from_loop();
  thread_local std::vector<char> staging(kStagingBytes);
  return staging.data();
}

bool StreamConnection::read_socket_locked(Reader who) {
  const bool loop = who == Reader::kLoop;
  char* const scratch = staging(who);
  bool delivered = false;
  const int rounds = loop ? kReadRoundsPerWakeup : kReadRoundsPerPoll;
  for (int round = 0; round < rounds; ++round) {
    if (loop && (loop_closed_ || reading_stopped_)) break;
    // A TCP poller reads small frames, a gulp at a time, and leaves what it
    // began and could not end to the loop (tcp_connection.h, 1.); it finds
    // the decoder between frames (inline_ok_ says so for TCP).
    const bool tcp_poller = !loop && kind_ == Kind::kTcp;
    auto [direct, want] = decoder_.direct_target(kDirectReadMin);
    if (tcp_poller) direct = nullptr;
    char* buf = direct ? direct : scratch;
    const size_t len = direct ? want : tcp_poller ? kPollerGulp : kStagingBytes;
    std::string error;
    ssize_t n;
    if (kind_ == Kind::kLocal) {
      n = local().recv_socket(buf, len, error);  // and the descriptors beside the bytes
    } else {
      n = ::recv(fd_, buf, len, MSG_DONTWAIT);
    }
    if (!error.empty()) {
      fail_read(who, "protocol error from " + peer_ + ": " + error);
      return delivered;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // A poller leaves the end (or an error) to the loop thread, which
      // reads it itself and closes.
      if (!loop || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))) return delivered;
      close_from_loop(end_of_reading(n < 0 ? errno : 0));
      return delivered;
    }
    if (!feed_decoder(direct != nullptr, buf, static_cast<size_t>(n), error)) {
      fail_read(who, "protocol error from " + peer_ + ": " + error);
      return delivered;
    }
    if (loop) {
      deliver_decoded_from_loop();
    } else {
      while (decoder_.has_message()) delivered |= deliver_inline_locked(take_message());
      if (!deferred_.empty()) {
        hand_to_loop("");
        return delivered;
      }
      if (tcp_poller && !decoder_.idle()) {
        // A frame larger than the gulp, or not all here: the loop's to end
        // (its watch is level), and pollers keep off until it has
        // (update_inline_locked).
        inline_ok_.store(false, std::memory_order_release);
        return delivered;
      }
    }
    if (static_cast<size_t>(n) < len) return delivered;  // the socket is drained
  }
  return delivered;
}

void StreamConnection::fail_read(Reader who, const std::string& reason) {
  if (who == Reader::kLoop) {
    close_from_loop(reason);
  } else {
    hand_to_loop(reason);
  }
}

bool StreamConnection::feed_decoder(bool direct, const char* buf, size_t n, std::string& error) {
  heard_ns_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  try {
    if (direct) {
      decoder_.direct_commit(n);
    } else {
      decoder_.feed(buf, n);
    }
    return true;
  } catch (const std::exception& e) {
    error = e.what();
    return false;
  }
}

Message StreamConnection::take_message() {
  Message m = decoder_.take();
  transport_->counters().bytes_received.fetch_add(m.wire_bytes, std::memory_order_relaxed);
  if (m.kind == MessageKind::kRequest && m.id != 0) {
    requests_in_.fetch_add(1, std::memory_order_release);  // an answer is owed
  }
  return m;
}

void StreamConnection::deliver_decoded_from_loop() {
  if (counted_handshaking_ && !decoder_.in_handshake()) {
    counted_handshaking_ = false;
    transport_->handshake_ended_from_loop();
  }
  while (decoder_.has_message() && !loop_closed_) deliver_from_loop(take_message());
}

std::string StreamConnection::end_of_reading(int err) const {
  if (err == 0) {
    return "peer " + peer_ +
           (decoder_.idle() ? " closed the connection" : " closed the connection mid-frame");
  }
  return err == ECONNRESET ? "connection reset by " + peer_
                           : "read from " + peer_ + " failed: " + std::strerror(err);
}

bool StreamConnection::deliver_inline_locked(Message&& m) {
  const Transport::Callbacks& callbacks = transport_->callbacks();
  const bool request = m.kind == MessageKind::kRequest && m.id != 0;
  if (!deferred_.empty() || would_pause() || !callbacks.inline_ok(m)) {
    deferred_.push_back(std::move(m));
    return false;
  }
  if (request) requests_delivered_.fetch_add(1, std::memory_order_release);
  {
    struct Inside {  // a callback that polls again reads nothing
      bool& flag = no_polling_here();
      Inside() { flag = true; }
      ~Inside() { flag = false; }
    } inside;
    callbacks.on_message(shared_from_this(), std::move(m));
  }
  transport_->counters().polled_messages.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void StreamConnection::hand_to_loop(const std::string& close_reason) {
  inline_ok_.store(false, std::memory_order_release);
  auto self = shared_from_this();
  transport_->post([self, close_reason] {
    if (!close_reason.empty()) {
      self->close_from_loop(close_reason);
    } else if (self->kind_ == Kind::kLocal && self->local().peer_writes_ring()) {
      self->read_from_loop();  // the deferred first, then what the ring still holds
    } else {
      std::lock_guard<std::mutex> lock(self->read_mu_);
      self->deliver_deferred_locked();
      self->update_inline_locked();
    }
  });
}

void StreamConnection::deliver_deferred_locked() {
  std::deque<Message> deferred = std::move(deferred_);
  deferred_.clear();
  for (auto& m : deferred) {
    if (loop_closed_) return;
    deliver_from_loop(std::move(m));
  }
}

void StreamConnection::update_inline_locked() {
  inline_ok_.store(transport_->limits().poll_while_spinning && polling_ && !loop_closed_ &&
                       !paused_ && !reading_stopped_ && deferred_.empty() &&
                       !decoder_.in_handshake() &&
                       // (a TCP frame the loop is reading is the loop's to end)
                       (kind_ != Kind::kTcp || decoder_.idle()) &&
                       static_cast<bool>(transport_->callbacks().inline_ok),
                   std::memory_order_release);
}

bool StreamConnection::would_pause() const {
  const Limits& limits = transport_->limits();
  return queued_reply_bytes_.load(std::memory_order_relaxed) > limits.max_queued_reply_bytes ||
         in_progress() >= limits.max_unanswered_requests;
}

void StreamConnection::deliver_from_loop(Message&& m) {
  if (!paused_ && would_pause()) {
    paused_ = true;
    paused_flag_.store(true, std::memory_order_release);
    ++transport_->counters().read_pauses;
  }
  if (!paused_) {
    if (m.kind == MessageKind::kRequest && m.id != 0) {
      requests_delivered_.fetch_add(1, std::memory_order_release);
    }
    transport_->callbacks().on_message(shared_from_this(), std::move(m));
    return;
  }
  held_bytes_ += m.wire_bytes;
  held_.push_back(std::move(m));
  if (held_bytes_ > transport_->limits().max_held_bytes && !reading_stopped_) {
    reading_stopped_ = true;
    std::lock_guard<std::mutex> lock(write_mu_);
    start_poll_locked();
  }
}

void StreamConnection::resume_from_loop() {
  assert(transport_->on_transport_thread());
  std::lock_guard<std::mutex> read_lock(read_mu_);
  resume_locked();
  update_inline_locked();
}

void StreamConnection::resume_locked() {
  const Limits& limits = transport_->limits();
  if (!paused_ || loop_closed_ ||
      queued_reply_bytes_.load(std::memory_order_relaxed) > limits.max_queued_reply_bytes / 2 ||
      in_progress() > limits.max_unanswered_requests / 2) {
    return;
  }
  std::deque<Message> held = std::move(held_);
  held_.clear();
  held_bytes_ = 0;
  paused_ = false;
  paused_flag_.store(false, std::memory_order_release);
  const bool was_stopped = reading_stopped_;
  reading_stopped_ = false;
  // In order; a delivery that pauses again holds the rest again, in order.
  for (auto& m : held) {
    if (loop_closed_) return;
    deliver_from_loop(std::move(m));
  }
  if (was_stopped && !reading_stopped_ && !loop_closed_) {
    std::lock_guard<std::mutex> lock(write_mu_);
    start_poll_locked();
  }
  // A ring left unread while stopped wakes nobody: read it again now.
  if (was_stopped && kind_ == Kind::kLocal && local().peer_writes_ring() && !loop_closed_) {
    auto self = shared_from_this();
    transport_->post([self] { self->read_from_loop(); });
  }
}

}  // namespace tandem::rpc
