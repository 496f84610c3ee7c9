// libFuzzer target for what a peer controls before anything trusts it: the
// frame decoder (preamble, Cap'n Proto envelope, value tree, tensor
// descriptions, the handshake's frame rules) and the handshake's checks.
// Built by `./dev fuzz` with clang (-fsanitize=fuzzer,address,undefined);
// the codec (rpc/wire/), errors.cc and auth.cc are compiled into it so that
// coverage guides the search through them.
//
// An input is: one control byte, then the bytes a peer writes. The control
// byte picks how many handshake frames must come first (0-2) and how the
// bytes are cut into reads (1 to 128 bytes, or the decoder's own direct
// reads into tensor storage); with its bit 0x40 set, the connection is a
// shm one, whose frames may name tensors in a shared segment (one 1 MiB
// memfd, announced before the input, with a fresh block every 4 KiB).
// Every frame that decodes is encoded again and
// must decode to the same kind, id and callee; then the handshake's proof
// check runs on it. The same bytes also go to one check alone
// (check_shape, rpc/wire/checks.h), which a decoder reaches only through a
// well-formed envelope: whatever it passes must describe a contiguous tensor
// whose element count it got right. A ProtocolError ends the input (the transport would
// close the connection); any other exception, crash, leak or undefined
// behaviour is a finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/transport/shm/segments.h"
#include "tandem/rpc/wire/checks.h"
#include "tandem/rpc/wire/wire.h"

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

// The input read as up to 8 sizes, then as many strides, through
// check_shape; what passes is checked again in wider arithmetic.
void check_shape_alone(const uint8_t* data, size_t size) {
  const size_t dims = std::min<size_t>(size / (2 * sizeof(int64_t)), 8);
  std::vector<int64_t> sizes(dims), strides(dims), shape;
  std::memcpy(sizes.data(), data, dims * sizeof(int64_t));
  std::memcpy(strides.data(), data + dims * sizeof(int64_t), dims * sizeof(int64_t));
  uint64_t numel = 0;
  try {
    numel = check_shape(0, sizes, strides, shape);
  } catch (const ProtocolError&) {
    return;
  }
  // (Every prefix product fits 64 bits once it passed, so 128 bits hold the whole.)
  unsigned __int128 product = 1;
  __int128 stride = 1;
  for (size_t d = dims; d-- > 0;) {
    if (sizes[d] < 0 || (sizes[d] != 1 && strides[d] != stride)) std::abort();
    product *= static_cast<uint64_t>(sizes[d]);
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  if (product != numel || shape != sizes) std::abort();
}

constexpr size_t kSegmentBytes = 1 << 20;
constexpr size_t kBlockBytes = 4096;

// The segment the shm-mode inputs may point into: blocks as a sender
// writes them (segments.h, 3.), rewritten fresh before every input.
int g_segment_fd = -1;
char* g_segment_base = nullptr;

char* segment_base(int* fd_out) {
  int& fd = g_segment_fd;
  char*& base = g_segment_base;
  if (!base) {
    fd = ::memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ::ftruncate(fd, kSegmentBytes) != 0 ||
        ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
      std::abort();
    }
    base = static_cast<char*>(
        ::mmap(nullptr, kSegmentBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    if (base == MAP_FAILED) std::abort();
  }
  *fd_out = fd;
  return base;
}

void fresh_blocks(char* base) {
  struct Header {
    uint32_t magic, state;
    uint64_t bytes;
  };
  for (size_t at = 0; at < kSegmentBytes; at += kBlockBytes) {
    Header h{0x42485354, 1, kBlockBytes - 64};
    std::memcpy(base + at, &h, sizeof(h));
  }
}

}  // namespace

// Unmaps and closes the shm-mode segment (the corpus replay test calls it
// so that nothing outlives the test; the fuzzer never needs to).
extern "C" void tandem_fuzz_release() {
  if (g_segment_base) ::munmap(g_segment_base, kSegmentBytes);
  if (g_segment_fd >= 0) ::close(g_segment_fd);
  g_segment_base = nullptr;
  g_segment_fd = -1;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t control = data[0];
  ++data;
  --size;
  check_shape_alone(data, size);
  const Limits limits = fuzz_limits();
  FrameDecoder dec(limits, /*handshake_frames=*/control % 3);
  std::unique_ptr<SegmentReader> shared;
  if (control & 0x40) {
    int fd = -1;
    fresh_blocks(segment_base(&fd));
    shared = std::make_unique<SegmentReader>(limits);
    shared->adopt(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    dec.set_shared_resolver([r = shared.get()](const SharedRef& ref, c10::ScalarType dtype,
                                               const std::vector<int64_t>& shape, uint64_t nbytes) {
      return r->tensor(ref, dtype, shape, nbytes);
    });
    dec.set_cuda_ipc(true);  // (handles reach the device check; only a GPU machine passes it)
  }
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
  req.values = {int64_t(1), 2.5, std::string("s"), c10::IValue(c10::List<int64_t>({1, 2, 3})),
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
  // The request with its tensors: the first in the shared segment's second
  // block, the others in the body.
  auto shared_bytes = [&] {
    OutFrame f = encode(tensors);
    SharedRef ref{0, 0, kBlockBytes + 64};
    std::vector<at::Tensor> body(f.tensors.begin() + 1, f.tensors.end());
    uint64_t offset = 0;
    for (const auto& t : body) offset += padding_before(offset) + t.nbytes();
    Preamble pre = f.preamble;
    pre.flags = kFlagSharedTensors;
    pre.table_bytes = sizeof(SharedRef);
    pre.body_bytes = offset;
    std::string out(reinterpret_cast<const char*>(&pre), sizeof(pre));
    out.append(reinterpret_cast<const char*>(&ref), sizeof(ref));
    out.append(f.envelope.bytes(), f.envelope.byte_size());
    offset = 0;
    for (const auto& t : body) {
      out.append(padding_before(offset), '\0');
      out.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
      offset += padding_before(offset) + t.nbytes();
    }
    return out;
  };
  write("handshake", 2 | (4 << 2), bytes(hello) + bytes(proof) + bytes(req));
  write("request", 0, bytes(req));
  write("tensors", 0x80, bytes(tensors));
  write("tensors_small_reads", 1 << 2, bytes(tensors));
  write("response_error", 0, bytes(resp) + bytes(err));
  write("shared_tensor", 0x40, shared_bytes());
  std::exit(0);
}
