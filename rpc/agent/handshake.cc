// The agent's side of the connection handshake (rpc/agent/handshake.h has
// its state, rpc/common/auth.h the protocol): each step a peer sends is
// checked here, on the loop thread; a step that fails closes the connection.
#include "tandem/rpc/agent/agent_impl.h"

#include <cassert>

#include "tandem/rpc/agent/connection_table.h"
#include "tandem/rpc/agent/handshake.h"
#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/wire/checks.h"

namespace tandem::rpc {

void AgentImpl::on_hello_from_loop(const ConnectionPtr& conn, const Message& msg) {
  assert(transport_->on_transport_thread());
  const uint64_t id = conn->id();
  const std::string& token = options_.token;
  std::unique_lock<std::mutex> lock(handshakes_->mu);
  // Refuses the handshake: the connection closes with `why`, and a dialed
  // one's gate gives `why` to any call still trying to send on it.
  std::shared_ptr<GatedConnection> gate;
  auto reject = [&](const std::string& why) {
    lock.unlock();
    const std::string reason =
        "protocol error from " + conn->peer_address() + ": handshake rejected: " + why;
    if (gate) gate->refuse(reason);
    conn->close(reason);
  };
  try {
    check_hello(msg.hello_step, msg.hello_nonce.size(), msg.hello_proof.size());
  } catch (const ProtocolError& e) {
    return reject(e.what());
  }
  const bool dialed = handshakes_->dialed.count(id) > 0;
  const bool accepted = handshakes_->accepted.count(id) > 0;
  switch (msg.hello_step) {
    case 1: {  // a dialer introduces itself on a connection we accepted
      const int r = msg.hello_rank;
      if (dialed || accepted || conns_->rank_of(*conn) >= 0) return reject("a second step 1");
      if (r < 0 || r >= world_size() || workers_[r].name != msg.hello_worker) {
        return reject("unknown worker '" + printable(msg.hello_worker, 64) + "' (rank " +
                      std::to_string(r) + ")");
      }
      HandshakeTable::Accepted a{r, msg.hello_nonce, random_bytes(kNonceBytes)};
      Message answer;
      answer.kind = MessageKind::kHello;
      answer.hello_step = 2;
      answer.hello_worker = name();
      answer.hello_rank = rank_;
      answer.hello_nonce = a.nonce;
      answer.hello_proof = acceptor_proof(token, a.dialer_nonce, a.nonce, r, rank_);
      handshakes_->accepted[id] = std::move(a);
      lock.unlock();
      try {
        conn->send(encode(answer, options_.limits));
      } catch (const DisconnectedError&) {
        // closed meanwhile: on_closed forgets it
      }
      return;
    }
    case 2: {  // the worker we dialed answers, with its proof
      if (!dialed) return reject("a step 2 nobody asked for");
      HandshakeTable::Dialed d = std::move(handshakes_->dialed[id]);
      handshakes_->dialed.erase(id);
      gate = d.gate;
      const std::string& expected = workers_[d.rank].name;
      if (msg.hello_rank != d.rank || msg.hello_worker != expected) {
        return reject("dialed " + expected + " (rank " + std::to_string(d.rank) + ") but '" +
                      printable(msg.hello_worker, 64) + "' (rank " +
                      std::to_string(msg.hello_rank) + ") answered");
      }
      if (!constant_time_equal(msg.hello_proof,
                               acceptor_proof(token, d.nonce, msg.hello_nonce, rank_, d.rank))) {
        return reject(expected +
                      " did not prove the cluster token (is TANDEM_TOKEN the same "
                      "on every worker?)");
      }
      lock.unlock();
      Message proof;
      proof.kind = MessageKind::kHello;
      proof.hello_step = 3;
      proof.hello_worker = name();
      proof.hello_rank = rank_;
      proof.hello_proof = dialer_proof(token, d.nonce, msg.hello_nonce, rank_, d.rank);
      d.gate->open(encode(proof, options_.limits));
      peer_alive(d.rank);
      return;
    }
    case 3: {  // the dialer's proof, on a connection we accepted
      if (!accepted) return reject("a step 3 before step 1");
      HandshakeTable::Accepted a = std::move(handshakes_->accepted[id]);
      handshakes_->accepted.erase(id);
      if (!constant_time_equal(msg.hello_proof,
                               dialer_proof(token, a.dialer_nonce, a.nonce, a.rank, rank_))) {
        return reject(workers_[a.rank].name + " (as it claimed) did not prove the cluster token");
      }
      lock.unlock();
      // One connection per pair (connection_table.h, 4.): when both dialed,
      // the lower rank keeps the one it dialed.
      if (auto lost = conns_->add_accepted(conn, a.rank, /*take_over=*/a.rank < rank_)) {
        retire(lost);
      }
      peer_alive(a.rank);
      return;
    }
    default:  // (check_hello refused it above)
      return reject("unknown step " + std::to_string(msg.hello_step));
  }
}

}  // namespace tandem::rpc
