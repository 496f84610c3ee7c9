// The write side of a stream connection and its life on the loop; the
// read side is in stream_drain.cc (stream_connection.h).
#include "tandem/rpc/transport/uv/stream_connection.h"

#include "tandem/rpc/transport/shm/local_connection.h"
#include "tandem/rpc/transport/shm/segments.h"
#include "tandem/rpc/transport/uv/uv_transport.h"

#include <limits.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <optional>

namespace tandem::rpc {
namespace {

const char kZeros[kTensorAlignment] = {};

std::string errno_text(int err) { return std::strerror(err); }

}  // namespace

PendingWrite::PendingWrite(OutFrame&& f, SegmentWriter* shared, const Limits& limits)
    : frame(std::move(f)) {
  if (shared) place_shared(*shared, limits);
  const bool reply = frame.kind == MessageKind::kResponse || frame.kind == MessageKind::kError;
  reply_bytes = reply ? frame.total_bytes() + frame.preamble.table_bytes : 0;
  iov.reserve(3 + 2 * frame.tensors.size());
  iov.push_back({&frame.preamble, kPreambleBytes});
  if (!table.empty()) iov.push_back({table.data(), table.size() * sizeof(SharedRef)});
  if (frame.envelope.byte_size() > 0) {  // (a heartbeat has none)
    iov.push_back({const_cast<char*>(frame.envelope.bytes()), frame.envelope.byte_size()});
  }
  uint64_t offset = 0;
  for (const auto& t : frame.tensors) {
    uint64_t pad = padding_before(offset);
    if (pad) iov.push_back({const_cast<char*>(kZeros), pad});
    uint64_t n = t.nbytes();
    if (n) iov.push_back({t.data_ptr(), n});
    offset += pad + n;
  }
}

void PendingWrite::place_shared(SegmentWriter& shared, const Limits& limits) {
  std::vector<at::Tensor> body;
  for (size_t i = 0; i < frame.tensors.size(); ++i) {
    const at::Tensor& t = frame.tensors[i];
    std::optional<SharedRef> ref;
    if (t.nbytes() > 0 && t.nbytes() >= limits.min_shared_tensor_bytes &&
        table.size() < kMaxSharedRefs && fds.size() < kMaxFdsPerRead) {
      ref = shared.place(t, static_cast<uint32_t>(i), fds);
    }
    if (ref) {
      table.push_back(*ref);
      shared_bytes += t.nbytes();
    } else {
      if (t.nbytes() >= limits.min_shared_tensor_bytes) ++shared_fallbacks;
      body.push_back(t);
    }
  }
  if (table.empty()) return;
  uint64_t offset = 0;
  for (const auto& t : body) offset += padding_before(offset) + t.nbytes();
  frame.tensors = std::move(body);
  frame.preamble.body_bytes = offset;
  frame.preamble.flags |= kFlagSharedTensors;
  frame.preamble.table_bytes = static_cast<uint32_t>(table.size() * sizeof(SharedRef));
}

StreamConnection::StreamConnection(UvTransport* transport, Kind kind, int fd, uint64_t id,
                                   std::string peer, bool accepted)
    : transport_(transport),
      kind_(kind),
      fd_(fd),
      id_(id),
      peer_(std::move(peer)),
      accepted_(accepted),
      opened_at_(Clock::now()),
      decoder_(transport->limits(), /*handshake_frames=*/accepted ? 2 : 1) {
  poll_.data = nullptr;
  const int64_t now = opened_at_.time_since_epoch().count();
  heard_ns_.store(now, std::memory_order_relaxed);
  wrote_ns_.store(now, std::memory_order_relaxed);
  moved_ns_.store(now, std::memory_order_relaxed);
}

LocalConnection& StreamConnection::local() { return static_cast<LocalConnection&>(*this); }

void StreamConnection::send(OutFrame&& frame) {
  std::lock_guard<std::mutex> lock(write_mu_);
  send_locked(std::move(frame));
}

void StreamConnection::retire(OutFrame&& last) {
  std::lock_guard<std::mutex> lock(write_mu_);
  send_locked(std::move(last));
  retired_ = true;
}

uint64_t StreamConnection::in_progress() const {
  const uint64_t in = requests_delivered_.load(std::memory_order_acquire);
  const uint64_t out = answers_out_.load(std::memory_order_acquire);
  return in > out ? in - out : 0;
}

int64_t StreamConnection::answers_owed() const {
  return static_cast<int64_t>(requests_in_.load(std::memory_order_acquire)) -
         static_cast<int64_t>(answers_out_.load(std::memory_order_acquire));
}

void StreamConnection::close_when_flushed() {
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (closed_) return;
    if (!queue_.empty()) {
      close_when_flushed_ = true;  // flush_from_loop closes once the queue drains
      return;
    }
  }
  close("");
}

