// The connection table, and how the agent opens and loses connections.
#include "tandem/rpc/agent/agent_impl.h"
#include "tandem/rpc/agent/call_table.h"
#include "tandem/rpc/agent/connection_table.h"
#include "tandem/rpc/agent/handshake.h"
#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/rref_context.h"

#include <cassert>
#include <cstdio>

namespace tandem::rpc {

ConnectionTable::ConnectionTable(int world_size) : peers_(world_size) {
  for (int r = 0; r < world_size; ++r) connect_mu_.push_back(std::make_unique<std::mutex>());
}

ConnectionPtr ConnectionTable::to(int rank) {
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    const auto& c = peers_.at(rank);
    if (!c || !c->closed()) return c;
  }
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto& c = peers_.at(rank);
  if (c && c->closed()) c = nullptr;  // on_closed may not have run yet
  return c;
}

ConnectionPtr ConnectionTable::add(const ConnectionPtr& conn, int rank, bool use, bool prefer) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  rank_of_conn_[conn->id()] = rank;
  dialed_.insert(conn->id());
  auto& current = peers_.at(rank);
  ConnectionPtr lost;
  if (use) {
    if (!current || current->closed()) {
      current = conn;
    } else if (prefer && !dialed_.count(current->id())) {
      lost = current;  // the peer's dial, which we had been using
      current = conn;
    } else {
      lost = conn;
    }
  }
  lock.unlock();
  // It may have closed before it was added: then forget() ran already, or
  // runs after this and finds it. Either way nothing stale stays.
  if (conn->closed()) forget(*conn);
  return lost;
}

ConnectionPtr ConnectionTable::add_accepted(const ConnectionPtr& conn, int rank, bool take_over) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  rank_of_conn_[conn->id()] = rank;
  auto& current = peers_.at(rank);
  ConnectionPtr lost;
  if (!current || current->closed()) {
    current = conn;
  } else if (take_over && dialed_.count(current->id())) {
    // Only our own dial gives way to the lower rank's.
    lost = current;
    current = conn;
    crossings_.fetch_add(1);
  } else if (dialed_.count(current->id())) {
    lost = conn;  // the higher rank's dial crossed ours: ours stays
  }
  // (A second connection from a peer whose first we still use is a redial
  // racing the first one's close: that one goes by itself.)
  lock.unlock();
  if (conn->closed()) forget(*conn);
  return lost;
}

int ConnectionTable::rank_of(const Connection& conn) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = rank_of_conn_.find(conn.id());
  return it == rank_of_conn_.end() ? -1 : it->second;
}

int ConnectionTable::forget(const Connection& conn) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  dialed_.erase(conn.id());
  auto it = rank_of_conn_.find(conn.id());
  if (it == rank_of_conn_.end()) return -1;
  const int r = it->second;
  rank_of_conn_.erase(it);
  if (peers_.at(r) && peers_[r]->id() == conn.id()) peers_[r] = nullptr;
  return r;
}

std::vector<ConnectionPtr> ConnectionTable::current() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::vector<ConnectionPtr> out;
  for (const auto& c : peers_) {
    if (c) out.push_back(c);
  }
  return out;
}

void ConnectionTable::clear() {
  std::unique_lock<std::shared_mutex> lock(mu_);
  for (auto& c : peers_) c = nullptr;
  rank_of_conn_.clear();
  dialed_.clear();
}

void GatedConnection::send(OutFrame&& frame) {
  if (!open_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_.load(std::memory_order_relaxed)) {
      if (held_retire_ && frame.kind == MessageKind::kRequest) {
        throw RetiredError("connection to " + peer_address() + " is retired");
      }
      if (!refused_.empty()) throw DisconnectedError(refused_);
      if (inner_->closed())
        throw DisconnectedError("connection to " + peer_address() + " is closed");
      held_.push_back(std::move(frame));
      return;
    }
  }
  inner_->send(std::move(frame));
}

void GatedConnection::retire(OutFrame&& last) {
  if (!open_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_.load(std::memory_order_relaxed)) {
      if (!refused_.empty()) throw DisconnectedError(refused_);
      held_retire_.emplace(std::move(last));  // written after the held frames
      return;
    }
  }
  inner_->retire(std::move(last));
}

