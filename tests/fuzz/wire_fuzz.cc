// libFuzzer target for what a peer controls before anything trusts it: the
// frame decoder (preamble, Cap'n Proto envelope, value tree, tensor
// descriptions, the handshake's frame rules) and the handshake's checks.
// Built by `./dev fuzz` with clang (-fsanitize=fuzzer,address,undefined);
// wire.cc, errors.cc and auth.cc are compiled into it so that coverage
// guides the search through them.
//
// An input is: one control byte, then the bytes a peer writes. The control
// byte picks how many handshake frames must come first (0-2) and how the
// bytes are cut into reads (1 to 128 bytes, or the decoder's own direct
// reads into tensor storage). Every frame that decodes is encoded again and
// must decode to the same kind, id and callee; then the handshake's proof
// check runs on it. A ProtocolError ends the input (the transport would
// close the connection); any other exception, crash, leak or undefined
// behaviour is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>

#include "tandem/rpc/auth.h"
#include "tandem/rpc/wire.h"

using namespace tandem::rpc;

namespace {

Limits fuzz_limits() {
  Limits l;
  l.max_envelope_bytes = 64 << 10;  // enough for every kind of envelope
  l.max_body_bytes = 1 << 20;       // a peer may ask; we need not give 16 GiB
  l.traversal_limit_words = 64 << 10;
  return l;
}

void check_round_trip(const Message& m, const Limits& limits) {
  OutFrame frame;
  try {
    frame = encode(m, limits);
  } catch (const std::invalid_argument&) {
    return;  // an RRef placeholder cannot travel without the agent's hook
  }
  const std::string bytes = frame.to_bytes();
  FrameDecoder again(limits);
  again.feed(bytes.data(), bytes.size());  // what we encode must decode: throws otherwise
  if (!again.has_message()) std::abort();
  Message back = again.take();
  if (back.kind != m.kind || back.id != m.id || back.callee != m.callee ||
      back.values.size() != m.values.size() || back.hello_nonce != m.hello_nonce) {
    std::fprintf(stderr, "round trip changed the message\n");
    std::abort();
  }
}

void check_handshake(const Message& m) {
  if (m.kind != MessageKind::kHello) return;
  // What the agent does with a step: sizes first, then the proof.
  if (m.hello_nonce.size() != kNonceBytes || m.hello_proof.size() != kProofBytes) return;
  const std::string mine(kNonceBytes, 'n');
  const std::string want = acceptor_proof("token", m.hello_nonce, mine, m.hello_rank, 0);
  if (constant_time_equal(m.hello_proof, want) != (m.hello_proof == want)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t control = data[0];
  ++data;
  --size;
  const Limits limits = fuzz_limits();
  FrameDecoder dec(limits, /*handshake_frames=*/control % 3);
  const size_t chunk = 1 + (control >> 2) * 2;  // 1 .. 127
  const bool direct = (control & 0x80) != 0;
  size_t off = 0;
  try {
    while (off < size) {
      auto [target, want] = dec.direct_target(direct ? 1 : SIZE_MAX);
      if (target) {
        const size_t n = std::min(want, size - off);
        std::memcpy(target, data + off, n);
        dec.direct_commit(n);
        off += n;
      } else {
        const size_t n = std::min(chunk, size - off);
        dec.feed(reinterpret_cast<const char*>(data + off), n);
        off += n;
      }
      while (dec.has_message()) {
        Message m = dec.take();
        check_round_trip(m, limits);
        check_handshake(m);
      }
    }
  } catch (const ProtocolError&) {
    return 0;  // the connection would close here
  }
  return 0;
}

// `fuzz_wire --write-seeds DIR` writes the seed corpus kept in
// tests/fuzz/corpus (one frame of each kind, and a handshake).
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  if (*argc < 3 || std::strcmp((*argv)[1], "--write-seeds") != 0) return 0;
  const std::string dir = (*argv)[2];
  auto write = [&](const std::string& name, uint8_t control, const std::string& bytes) {
    FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
    if (!f) std::exit(1);
    std::fputc(control, f);
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  };
  Message hello;
  hello.kind = MessageKind::kHello;
  hello.hello_step = 1;
  hello.hello_worker = "worker0";
  hello.hello_rank = 0;
  hello.hello_nonce = std::string(kNonceBytes, 'n');
  Message proof = hello;
  proof.hello_step = 3;
  proof.hello_nonce.clear();
  proof.hello_proof = std::string(kProofBytes, 'p');
  Message req;
  req.kind = MessageKind::kRequest;
  req.id = 7;
  req.callee = "f";
  req.timeout_ms = 100;
  req.values = {int64_t(1), 2.5, std::string("s"),
                c10::IValue(c10::List<int64_t>({1, 2, 3})),
                c10::ivalue::Tuple::create({c10::IValue(true), c10::IValue()})};
  Message tensors = req;
  tensors.values = {at::arange(6, at::kFloat).reshape({2, 3}), at::empty({0, 4}),
                    at::ones({3}, at::kLong)};
  Message resp;
  resp.kind = MessageKind::kResponse;
  resp.id = 7;
  resp.values = {at::arange(4, at::kDouble)};
  Message err;
  err.kind = MessageKind::kError;
  err.id = 7;
  err.error_code = ErrorCode::kRemote;
  err.error_worker = "worker1";
  err.error_message = "boom";
  auto bytes = [](const Message& m) { return encode(m).to_bytes(); };
  write("handshake", 2 | (4 << 2), bytes(hello) + bytes(proof) + bytes(req));
  write("request", 0, bytes(req));
  write("tensors", 0x80, bytes(tensors));
  write("tensors_small_reads", 1 << 2, bytes(tensors));
  write("response_error", 0, bytes(resp) + bytes(err));
  std::exit(0);
}