void StreamConnection::send_locked(OutFrame&& frame) {
  // Retired first: one retired and then closed by the peer still sends
  // a late request to the current connection.
  if (retired_ && frame.kind == MessageKind::kRequest) {
    throw RetiredError("connection to " + peer_ + " is retired");  // frame not taken
  }
  if (closed_) throw DisconnectedError("connection to " + peer_ + " is closed");
  const bool answer = frame.kind == MessageKind::kResponse || frame.kind == MessageKind::kError;
  // Placed under the lock: segments are announced in the order frames
  // are written, which is the order the peer numbers them in.
  SegmentWriter* segments = kind_ == Kind::kLocal ? local().segments_out() : nullptr;
  auto w = std::make_unique<PendingWrite>(std::move(frame), segments, transport_->limits());
  if (segments) local().count_shared(*w);
  transport_->counters().bytes_sent.fetch_add(
      w->frame.total_bytes() + w->frame.preamble.table_bytes, std::memory_order_relaxed);
  wrote_ns_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  if (answer) {
    answers_out_.fetch_add(1, std::memory_order_release);
    // Held for too many unanswered requests (uv_transport.h, 5.): resume
    // once half of them are answered.
    if (paused_flag_.load(std::memory_order_acquire) &&
        in_progress() <= transport_->limits().max_unanswered_requests / 2) {
      auto self = shared_from_this();
      transport_->post([self] { self->resume_from_loop(); });
    }
  }
  if (queue_.empty()) {
    if (write_locked(*w)) return;
  }
  queued_reply_bytes_.fetch_add(w->reply_bytes, std::memory_order_relaxed);
  queue_.push_back(std::move(w));
  if (!want_writable_) {
    want_writable_ = true;
    auto self = shared_from_this();
    transport_->post([self] { self->update_poll_from_loop(); });
  }
}

void StreamConnection::close(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (closed_) return;
    closed_ = true;
    clear_queue_locked();
  }
  auto self = shared_from_this();
  transport_->post([self, reason] { self->close_from_loop(reason); });
}

bool StreamConnection::closed() {
  std::lock_guard<std::mutex> lock(write_mu_);
  return closed_;
}

bool StreamConnection::write_locked(PendingWrite& w) {
  if (kind_ == Kind::kLocal) return local().write_local_locked(w);
  return write_socket_locked(w);
}

bool StreamConnection::write_socket_locked(PendingWrite& w) {
  while (w.next < w.iov.size()) {
    msghdr msg{};
    msg.msg_iov = &w.iov[w.next];
    msg.msg_iovlen = std::min<size_t>(w.iov.size() - w.next, IOV_MAX);
    // New segments' descriptors ride on the frame's first bytes.
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRead)];
    if (!w.fds.empty() && !w.fds_sent) attach_fds(msg, control, w.fds.data(), w.fds.size());
    ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      w.fds_sent = true;
      note_written();
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      fail_write_locked("write to " + peer_ + " failed: " + errno_text(errno));
    }
    size_t left = static_cast<size_t>(n);
    while (left > 0 && left >= w.iov[w.next].iov_len) {
      left -= w.iov[w.next].iov_len;
      ++w.next;
    }
    if (left > 0) {
      w.iov[w.next].iov_base = static_cast<char*>(w.iov[w.next].iov_base) + left;
      w.iov[w.next].iov_len -= left;
    }
  }
  return true;
}