void GatedConnection::open(OutFrame&& first) {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    inner_->send(std::move(first));
    for (auto& f : held_) inner_->send(std::move(f));
    if (held_retire_) inner_->retire(std::move(*held_retire_));
  } catch (const DisconnectedError&) {
    // Broken meanwhile: the transport reports the close, which fails the calls.
  }
  held_.clear();
  held_retire_.reset();
  open_.store(true, std::memory_order_release);
}

void GatedConnection::refuse(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  refused_ = why;
  held_.clear();
  held_retire_.reset();
}

ConnectionPtr AgentImpl::connection_to(int rank, std::chrono::milliseconds timeout) {
  if (auto c = conns_->to(rank)) return c;
  std::lock_guard<std::mutex> serial(conns_->connect_mutex(rank));
  if (auto c = conns_->to(rank)) return c;
  const WorkerInfo& w = workers_[rank];
  const auto dial_start = std::chrono::steady_clock::now();
  ConnectionPtr conn;
  const std::string& mode = options_.transport_mode;
  if (mode != "tcp") {
    // Shared memory where the peer is on this host (rpc/transport.h, 6.).
    std::string why;
    if (w.local.empty()) {
      why = "it offers no shared-memory endpoint";
    } else {
      try {
        conn = transport_->connect_local(w.local, timeout);
        if (!conn) why = "it is on another host or network namespace";
      } catch (const std::exception& e) {
        why = e.what();
        if (mode == "auto") {
          protocol_log_->write("tandem[" + printable(name()) + "]: shared memory to " +
                               printable(w.name) + " failed (" + printable(why) + "); using TCP");
        }
      }
    }
    if (!conn && mode == "shm") {
      throw DisconnectedError("worker " + w.name +
                              " cannot be reached over shared memory "
                              "(transport 'shm'): " +
                              why);
    }
  }
  try {
    if (!conn) conn = transport_->connect(w.host, w.port, timeout);
  } catch (const DisconnectedError& e) {
    throw DisconnectedError("worker " + w.name + " is unreachable: " + e.what());
  }
  // Step 1 of the handshake (rpc/agent/handshake.h): registered before it is
  // written, so that the answer finds it; the gate holds every call until
  // the peer has proved the token.
  auto gate = std::make_shared<GatedConnection>(conn);
  Message hello;
  hello.kind = MessageKind::kHello;
  hello.hello_step = 1;
  hello.hello_worker = name();
  hello.hello_rank = rank_;
  hello.hello_nonce = random_bytes(kNonceBytes);
  {
    std::lock_guard<std::mutex> lock(handshakes_->mu);
    handshakes_->dialed[conn->id()] = {rank, hello.hello_nonce, gate};
  }
  // The lower rank of a pair calls on the connection it dialed, even when
  // the peer's dial was accepted meanwhile (connection_table.h, 4.).
  ConnectionPtr lost = conns_->add(gate, rank, /*use=*/true, /*prefer=*/rank_ < rank);
  try {
    conn->send(encode(hello, options_.limits));
  } catch (const DisconnectedError& e) {
    throw DisconnectedError("worker " + w.name + " is unreachable: " + e.what());
  }
  if (lost) retire(lost);
  if (trace_) {
    // The dial and the first step of the handshake; the rest (the peer's
    // answer) is in the first call's slice, which waits at the gate.
    trace_->slice("connect", "rpc.connect", dial_start, std::chrono::steady_clock::now(), {},
                  "{\"to\":" + std::to_string(rank) + ",\"transport\":\"" +
                      std::string(conn->kind()) + "\"}");
  }
  return gate;
}

void AgentImpl::retire(const ConnectionPtr& conn) {
  const uint64_t id = conn->id();
  {
    std::lock_guard<std::mutex> lock(retire_mu_);
    Retiring& r = retiring_[id];
    if (r.sent) return;
    r.sent = true;
    if (!r.conn) r.conn = conn;
    retiring_count_.store(retiring_.size(), std::memory_order_release);
  }
  Message notice;
  notice.kind = MessageKind::kRequest;
  notice.id = 0;  // one way
  notice.callee = kRetireCallee;
  try {
    conn->retire(encode(notice, options_.limits));
  } catch (const DisconnectedError&) {
    // closed meanwhile: on_closed forgets it
  }
  maybe_close_retired(id);
}

