#include "tandem/rpc/transport/faulty/faulty_transport.h"

#include <capnp/serialize.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <unordered_map>

#include "rpc/wire/wire.capnp.h"

namespace tandem::rpc {

void FaultPlan::add(Fault fault) {
  if (fault.kind == MessageKind::kHello) {
    throw std::invalid_argument("FaultPlan: handshakes cannot be faulted");
  }
  if (fault.skip < 0 || fault.count < -1) {
    throw std::invalid_argument("FaultPlan: skip must be >= 0 and count >= -1");
  }
  std::lock_guard<std::mutex> lock(mu_);
  faults_.push_back({std::move(fault)});
}

int FaultPlan::hits(size_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  return faults_.at(index).hit;
}

std::optional<Fault> FaultPlan::take(MessageKind kind, const std::string& callee) {
  if (kind == MessageKind::kHello) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& e : faults_) {
    if (e.fault.kind && *e.fault.kind != kind) continue;
    if (!e.fault.callee.empty() && e.fault.callee != callee) continue;
    const int n = e.seen++;
    if (n < e.fault.skip) continue;
    if (e.fault.count >= 0 && n >= e.fault.skip + e.fault.count) continue;
    ++e.hit;
    return e.fault;
  }
  return std::nullopt;
}

namespace {

using Clock = std::chrono::steady_clock;

OutFrame copy_frame(const OutFrame& f) {
  OutFrame c;
  c.kind = f.kind;
  c.preamble = f.preamble;
  c.envelope = Envelope(f.envelope.size());
  std::memcpy(c.envelope.words(), f.envelope.words(), f.envelope.byte_size());
  c.tensors = f.tensors;
  return c;
}

class FaultyTransport;

class FaultyConnection final : public Connection,
                               public std::enable_shared_from_this<FaultyConnection> {
 public:
  FaultyConnection(ConnectionPtr inner, std::shared_ptr<FaultPlan> plan, FaultyTransport* owner)
      : inner_(std::move(inner)), plan_(std::move(plan)), owner_(owner) {}

  void send(OutFrame&& frame) override;
  void close(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      backlog_.clear();
      held_.reset();
    }
    inner_->close(reason);
  }
  uint64_t id() const override { return inner_->id(); }
  const char* kind() const override { return inner_->kind(); }
  void retire(OutFrame&& last) override {
    std::lock_guard<std::mutex> lock(mu_);
    inner_->retire(std::move(last));
  }
  int64_t answers_owed() const override { return inner_->answers_owed(); }
  void close_when_flushed() override { inner_->close_when_flushed(); }
  std::string peer_address() const override { return inner_->peer_address(); }
  bool closed() override { return inner_->closed(); }
  bool stalled() const override { return inner_->stalled(); }

  // Writes the delayed frames that are due (from the delay thread).
  void flush_due(Clock::time_point now) {
    std::lock_guard<std::mutex> lock(mu_);
    while (!backlog_.empty() && backlog_.front().first <= now) {
      OutFrame f = std::move(backlog_.front().second);
      backlog_.pop_front();
      try {
        write_locked(std::move(f));
      } catch (const Error&) {
        backlog_.clear();  // closed meanwhile: the rest is lost with it
      }
    }
  }

 private:
  // Writes `frame`, then a frame held back for reordering (mu_ held).
  void write_locked(OutFrame&& frame) {
    inner_->send(std::move(frame));
    if (held_) {
      OutFrame h = std::move(*held_);
      held_.reset();
      inner_->send(std::move(h));
    }
  }

  const ConnectionPtr inner_;
  const std::shared_ptr<FaultPlan> plan_;
  FaultyTransport* const owner_;
  std::mutex mu_;  // orders the writes of this connection
  std::deque<std::pair<Clock::time_point, OutFrame>> backlog_;  // delayed, in order
  std::optional<OutFrame> held_;                                // reordered
};

class FaultyTransport final : public Transport {
 public:
  FaultyTransport(const Limits& limits, Callbacks callbacks, std::shared_ptr<FaultPlan> plan,
                  const TransportFactory& inner)
      : plan_(std::move(plan)), callbacks_(std::move(callbacks)) {
    Callbacks mine;
    mine.on_message = [this](const ConnectionPtr& c, Message&& m) {
      if (callbacks_.on_message) callbacks_.on_message(wrap(c), std::move(m));
    };
    mine.on_closed = [this](const ConnectionPtr& c, const std::string& reason) {
      ConnectionPtr w = wrap(c);
      {
        std::lock_guard<std::mutex> lock(mu_);
        wrapped_.erase(c.get());
      }
      if (callbacks_.on_closed) callbacks_.on_closed(w, reason);
    };
    inner_ = inner(limits, std::move(mine));
    delayer_ = std::thread([this] { delay_loop(); });
  }
  ~FaultyTransport() override { close(); }