void StreamConnection::fail_write_locked(const std::string& reason) {
  closed_ = true;
  clear_queue_locked();
  auto self = shared_from_this();
  transport_->post([self, reason] { self->close_from_loop(reason); });
  throw DisconnectedError(reason);
}

void StreamConnection::clear_queue_locked() {
  queue_.clear();
  queued_reply_bytes_.store(0, std::memory_order_relaxed);
}

void StreamConnection::flush_from_loop() {
  std::lock_guard<std::mutex> lock(write_mu_);
  flush_locked();
}

void StreamConnection::flush_if_queued_from_loop() {
  std::lock_guard<std::mutex> lock(write_mu_);
  if (!queue_.empty()) flush_locked();
}

void StreamConnection::flush_locked() {
  try {
    while (!queue_.empty()) {
      if (!write_locked(*queue_.front())) {
        // A ring's writes wait for the peer's wake-up, which comes as
        // readable; writable is wanted only for the socket.
        if (kind_ == Kind::kLocal && local().writes_ring()) start_poll_locked();
        return;
      }
      queued_reply_bytes_.fetch_sub(queue_.front()->reply_bytes, std::memory_order_relaxed);
      queue_.pop_front();
    }
  } catch (const DisconnectedError&) {
    return;  // the close is already posted
  }
  want_writable_ = false;
  start_poll_locked();
  if (close_when_flushed_ && !closed_) {
    closed_ = true;
    auto self = shared_from_this();
    transport_->post([self] { self->close_from_loop(""); });
  }
}

void StreamConnection::update_poll_from_loop() {
  std::lock_guard<std::mutex> lock(write_mu_);
  start_poll_locked();
}

void StreamConnection::start_poll_locked() {
  if (!polling_ || loop_closed_) return;  // never re-arm a handle that is closing
  bool readable = !reading_stopped_;
  bool writable = want_writable_;
  if (kind_ == Kind::kLocal) local().adjust_events(readable, writable);
  int events = (readable ? UV_READABLE : 0) | (writable ? UV_WRITABLE : 0);
  uv_poll_start(&poll_, events, &StreamConnection::on_poll);
}

void StreamConnection::on_poll(uv_poll_t* handle, int status, int events) {
  auto* raw = static_cast<StreamConnection*>(handle->data);
  auto self = raw->shared_from_this();
  if (status < 0) {
    // libuv reports a socket error (POLLERR) as UV_EBADF; the socket
    // itself knows what happened (a reset, a timeout, a refused dial).
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(raw->fd_, SOL_SOCKET, SO_ERROR, &err, &len);
    std::string what = err == ECONNRESET  ? "connection reset by " + raw->peer_
                       : err == EPIPE     ? "connection closed by " + raw->peer_
                       : err == ETIMEDOUT ? "connection to " + raw->peer_ + " timed out"
                       : err != 0
                           ? "connection to " + raw->peer_ + " failed: " + errno_text(err)
                           : "connection to " + raw->peer_ + " failed: " + uv_strerror(status);
    self->close_from_loop(what);
    return;
  }
  if (events & UV_WRITABLE) {
    self->flush_from_loop();
    if (self->paused_) self->resume_from_loop();
  }
  if ((events & UV_READABLE) && !self->loop_closed_) self->read_from_loop();
}

void StreamConnection::adopt_from_loop(uv_loop_t* loop, bool counted_handshaking) {
  counted_handshaking_ = counted_handshaking;
  poll_.data = this;
  uv_poll_init_socket(loop, &poll_, fd_);
  polling_ = true;
  std::lock_guard<std::mutex> lock(write_mu_);
  if (closed_) {
    // close() or a failed write ran before the loop saw this connection;
    // its close command is queued behind us and finishes the job.
    return;
  }
  start_poll_locked();
}

void StreamConnection::drop_unadopted() {
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    closed_ = true;
  }
  ::close(fd_);
}

bool StreamConnection::handshake_overdue(Clock::time_point now,
                                         std::chrono::milliseconds timeout) const {
  return decoder_.in_handshake() && now - opened_at_ > timeout;
}