void AgentImpl::on_retire_from_loop(const ConnectionPtr& conn) {
  const uint64_t id = conn->id();
  {
    std::lock_guard<std::mutex> lock(retire_mu_);
    Retiring& r = retiring_[id];
    r.received = true;
    if (!r.conn) r.conn = conn;
    retiring_count_.store(retiring_.size(), std::memory_order_release);
  }
  maybe_close_retired(id);
}

void AgentImpl::close_retired_if_done(uint64_t conn_id) {
  ConnectionPtr conn;
  {
    std::lock_guard<std::mutex> lock(retire_mu_);
    auto it = retiring_.find(conn_id);
    if (it == retiring_.end() || !it->second.sent || !it->second.received) return;
    conn = it->second.conn;
  }
  // Both sides send no more requests on it: once our calls on it are
  // answered and we owe the peer no answer there, nothing more comes or
  // goes on it.
  if (calls_->any_on(conn_id) || conn->answers_owed() > 0) return;
  {
    std::lock_guard<std::mutex> lock(retire_mu_);
    if (retiring_.erase(conn_id) == 0) return;  // another thread got here first
    retiring_count_.store(retiring_.size(), std::memory_order_release);
  }
  conn->close_when_flushed();
}

void AgentImpl::on_closed_from_loop(const ConnectionPtr& conn, const std::string& reason) {
  assert(transport_->on_transport_thread());
  if (reason.rfind("protocol error", 0) == 0) {
    protocol_log_->write("tandem[" + printable(name()) + "]: " + printable(reason) +
                         "; connection closed");
  }
  const int r = conns_->forget(*conn);
  const uint64_t cid = conn->id();
  // What it held for a peer it can no longer reach: nobody will release it.
  if (r >= 0 && !conns_->to(r)) drop_ipc_held(r);
  if (retiring_count_.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lock(retire_mu_);
    retiring_.erase(cid);
    retiring_count_.store(retiring_.size(), std::memory_order_release);
  }
  {
    std::lock_guard<std::mutex> lock(handshakes_->mu);
    handshakes_->dialed.erase(cid);
    handshakes_->accepted.erase(cid);
  }
  const std::string peer = r >= 0 ? workers_[r].name : conn->peer_address();
  // The transport names the peer by address ("connection reset by
  // 10.0.0.2:4711"); say who that is.
  std::string why = reason;
  if (r >= 0) {
    const std::string address = conn->peer_address();
    const auto at = why.find(address);
    if (at != std::string::npos) why.replace(at, address.size(), peer + " (" + address + ")");
  }
  if (r >= 0 && conn->stalled()) {
    bool fresh = false;  // (said once, until it is heard from again)
    {
      std::lock_guard<std::mutex> lock(stalled_mu_);
      fresh = stalled_.at(static_cast<size_t>(r)).empty();
      stalled_[static_cast<size_t>(r)] = why;
    }
    if (fresh) {
      protocol_log_->write("tandem[" + printable(name()) + "]: " + printable(peer) +
                           " counts as stalled: " + printable(why));
    }
  }
  // Only calls whose request went out on it: one still being sent learns
  // of the close from send() (or after it, from closed()).
  calls_->fail_where([cid](const CallTable::Call& c) { return c.conn_id == cid && c.sent; },
                     [&](const CallTable::Call& c) {
                       return std::make_exception_ptr(
                           DisconnectedError("connection to " + peer + " lost during '" + c.callee +
                                             "'" + (why.empty() ? "" : ": " + why)));
                     });
}

void AgentImpl::peer_alive(int rank) {
  std::lock_guard<std::mutex> lock(stalled_mu_);
  if (rank >= 0 && static_cast<size_t>(rank) < stalled_.size()) {
    stalled_[static_cast<size_t>(rank)].clear();
  }
}

std::string AgentImpl::stalled(const std::string& worker) const {
  const int r = get_worker_info(worker).rank;
  std::lock_guard<std::mutex> lock(stalled_mu_);
  return stalled_.at(static_cast<size_t>(r));
}

void AgentImpl::watch(const std::string& worker) {
  const int r = get_worker_info(worker).rank;
  if (r == rank_ || conns_->to(r)) return;
  // Dialing returns once the socket is open; the handshake goes on behind
  // it. A peer that cannot be reached now is found out by whatever calls it.
  try {
    connection_to(r, std::min<std::chrono::milliseconds>(options_.init_timeout,
                                                          std::chrono::seconds(5)));
  } catch (const std::exception&) {
    // (its calls and collectives say what is wrong with it)
  }
}

}  // namespace tandem::rpc