  int listen(const std::string& host, int port) override { return inner_->listen(host, port); }
  TransportStats stats() const override { return inner_->stats(); }
  ConnectionPtr connect(const std::string& host, int port,
                        std::chrono::milliseconds timeout) override {
    return wrap(inner_->connect(host, port, timeout));
  }
  std::string local_endpoint() const override { return inner_->local_endpoint(); }
  ConnectionPtr connect_local(const std::string& endpoint,
                              std::chrono::milliseconds timeout) override {
    auto c = inner_->connect_local(endpoint, timeout);
    return c ? wrap(c) : nullptr;
  }
  void close() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      cv_.notify_all();
    }
    if (delayer_.joinable()) delayer_.join();
    inner_->close();
    std::lock_guard<std::mutex> lock(mu_);
    wrapped_.clear();
    due_.clear();
  }
  size_t live_connections() const override { return inner_->live_connections(); }
  bool on_transport_thread() const override { return inner_->on_transport_thread(); }

  // Asks the delay thread to flush `conn` at `at`.
  void flush_at(Clock::time_point at, std::weak_ptr<FaultyConnection> conn) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    due_.emplace(at, std::move(conn));
    cv_.notify_all();
  }

 private:
  ConnectionPtr wrap(const ConnectionPtr& inner) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& w = wrapped_[inner.get()];
    if (!w) w = std::make_shared<FaultyConnection>(inner, plan_, this);
    return w;
  }

  void delay_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      if (due_.empty()) {
        cv_.wait(lock);
        continue;
      }
      auto at = due_.begin()->first;
      if (Clock::now() < at) {
        cv_.wait_until(lock, at);
        continue;
      }
      auto conn = due_.begin()->second.lock();
      due_.erase(due_.begin());
      lock.unlock();
      if (conn) conn->flush_due(Clock::now());
      lock.lock();
    }
  }

  const std::shared_ptr<FaultPlan> plan_;
  const Callbacks callbacks_;
  std::unique_ptr<Transport> inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<const Connection*, std::shared_ptr<FaultyConnection>> wrapped_;
  std::multimap<Clock::time_point, std::weak_ptr<FaultyConnection>> due_;
  bool stopping_ = false;
  std::thread delayer_;
};

void FaultyConnection::send(OutFrame&& frame) {
  MessageKind kind;
  std::string callee;
  {
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(
        reinterpret_cast<const capnp::word*>(frame.envelope.words()), frame.envelope.size()));
    auto env = reader.getRoot<schema::Envelope>();
    kind = static_cast<MessageKind>(env.getKind());
    callee = env.getCallee().cStr();
  }
  std::optional<Fault> fault = plan_->take(kind, callee);
  std::lock_guard<std::mutex> lock(mu_);
  if (inner_->closed()) throw DisconnectedError("connection to " + peer_address() + " is closed");
  if (!fault) {
    if (!backlog_.empty()) {  // behind a delayed frame: keep the order
      backlog_.emplace_back(backlog_.back().first, std::move(frame));
      return;
    }
    write_locked(std::move(frame));
    return;
  }
  switch (fault->action) {
    case Fault::kDrop:
      return;
    case Fault::kDelay: {
      auto at = Clock::now() + fault->delay;
      if (!backlog_.empty()) at = std::max(at, backlog_.back().first);
      backlog_.emplace_back(at, std::move(frame));
      owner_->flush_at(at, weak_from_this());
      return;
    }
    case Fault::kDuplicate: {
      OutFrame again = copy_frame(frame);
      if (!backlog_.empty()) {
        auto at = backlog_.back().first;
        backlog_.emplace_back(at, std::move(frame));
        backlog_.emplace_back(at, std::move(again));
        return;
      }
      write_locked(std::move(frame));
      inner_->send(std::move(again));
      return;
    }
    case Fault::kReorder:
      if (held_) {  // two in a row: the first goes now
        write_locked(std::move(frame));
      } else {
        held_ = std::move(frame);
      }
      return;
    case Fault::kCut:
      inner_->close("cut by fault injection");
      return;
  }
}

}  // namespace

TransportFactory faulty_transport(std::shared_ptr<FaultPlan> plan, TransportFactory inner) {
  if (!plan) throw std::invalid_argument("faulty_transport: no FaultPlan");
  return [plan, inner](const Limits& limits,
                       Transport::Callbacks callbacks) -> std::unique_ptr<Transport> {
    return std::make_unique<FaultyTransport>(limits, std::move(callbacks), plan, inner);
  };
}

}  // namespace tandem::rpc
