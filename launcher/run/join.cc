// How a node joins node 0's launcher (launcher/run/join.h): the proofs,
// node 0's side (its listener and the connections that have not joined
// yet) and the node's side of the handshake.
#include "launcher/run/join.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "launcher/run/io.h"
#include "launcher/run/launcher.h"
#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/common/log.h"

namespace tandem::launcher {

namespace {

std::string hex_of(const rpc::Sha256Digest& digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string text;
  for (uint8_t byte : digest) {
    text += kHex[byte >> 4];
    text += kHex[byte & 15];
  }
  return text;
}

// The handshake's proofs (the top of this file), in hex; "-" where the job
// has no token. Each covers both nonces, the node's rank and its
// --nproc-per-node, and is labelled by role, so neither can be replayed,
// reflected or moved to another join.
std::string handshake_proof(const char* role, const std::string& token, const std::string& nonce0,
                            const std::string& nonce1, int node_rank, int nproc,
                            const std::string& flags) {
  if (token.empty()) return "-";
  return hex_of(rpc::hmac_sha256(token, std::string("tandem-run ") + role + " " + nonce0 + " " +
                                            nonce1 + " " + std::to_string(node_rank) + " " +
                                            std::to_string(nproc) + " " + flags));
}

// "name=value,..." -> (name, value) in order; empty for a malformed text.
std::vector<std::pair<std::string, std::string>> flag_pairs(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) return {};
    out.emplace_back(item.substr(0, eq), item.substr(eq + 1));
  }
  return out;
}

}  // namespace

std::string coordination_nnodes(const Options& options) {
  return options.min_nodes == options.nnodes
             ? std::to_string(options.nnodes)
             : std::to_string(options.min_nodes) + ":" + std::to_string(options.nnodes);
}

std::string coordination_rule(const Options& options) {
  return "a launcher coordinates with --max-restarts above 0 or --nnodes MIN:MAX on several "
         "nodes, and this node has --nnodes " + coordination_nnodes(options) +
         " --max-restarts " + std::to_string(options.max_restarts);
}

std::string coordination_flags(const Options& options) {
  return "nnodes=" + coordination_nnodes(options) + ",max-restarts=" + std::to_string(options.max_restarts) +
         ",peer-timeout=" +
         (options.peer_timeout_s < 0 ? std::string("unset") : std::to_string(options.peer_timeout_s));
}

std::string flags_disagreement(const std::string& ours, const std::string& theirs) {
  const auto mine = flag_pairs(ours), other = flag_pairs(theirs);
  if (other.size() != mine.size()) return "flags node 0 cannot read (" + quoted(theirs) + ")";
  for (size_t i = 0; i < mine.size(); ++i) {
    if (other[i].first != mine[i].first) {
      return "flags node 0 cannot read (" + quoted(theirs) + ")";
    }
    if (other[i].second != mine[i].second) {
      return "--" + mine[i].first + " " + rpc::printable(other[i].second, 40) +
             " differs from node 0's " + mine[i].second +
             " (every node's launcher takes the same --nnodes, --max-restarts and --peer-timeout)";
    }
  }
  return "";
}

std::string user_token() {
  const char* token = std::getenv("TANDEM_TOKEN");
  return token ? token : "";
}

std::string admit_proof(const std::string& token, const std::string& nonce0,
                        const std::string& nonce1, int node_rank, int nproc,
                        const std::string& flags) {
  return handshake_proof("admit", token, nonce0, nonce1, node_rank, nproc, flags);
}
std::string join_proof(const std::string& token, const std::string& nonce0,
                       const std::string& nonce1, int node_rank, int nproc,
                       const std::string& flags) {
  return handshake_proof("join", token, nonce0, nonce1, node_rank, nproc, flags);
}
// The key every line of the session is MACed under (channel.h, 3.).
std::string session_key(const std::string& token, const std::string& nonce0,
                        const std::string& nonce1) {
  const rpc::Sha256Digest d =
      rpc::hmac_sha256(token, "tandem-run session " + nonce0 + " " + nonce1);
  return std::string(d.begin(), d.end());
}

// What a mismatched proof says about the two ends' tokens.
std::string token_mismatch(const std::string& ours, const std::string& their_proof,
                           const char* whose) {
  if (ours.empty() != (their_proof == "-")) {
    return "one of the two launchers has TANDEM_TOKEN set and the other not";
  }
  return std::string("its TANDEM_TOKEN differs from ") + whose;
}

