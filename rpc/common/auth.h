// Proving the cluster token without sending it.
//
// Every connection opens with a three-step handshake (rpc/agent/agent.cc runs it;
// the frames are MessageKind::kHello, told apart by Message::hello_step):
//  1. The dialer sends its name, its rank and a fresh random nonce Nd.
//  2. The acceptor checks that name and rank belong to the world, and answers
//     with its own name and rank, a fresh nonce Na, and
//        proof_a = HMAC-SHA256(token, "tandem/accept" | Nd | Na | dialer | acceptor)
//     (ranks as 4 little-endian bytes). The acceptor proves first: a dialer
//     never writes a call, nor anything derived from the token, to a peer
//     that has not shown it knows the token.
//  3. The dialer checks proof_a (in constant time) and answers
//        proof_d = HMAC-SHA256(token, "tandem/dial" | Na | Nd | dialer | acceptor)
//     and may write calls right behind it. The acceptor checks proof_d before
//     it reads anything else from that connection.
// A peer that does not know the token learns one MAC of a nonce it chose and
// nothing else; it cannot replay one (each side's nonce is fresh) nor
// reflect one back (the two proofs are labelled by role). A weak token can
// still be guessed offline from such a MAC: use a long random one
// (`tandem-run` makes one per job when TANDEM_TOKEN is unset).
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace tandem::rpc {

constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;

using Sha256Digest = std::array<uint8_t, 32>;

// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) of byte strings.
Sha256Digest sha256(const std::string& data);
Sha256Digest hmac_sha256(const std::string& key, const std::string& data);

// `n` bytes from the kernel's random source (getrandom). Throws
// std::runtime_error when it cannot be read.
std::string random_bytes(size_t n);
// `n` random bytes as 2n lowercase hex digits.
std::string random_hex(size_t n);
// Bytes as lowercase hex digits, two a byte (a digest's, say).
std::string to_hex(const uint8_t* bytes, size_t n);

// Equality that takes the same time wherever the strings differ.
bool constant_time_equal(const std::string& a, const std::string& b);

// The handshake's two proofs (see the top of this file), as raw bytes.
std::string acceptor_proof(const std::string& token, const std::string& dialer_nonce,
                           const std::string& acceptor_nonce, int dialer_rank, int acceptor_rank);
std::string dialer_proof(const std::string& token, const std::string& dialer_nonce,
                         const std::string& acceptor_nonce, int dialer_rank, int acceptor_rank);

}  // namespace tandem::rpc
