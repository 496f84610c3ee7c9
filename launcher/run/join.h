// How another node's launcher joins node 0's (launcher/run/nodes.cc runs
// the rounds): the handshake in which both prove the cluster token, node 0
// first, and the bounds on connections that have not proven it. The
// steps, as launcher/run/join.cc runs them:
//  1. node 0 greets: "tandem-run 2 NONCE0";
//  2. the node asks: "join RANK NPROC NONCE1" (checked: a rank in range, not
//     joined already, node 0's --nproc-per-node);
//  3. node 0 proves: "admit HMAC(token, admit NONCE0 NONCE1 RANK NPROC)";
//  4. the node checks it (a launcher that cannot is not node 0's: the node
//     says "distrust WHY" and ends) and proves: "proof HMAC(token, join ...)";
//  5. node 0 checks it, and the node has joined. From then on every line
//     either way carries a MAC under the session's key (HMAC(token, session
//     NONCE0 NONCE1)) over its direction and number (channel.h, 3.): a
//     relay between two launchers can drop lines, never make one.
// A connection that has not proven the token may send kMaxPendingBytes
// within kHandshakeLimit, and at most kMaxPending of them wait at once (a
// new one makes room by closing the oldest that has not asked to join yet);
// an accept() out of descriptors rests the listener for kAcceptBackoff. With no
// token on either side the proofs are "-" and lines carry no MAC.
// Also here: the parsing both files use on the launchers' lines.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace tandem::launcher {

constexpr int kProtocol = 2;  // 2: both ends prove the token; lines carry MACs
constexpr size_t kMaxPending = 16;
constexpr size_t kMaxPendingBytes = 8192;  // a join, a proof and a few pings
constexpr auto kHandshakeLimit = std::chrono::seconds(10);
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

// $TANDEM_TOKEN, or "".
std::string user_token();
// The proofs of steps 3. and 4., in hex; "-" where the job has no token.
// Each covers both nonces, the node's rank and its --nproc-per-node, and is
// labelled by role, so neither can be replayed, reflected or moved to
// another join.
std::string admit_proof(const std::string& token, const std::string& nonce0,
                        const std::string& nonce1, int node_rank, int nproc);
std::string join_proof(const std::string& token, const std::string& nonce0,
                       const std::string& nonce1, int node_rank, int nproc);
// The key every line of the session is MACed under (5.).
std::string session_key(const std::string& token, const std::string& nonce0,
                        const std::string& nonce1);
// What a proof that did not match says about the two ends' tokens.
std::string token_mismatch(const std::string& ours, const std::string& their_proof,
                           const char* whose);
// A nonce as a peer may send it: 8 to 64 hex digits.
bool is_nonce(const std::string& text);

// A peer's words, quoted and safe to print (rpc/common/log.h).
std::string quoted(const std::string& text);
// The words of a line; with `at_most`, the last one holds the rest of the line.
std::vector<std::string> words_of(const std::string& line, size_t at_most = 0);
// A whole decimal integer, or nullopt.
std::optional<int> integer(const std::string& text);
std::string seconds_text(std::chrono::seconds s);

}  // namespace tandem::launcher