// A nonce as a peer may send it: 8 to 64 hex digits.
bool is_nonce(const std::string& text) {
  if (text.size() < 8 || text.size() > 64) return false;
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// A peer's words, safe to print (rpc/common/log.h).
std::string quoted(const std::string& text) { return "'" + rpc::printable(text, 80) + "'"; }

std::vector<std::string> words_of(const std::string& line, size_t at_most) {
  std::vector<std::string> words;
  std::istringstream in(line);
  std::string word;
  while (in >> word) {
    if (at_most && words.size() + 1 == at_most) {  // the rest of the line, whole
      std::string rest;
      std::getline(in, rest);
      words.push_back(word + rest);
      break;
    }
    words.push_back(word);
  }
  return words;
}

// A whole decimal integer, or nullopt.
std::optional<int> integer(const std::string& text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  size_t i = text[0] == '-' ? 1 : 0;
  if (i == text.size()) return std::nullopt;
  int value = 0;
  for (; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return std::nullopt;
    value = value * 10 + (text[i] - '0');
  }
  return text[0] == '-' ? -value : value;
}

std::string seconds_text(std::chrono::seconds s) { return std::to_string(s.count()) + " s"; }

void Launcher::accept_nodes() {
  for (;;) {
    int error = 0;
    std::optional<Channel> channel = accept_channel(listen_fd_, error);
    if (!channel) {
      if (error != 0) {
        // Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM):
        // the connection stays queued and the socket readable, so polling
        // it again at once would spin. The listener rests instead.
        accept_paused_until_ = Clock::now() + kAcceptBackoff;
        if (!accept_error_logged_) {
          accept_error_logged_ = true;
          report("accepting a node's connection failed: " + errno_text(error) +
                 "; not accepting for " + std::to_string(kAcceptBackoff.count()) +
                 " ms at a time while it lasts (logged once)");
        }
      }
      return;
    }
    if (pending_.size() >= kMaxPending) {
      // Full: the oldest that has not even asked to join makes room (a
      // real node asks at once, so a crowd that holds its connections
      // silent cannot keep one out); when all have asked, this one goes.
      auto oldest = pending_.end();
      for (auto it = pending_.begin(); it != pending_.end(); ++it) {
        if (!it->asked && (oldest == pending_.end() || it->since < oldest->since)) oldest = it;
      }
      const std::string dropped = oldest == pending_.end() ? channel->peer() : oldest->channel.peer();
      peer_log_.write("tandem-run: closed a connection from " + dropped + ": " +
                      std::to_string(kMaxPending) +
                      " connections that have not proven the token are waiting already");
      if (oldest == pending_.end()) continue;  // (closed as it goes: it never gets a nonce)
      pending_.erase(oldest);
    }
    Pending pending;
    pending.channel = std::move(*channel);
    pending.nonce = rpc::random_hex(16);
    pending.channel.limit_total(kMaxPendingBytes);
    if (pending.channel.send("tandem-run " + std::to_string(kProtocol) + " " + pending.nonce)) {
      pending_.push_back(std::move(pending));
    }
  }
}

void Launcher::tick_pending(Clock::time_point now) {
  for (size_t i = 0; i < pending_.size();) {
    bool keep = true;
    while (keep) {
      std::optional<std::string> line = pending_[i].channel.next_line();
      if (!line) break;
      if (*line == "ping") continue;  // (before its join)
      // Goes on to the proof, admits (moves its channel out) or refuses (closes it).
      keep = on_pending_line(i, *line);
      if (finished_) return;
    }
    Pending& p = pending_[i];
    if (!keep || !p.channel.is_open() || now - p.since > kHandshakeLimit) {
      if (keep && (p.channel.is_open() || !p.channel.why().empty())) {
        const std::string why =
            p.channel.is_open() ? "silent for " + seconds_text(kHandshakeLimit)
                                : rpc::printable(p.channel.why());
        peer_log_.write("tandem-run: a connection from " + p.channel.peer() + " never joined (" +
                        why + ")");
      }
      pending_.erase(pending_.begin() + static_cast<long>(i));
      continue;
    }
    ++i;
  }
}

int Launcher::free_node_rank() const {
  // (only nodes that proved the token hold a rank: a connection that has
  // not cannot keep one from a real node; two that were given the same
  // rank race, and the one refused at its proof asks again)
  for (int rank = 1; rank < options_.nnodes; ++rank) {
    bool taken = false;
    for (const Node& node : nodes_) taken = taken || node.node_rank == rank;
    if (!taken) return rank;
  }
  return -1;
}

bool Launcher::on_pending_line(size_t index, const std::string& line) {
  Pending& p = pending_[index];
  const std::vector<std::string> w = words_of(line);
  const std::string from = p.channel.peer();
  auto refuse = [&](const std::string& why) {
    report("refused the node at " + from + ": " + why);
    p.channel.send("refused " + why);
    p.channel.close();
    return false;
  };
  auto joined_already = [&](int node_rank) -> const Node* {
    for (const Node& node : nodes_) {
      if (node.node_rank == node_rank) return &node;
    }
    return nullptr;
  };
  if (!p.asked) {
    // 2.: "join RANK NPROC NONCE1 FLAGS" (RANK "any": node 0 numbers it)
    if (w.size() != 5 || w[0] != "join" || !(integer(w[1]) || w[1] == "any") || !integer(w[2])) {
      return refuse("not a tandem-run join (" + quoted(line) + ")");
    }
    const bool numbered_here = w[1] == "any";
    const int nproc = *integer(w[2]);
    if (!is_nonce(w[3])) return refuse("a join without a nonce (" + quoted(line) + ")");
    if (nproc != options_.nproc_per_node) {
      return refuse("--nproc-per-node " + std::to_string(nproc) + " differs from node 0's " +
                    std::to_string(options_.nproc_per_node));
    }
    if (const std::string why = flags_disagreement(coordination_flags(options_), w[4]);
        !why.empty()) {
      return refuse(why);
    }
    const int node_rank = numbered_here ? free_node_rank() : *integer(w[1]);
    if (numbered_here && node_rank < 0) {
      return refuse("all " + std::to_string(options_.nnodes - 1) +
                    " node ranks after node 0 are taken (--nnodes " +
                    coordination_nnodes(options_) + ")");
    }
    if (node_rank < 1 || node_rank >= options_.nnodes) {
      return refuse("--node-rank " + std::to_string(node_rank) + " is out of range for --nnodes " +
                    std::to_string(options_.nnodes) + " (1 to " +
                    std::to_string(options_.nnodes - 1) + " for the nodes that join node 0)");
    }
    if (const Node* node = joined_already(node_rank)) {
      return refuse("node " + std::to_string(node_rank) + " has joined already, from " +
                    node->channel.peer());
    }
    p.asked = true;
    p.node_rank = node_rank;
    p.node_nonce = w[3];
    // 3.: node 0 proves first (and says the rank it gave a node that asked for any).
    return p.channel.send("admit " +
                          admit_proof(user_token(), p.nonce, p.node_nonce, node_rank,
                                      options_.nproc_per_node, coordination_flags(options_)) +
                          (numbered_here ? " " + std::to_string(node_rank) : ""));
  }
  // 4.: "proof HMAC" (or the node's distrust of ours)
  if (!w.empty() && w[0] == "distrust") {
    report("the node at " + from + " did not take node 0's proof of the cluster token: " +
           rpc::printable(line.substr(std::min(line.size(), size_t{9})), 200));
    p.channel.close();
    return false;
  }
  if (w.size() != 2 || w[0] != "proof") {
    return refuse("not a tandem-run proof (" + quoted(line) + ")");
  }
  const std::string token = user_token();
  if (!rpc::constant_time_equal(
          w[1], join_proof(token, p.nonce, p.node_nonce, p.node_rank, options_.nproc_per_node,
                           coordination_flags(options_)))) {
    return refuse(token_mismatch(token, w[1], "node 0's"));
  }
  // 5.: from here on, every line is MACed (both ends know the key now).
  if (!token.empty()) p.channel.secure(session_key(token, p.nonce, p.node_nonce), "c>n", "n>c");
  p.channel.limit_total(0);
  if (const Node* node = joined_already(p.node_rank)) {
    return refuse("node " + std::to_string(p.node_rank) + " has joined already, from " +
                  node->channel.peer());
  }
  const int node_rank = p.node_rank;
  Node node;
  node.node_rank = node_rank;
  node.channel = std::move(p.channel);
  report("node " + std::to_string(node_rank) + " joined from " + from);
  nodes_.push_back(std::move(node));
  if (phase_ == Phase::kRunning && !final_code_) {
    const int in_round = nodes_in_round();
    if (in_round < options_.nnodes) {
      report("round " + std::to_string(round_.number) + " runs with " + std::to_string(in_round) +
             " of " + std::to_string(options_.nnodes) +
             " nodes: stopping it to start again with node " + std::to_string(node_rank) +
             " (not counted as a restart)");
      count_restart_ = false;
      stop_round();
    }
  }
  return false;
}

void Launcher::report_refused_lines(Channel& channel, const std::string& who) {
  std::string last;
  if (const size_t n = channel.take_refused(last)) {
    peer_log_.write("tandem-run: ignored " + std::to_string(n) + " line(s) from " + who +
                    " that did not carry this session's MAC (something between the "
                    "launchers?), the last " +
                    quoted(last));
  }
}

bool Launcher::on_coordinator_handshake(const std::vector<std::string>& w,
                                        const std::string& line) {
  if (w[0] == "tandem-run" && w.size() == 2 && !joined_) {
    // 1.: node 0's greeting; 2.: this node asks to join.
    const std::vector<std::string> hello = words_of(line);
    if (hello.size() != 3 || hello[1] != std::to_string(kProtocol) || !is_nonce(hello[2])) {
      report("node 0's launcher speaks another protocol (" + quoted(line) +
             "): run the same tandem-run on every node");
      finish(kExitFailure);
      return true;
    }
    coordinator_nonce_ = hello[2];
    my_nonce_ = rpc::random_hex(16);
    if (!options_.given_node_rank) options_.node_rank = -1;  // (any, on every try)
    coordinator_.send("join " +
                      (options_.node_rank < 0 ? std::string("any")
                                              : std::to_string(options_.node_rank)) +
                      " " +
                      std::to_string(options_.nproc_per_node) + " " + my_nonce_ + " " +
                      coordination_flags(options_));
    joined_ = true;
    return true;
  }
  if (w[0] == "refused") {
    const std::string why = w.size() > 1 ? rpc::printable(w[1], 300) : std::string("?");
    if ((why.find("has joined already") != std::string::npos ||
         why.find("node ranks after node 0 are taken") != std::string::npos) &&
        Clock::now() < connect_deadline_) {
      // Its own earlier connection, not yet noticed gone, or another node
      // given the same rank that proved first: try again.
      coordinator_.close();
      coordinator_nonce_.clear();
      joined_ = admitted_ = false;
      next_connect_ = Clock::now() + std::chrono::seconds(1);
      return true;
    }
    report("node 0's launcher refused this node: " + why);
    finish(kExitFailure);
    return true;
  }
  if (!admitted_) {
    if (w[0] == "admit" && joined_) {
      // 3.: node 0's proof, checked before this node proves anything.
      const std::vector<std::string> a = words_of(line);
      const std::string token = user_token();
      // (a node that asked for any rank is told its own: "admit PROOF RANK")
      const bool numbered = options_.node_rank < 0;
      const std::optional<int> given =
          numbered && a.size() == 3 ? integer(a[2]) : std::optional<int>(options_.node_rank);
      const bool shaped = a.size() == (numbered ? 3u : 2u) && given && *given >= 1 &&
                          *given < options_.nnodes;
      if (!shaped ||
          !rpc::constant_time_equal(a[1], admit_proof(token, coordinator_nonce_, my_nonce_,
                                                      *given, options_.nproc_per_node,
                                                      coordination_flags(options_)))) {
        const std::string why = shaped
                                    ? token_mismatch(token, a[1], "this node's")
                                    : "a bad proof (" + quoted(line) + ")";
        coordinator_.send("distrust " + why);
        report("the launcher at " + coordinator_.peer() +
               " did not prove the cluster token, so it is not node 0's of this job: " + why);
        finish(kExitFailure);
        return true;
      }
      options_.node_rank = *given;  // (its own from now on, a reconnection included)
      // 4.: this node's proof; every line after it is MACed (5.).
      coordinator_.send("proof " + join_proof(token, coordinator_nonce_, my_nonce_,
                                              options_.node_rank, options_.nproc_per_node,
                                              coordination_flags(options_)));
      if (!token.empty()) {
        coordinator_.secure(session_key(token, coordinator_nonce_, my_nonce_), "n>c", "c>n");
      }
      admitted_ = true;
      report("joined node 0's launcher at " + coordinator_.peer() + " as node " +
             std::to_string(options_.node_rank));
      return true;
    }
    // Nothing else counts before node 0 has proven the token.
    peer_log_.write("tandem-run: ignored a line from " + coordinator_.peer() +
                    " before it proved the cluster token: " + quoted(line));
    return true;
  }
  return false;
}

}  // namespace tandem::launcher