void StreamConnection::keep_alive_from_loop(Clock::time_point now,
                                            std::chrono::milliseconds timeout, bool held_up) {
  assert(transport_->on_transport_thread());
  if (loop_closed_) return;
  const auto since = [&](const std::atomic<int64_t>& ns) {
    return now - Clock::time_point(Clock::duration(ns.load(std::memory_order_relaxed)));
  };
  // (0: this one never judges, but its peers may: a beat a second)
  const auto interval = timeout.count() > 0
                            ? std::min<Clock::duration>(timeout / 10, std::chrono::seconds(1))
                            : Clock::duration(std::chrono::seconds(1));
  bool stuck_writes = false;  // frames wait, and the peer has taken none for the timeout
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (closed_) return;
    if (!queue_.empty()) {
      stuck_writes = since(moved_ns_) > timeout;
    } else if (since(wrote_ns_) >= interval) {
      // A frame of its preamble alone, which the peer's decoder drops
      // (none behind a queue: what is queued will say the same).
      OutFrame beat;
      beat.kind = MessageKind::kHello;  // neither a request nor an answer
      beat.preamble.flags = kFlagHeartbeat;
      try {
        send_locked(std::move(beat));
        transport_->counters().heartbeats.fetch_add(1, std::memory_order_relaxed);
      } catch (const std::exception&) {
        // closed or closing: the close reports itself
      }
    }
  }
  if (timeout.count() <= 0) return;  // never judged
  if (held_up) {  // this process was held up: nothing to judge by
    heard_ns_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    moved_ns_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    return;
  }
  if (reading_stopped_) {
    // Not read for backpressure (uv_transport.h, 5.): its silence means
    // nothing, but a peer that also takes none of our bytes is stalled.
    heard_ns_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    if (stuck_writes) {
      close_stalled_from_loop("for " + std::to_string(timeout.count()) + " ms " + peer_ +
                              " read none of what waits for it, nor sent anything we read: "
                              "its process is stopped or stalled (AgentOptions::peer_timeout)");
    }
    return;
  }
  if (since(heard_ns_) <= timeout) return;
  read_from_loop();  // what is waiting counts
  if (loop_closed_ || Clock::now() - Clock::time_point(Clock::duration(heard_ns_.load(
                                           std::memory_order_relaxed))) <= timeout) {
    return;
  }
  close_stalled_from_loop("nothing came from " + peer_ + " for " +
                          std::to_string(timeout.count()) +
                          " ms, not even a heartbeat: its process is stopped or stalled "
                          "(AgentOptions::peer_timeout)");
}

void StreamConnection::close_stalled_from_loop(const std::string& reason) {
  assert(transport_->on_transport_thread());
  if (loop_closed_) return;
  stalled_.store(true, std::memory_order_release);
  transport_->counters().stalled_peers.fetch_add(1, std::memory_order_relaxed);
  close_from_loop(reason);
}

void StreamConnection::close_from_loop(const std::string& reason) {
  assert(transport_->on_transport_thread());
  if (loop_closed_) return;
  loop_closed_ = true;
  inline_ok_.store(false, std::memory_order_release);
  wake_sleepers();  // (a sleep that looks now finds it closed)
  if (counted_handshaking_) {
    counted_handshaking_ = false;
    transport_->handshake_ended_from_loop();
  }
  held_.clear();
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    closed_ = true;
    clear_queue_locked();
  }
  if (!polling_) return;  // never adopted; nothing registered
  struct Closing {
    std::shared_ptr<StreamConnection> conn;
    std::string reason;
  };
  poll_.data = new Closing{shared_from_this(), reason};  // owned by the close callback below
  uv_poll_stop(&poll_);
  uv_close(reinterpret_cast<uv_handle_t*>(&poll_), [](uv_handle_t* h) {
    std::unique_ptr<Closing> c(static_cast<Closing*>(h->data));
    {
      std::lock_guard<std::mutex> lock(c->conn->read_mu_);  // no poller is in a read
      ::close(c->conn->fd_);
    }
    c->conn->transport_->forget_from_loop(c->conn, c->reason);
  });
}

}  // namespace tandem::rpc
