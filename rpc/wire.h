// Tandem's frame format and its codec.
//
// A frame is:
//   1. a 24-byte little-endian preamble: magic "TNDM", version, envelope length
//      (a multiple of 8), and the length of the tensor body;
//   2. the envelope, a Cap'n Proto message (rpc/wire.capnp) holding the kind,
//      call id, callee, deadline, the value tree, and one TensorMeta per tensor;
//   3. the tensor body: each tensor's bytes, contiguous, starting at a 64-byte
//      aligned offset from the start of the body.
//
// encode() turns a Message into an OutFrame whose buffers point into the
// tensors' own storage (scatter-gather: the frame keeps the tensors alive).
// FrameDecoder is the receiving state machine: it validates every length and
// field before use, allocates each tensor with at::empty once the envelope has
// been checked, and can hand out the tensor's storage as the target of the next
// socket read so large tensors arrive with no copy in user space.
// Any violation throws ProtocolError; the caller closes that connection.
#pragma once

#include <ATen/core/ivalue.h>
#include <capnp/common.h>
#include <kj/array.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/rpc/errors.h"
#include "tandem/rpc/rref/impl.h"

namespace tandem::rpc {

namespace device {
class Arrival;  // rpc/device.h
class IpcExport;
}

enum class MessageKind : uint8_t { kRequest = 0, kResponse = 1, kError = 2, kHello = 3 };

struct Message {
  MessageKind kind = MessageKind::kRequest;
  uint64_t id = 0;
  std::string callee;       // request: the registered function's name
  uint64_t timeout_ms = 0;  // request: time left for the call; 0 = none
  std::vector<c10::IValue> values;  // request: arguments; response: one result
  // Received: every RRef in `values` as its sender described it, in frame
  // order. Until the agent puts its handles there (fill_rrefs), each stands
  // in `values` as a placeholder that is no usable RRef.
  std::vector<RRefDesc> rrefs;
  // Request and response: the autograd context (0 = none) and the id of the
  // recorded send (0 = none). Tensors that require grad travel flagged.
  // With autograd_message set the decoder lists them (in frame order) in
  // grad_tensors for the layer above to record; without it, they arrive as
  // new leaves that require grad (as in PyTorch).
  uint64_t autograd_context = 0;
  uint64_t autograd_message = 0;
  std::vector<uint64_t> autograd_reach;  // with autograd_message; opaque to rpc
  std::vector<at::Tensor> grad_tensors;
  // kError
  ErrorCode error_code = ErrorCode::kRemote;
  std::string error_worker;
  std::string error_message;
  // Received: the frame's size on the wire (preamble, envelope and body).
  uint64_t wire_bytes = 0;
  // Received: the copies of its tensors to the CUDA devices the sender's
  // device map named (rpc/device.h); null when every tensor is on the CPU.
  std::shared_ptr<device::Arrival> arrival;
  // Received: why its tensors could not be placed on the devices the
  // sender's map named (a CUDA error, such as out of memory); empty when
  // they were. The message then fails alone (the agent answers a request
  // with this error, or fails the call an answer was for); its connection
  // stays up.
  std::string arrival_error;
  // Received: nonzero when tensors came by CUDA IPC (rpc/device.h). Their
  // copies are done; the sender holds its buffers until this token is
  // released to it (the agent does so).
  uint64_t ipc_release = 0;
  // kHello: one step of the handshake (rpc/auth.h)
  std::string hello_worker;
  int32_t hello_rank = -1;
  uint8_t hello_step = 0;
  std::string hello_nonce;
  std::string hello_proof;
};

struct Limits {
  uint64_t max_envelope_bytes = 64ull << 20;
  uint64_t max_body_bytes = 16ull << 30;
  // Cap'n Proto reader limits: how deep a value tree may nest, and how many
  // words one envelope may make the reader visit.
  int nesting_limit = 64;
  uint64_t traversal_limit_words = 16ull << 20;
  // The handshake's frames come first: before they have been checked,
  // nothing larger is read and nothing is allocated for tensors.
  uint64_t max_handshake_bytes = 4096;
  // A connection whose handshake frames have not all come by then is closed;
  // at most this many accepted connections may be in their handshake at once.
  std::chrono::milliseconds handshake_timeout{5000};
  size_t max_handshaking_connections = 64;
  // Backpressure (rpc/transport/uv/uv_transport.h): past this many bytes of
  // answers to one peer waiting unwritten, what the peer sends is held;
  // past max_held_bytes held, its connection is not read until they drain.
  uint64_t max_queued_reply_bytes = 32ull << 20;
  uint64_t max_held_bytes = 32ull << 20;
  // Likewise past this many of a peer's requests handed on and not yet
  // answered (a flood of calls to a slow function would otherwise queue
  // without bound in the pool). Held messages include answers to our own
  // calls, so a bound this far above any real fan-out keeps handlers that
  // wait on the same peer from waiting on what is held.
  uint64_t max_unanswered_requests = 65536;
  // Shared memory (rpc/transport/shm/segments.h): tensors of at least this
  // many bytes travel through a segment instead of the socket; each side of
  // a connection maps at most max_shared_bytes in at most
  // max_shared_segments segments (0 bytes: never use segments).
  uint64_t min_shared_tensor_bytes = 32ull << 10;
  uint64_t max_shared_bytes = 1ull << 30;
  uint32_t max_shared_segments = 32;
  // Each direction of a same-host connection carries its frames (all but
  // the tensors in segments) through a ring of this many bytes, a power of
  // two (rpc/transport/shm/ring.h); 0: through the socket. A peer's ring
  // may be at most max_ring_bytes.
  uint64_t shm_ring_bytes = 512ull << 10;
  uint64_t max_ring_bytes = 64ull << 20;
  // Threads that spin waiting (an rpc_sync caller, an idle pool thread)
  // read their same-host connection themselves (rpc/transport.h, 8.).
  bool poll_while_spinning = true;
};

// How deep a value tree may nest (lists in lists ...): deeper values are
// refused by encode() and cannot pass the reader's nesting limit either.
constexpr int kMaxValueDepth = 16;

constexpr uint32_t kMagic = 0x4d444e54;  // "TNDM" read as little-endian
constexpr uint16_t kVersion = 2;  // 2: the token is proved, never sent (rpc/auth.h)
constexpr size_t kPreambleBytes = 24;
constexpr size_t kTensorAlignment = 64;

struct Preamble {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t flags = 0;
  uint32_t envelope_bytes = 0;
  uint32_t table_bytes = 0;  // with kFlagSharedTensors: the SharedRef table's length
  uint64_t body_bytes = 0;
};
static_assert(sizeof(Preamble) == kPreambleBytes, "preamble layout");

// Preamble flag: a table of SharedRefs follows the preamble (before the
// envelope); the tensors it names are in shared memory, not in the body.
// Only the shm backend writes it, and only its connections accept it.
constexpr uint16_t kFlagSharedTensors = 1;

// Where a tensor of a frame lies in shared memory (rpc/transport/shm/).
struct SharedRef {
  uint32_t tensor = 0;   // index among the frame's tensors (ascending in a table)
  uint32_t segment = 0;  // the sender's segment, numbered in announcement order
  uint64_t offset = 0;   // the tensor's first byte, 64-byte aligned, behind its block header
};
static_assert(sizeof(SharedRef) == 16, "shared ref layout");
constexpr size_t kMaxSharedRefs = 1 << 16;

// The RRef forks encoding a frame made (one per RRef it carries). Encoding
// forks before anything is sent, so a frame that is never written must undo
// them: a Forks undoes its forks when it is destroyed, unless commit() was
// called after the write succeeded. Move-only; the sender takes it out of
// the frame before handing the frame to the transport:
//   Forks forks = std::move(frame.forks);
//   conn->send(std::move(frame));   // throws: forks are undone
//   forks.commit();
class Forks {
 public:
  Forks() = default;
  Forks(RRefHook* hook, std::vector<RRefDesc> forks) : hook_(hook), forks_(std::move(forks)) {}
  ~Forks() { abort(); }
  Forks(Forks&& o) noexcept : hook_(o.hook_), forks_(std::move(o.forks_)) { o.forks_.clear(); }
  Forks& operator=(Forks&& o) noexcept {
    if (this != &o) {
      abort();
      hook_ = o.hook_;
      forks_ = std::move(o.forks_);
      o.forks_.clear();
    }
    return *this;
  }
  Forks(const Forks&) = delete;
  Forks& operator=(const Forks&) = delete;

