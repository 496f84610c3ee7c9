// How another node's launcher joins node 0's (launcher/run/nodes.cc runs
// the rounds): the handshake in which both prove the cluster token, node 0
// first, and the bounds on connections that have not proven it. The
// steps, as launcher/run/join.cc runs them:
//  1. node 0 greets: "tandem-run 3 NONCE0";
//  2. the node asks: "join RANK NPROC NONCE1 FLAGS" (checked: a rank in
//     range, not joined already, node 0's --nproc-per-node, and FLAGS,
//     coordination_flags(), node 0's: a flag that differs is named with
//     both values); RANK "any" (no --node-rank) asks node 0 for the lowest
//     free one, which it names after its proof: "admit HMAC RANK";
//  3. node 0 proves: "admit HMAC(token, admit NONCE0 NONCE1 RANK NPROC FLAGS)";
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

#include "launcher/run/options.h"

namespace tandem::launcher {

// 2: both ends prove the token; lines carry MACs. 3: the join carries the
// coordination flags.
constexpr int kProtocol = 3;
constexpr size_t kMaxPending = 16;
constexpr size_t kMaxPendingBytes = 8192;  // a join, a proof and a few pings
constexpr auto kHandshakeLimit = std::chrono::seconds(10);
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

// $TANDEM_TOKEN, or "".
std::string user_token();
// The proofs of steps 3. and 4., in hex; "-" where the job has no token.
// Each covers both nonces, the node's rank, its --nproc-per-node and its
// coordination flags, and is
// labelled by role, so neither can be replayed, reflected or moved to
// another join.
std::string admit_proof(const std::string& token, const std::string& nonce0,
                        const std::string& nonce1, int node_rank, int nproc,
                        const std::string& flags);
std::string join_proof(const std::string& token, const std::string& nonce0,
                       const std::string& nonce1, int node_rank, int nproc,
                       const std::string& flags);
// The flags every node's launcher must share, as the join carries them:
// "nnodes=MIN:MAX,max-restarts=N,peer-timeout=S" (no spaces).
std::string coordination_flags(const Options& options);
// --nnodes as given: "K" or "MIN:MAX".
std::string coordination_nnodes(const Options& options);
// When a launcher coordinates, and this one's flags that decide it (for
// the messages of launchers that disagree on coordinating at all).
std::string coordination_rule(const Options& options);
// "" when `theirs` (a node's) equals `ours` (node 0's); else which flag
// differs, with both values.
std::string flags_disagreement(const std::string& ours, const std::string& theirs);
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