  // The frame was written: the forks stand.
  void commit() { forks_.clear(); }
  const std::vector<RRefDesc>& list() const { return forks_; }
  bool empty() const { return forks_.empty(); }

 private:
  void abort() noexcept;
  RRefHook* hook_ = nullptr;
  std::vector<RRefDesc> forks_;
};

// A frame ready to be written: preamble, envelope, and the tensors whose
// storage the tensor body is read from. Holding an OutFrame keeps them alive.
struct OutFrame {
  MessageKind kind = MessageKind::kRequest;  // what it carries (not on the wire)
  Preamble preamble;
  kj::Array<capnp::word> envelope;
  std::vector<at::Tensor> tensors;  // contiguous, CPU
  // The RRef forks made for this frame, undone unless committed (see Forks).
  Forks forks;
  // With Message::autograd_message: the caller's tensors (not their wire
  // copies) that travel flagged as requiring grad, in frame order.
  std::vector<at::Tensor> grad_sources;
  // With tensors that go by CUDA IPC: their buffers, which the sender holds
  // until the receiver releases ipc_token (0: none).
  std::shared_ptr<device::IpcExport> ipc;
  uint64_t ipc_token = 0;
  uint64_t total_bytes() const;
  // The frame as one string of the bytes a socket carries (tests and tools;
  // the transport writes the pieces without joining them).
  std::string to_bytes() const;
};

// Where a frame's CUDA tensors go on the worker that receives it
// (AgentOptions::set_device_map): cuda:i here arrives on cuda:cuda.at(i)
// there. A CUDA tensor whose device it does not cover is refused, never
// moved to the CPU unasked.
struct DeviceMap {
  std::string peer;  // for errors
  std::map<int, int> cuda;
};

// Throws std::invalid_argument for values that cannot travel (an unsupported
// IValue kind, a sparse tensor, nesting past kMaxValueDepth, a frame over
// `limits`): the caller learns it at once instead of the peer refusing the frame.
// RRefs in the values are forked for worker `dest` through `rrefs`; without
// a hook, a message holding an RRef is refused.
// CUDA tensors travel only where `devices` maps their device; with
// `cuda_ipc` (the peer is another process on this host, on shared memory),
// as CUDA IPC handles where the driver allows, else through host memory.
OutFrame encode(const Message& message, const Limits& limits = Limits{},
                RRefHook* rrefs = nullptr, int dest = -1, const DeviceMap* devices = nullptr,
                bool cuda_ipc = false);

// Puts handles[i] where a received message's values hold the placeholder of
// its rrefs[i]. Throws std::logic_error unless every placeholder is filled.
void fill_rrefs(std::vector<c10::IValue>& values, const std::vector<RRefPtr>& handles);

// Number of zero bytes that precede a tensor starting at body offset `offset`.
inline uint64_t padding_before(uint64_t offset) {
  return (kTensorAlignment - offset % kTensorAlignment) % kTensorAlignment;
}

class FrameDecoder {
 public:
  // The first `handshake_frames` frames must be small kHellos (no tensors,
  // an envelope of at most Limits::max_handshake_bytes): an accepted
  // connection's peer writes two (steps 1 and 3 of rpc/auth.h), a dialed
  // one's one (step 2). Until then nothing large is read or allocated.
  explicit FrameDecoder(const Limits& limits, int handshake_frames = 0)
      : limits_(limits), handshake_frames_(handshake_frames) {}
  // Makes the tensor a frame's SharedRef names (checked; throws
  // ProtocolError). Without one, a frame with shared tensors is refused.
  using SharedResolver = std::function<at::Tensor(const SharedRef& ref, c10::ScalarType dtype,
                                                  const std::vector<int64_t>& shape,
                                                  uint64_t nbytes)>;
  void set_shared_resolver(SharedResolver resolve) { resolve_shared_ = std::move(resolve); }
  // Whether tensors may come as CUDA IPC handles (a same-host connection);
  // without it, a frame with one is refused.
  void set_cuda_ipc(bool allowed) { cuda_ipc_ = allowed; }
  // True while handshake frames are still expected.
  bool in_handshake() const { return handshake_frames_ > 0; }

  // Consumes `n` received bytes; completed messages queue up for take().
  void feed(const char* data, size_t n);

  // When the decoder is in the middle of a large tensor, the memory the next
  // read should land in (the tensor's own storage); otherwise {nullptr, 0}.
  std::pair<char*, size_t> direct_target(size_t min_bytes) const;
  // `n` bytes were read into the direct target.
  void direct_commit(size_t n);

  bool has_message() const { return !ready_.empty(); }
  Message take();
  // True between frames: no partial frame is buffered.
  bool idle() const { return state_ == State::kPreamble && have_ == 0; }

 private:
  enum class State { kPreamble, kTable, kEnvelope, kBody };
  void on_preamble();
  void on_table();
  void on_envelope();
  void advance_body();  // skips padding, moves to the next tensor, finishes the frame
  void finish();

  Limits limits_;
  int handshake_frames_;
  SharedResolver resolve_shared_;
  std::vector<SharedRef> table_;  // the current frame's, when it has one
  State state_ = State::kPreamble;
  std::array<char, kPreambleBytes> preamble_buf_{};
  Preamble preamble_;
  kj::Array<capnp::word> envelope_;
  size_t have_ = 0;  // bytes gathered for the current preamble or envelope

  Message pending_;
  std::vector<at::Tensor> tensors_;
  // The current frame's tensors that go to a CUDA device once read.
  std::vector<std::pair<at::Tensor, c10::Device>> placements_;
  // Those that come by CUDA IPC, each standing in the values as a
  // placeholder until it is copied (finish()).
  struct IpcPlacement {
    at::Tensor placeholder;
    std::string mem_handle;
    uint64_t offset = 0;
    std::string event_handle;
    c10::ScalarType dtype = c10::ScalarType::Float;
    std::vector<int64_t> shape;
    c10::Device device{c10::kCPU};
  };
  bool cuda_ipc_ = false;
  std::vector<IpcPlacement> ipc_placements_;
  uint64_t ipc_token_ = 0;  // the current frame's
  size_t tensor_index_ = 0;
  uint64_t tensor_done_ = 0;      // bytes of tensors_[tensor_index_] filled
  uint64_t padding_left_ = 0;     // padding bytes before the current tensor
  uint64_t body_offset_ = 0;      // bytes of the body consumed so far
  std::deque<Message> ready_;
};

}  // namespace tandem::rpc
