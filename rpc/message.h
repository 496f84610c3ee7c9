// Message: what the agent sends and receives, before encoding and after
// decoding; OutFrame: a message encoded and ready to be written.
//
// A frame on the wire is (rpc/wire/wire.h has the codec):
//   1. a 24-byte little-endian preamble: magic "TNDM", version, envelope length
//      (a multiple of 8), and the length of the tensor body;
//   2. the envelope, a Cap'n Proto message (rpc/wire/wire.capnp) holding the
//      kind, call id, callee, deadline, the value tree, and one TensorMeta per
//      tensor;
//   3. the tensor body: each tensor's bytes, contiguous, starting at a 64-byte
//      aligned offset from the start of the body.
// Layers above the RPC layer see messages through rpc/extension.h and
// transports see frames through rpc/transport.h; neither needs the codec, so
// this header holds no Cap'n Proto type: an encoded envelope is plain words.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/rpc/errors.h"
#include "tandem/rpc/rref_core.h"

namespace tandem::rpc {

namespace device {
class Arrival;  // rpc/wire/device.h
class IpcExport;
}  // namespace device

enum class MessageKind : uint8_t { kRequest = 0, kResponse = 1, kError = 2, kHello = 3 };

struct Message {
  MessageKind kind = MessageKind::kRequest;
  uint64_t id = 0;
  std::string callee;               // request: the registered function's name
  uint64_t timeout_ms = 0;          // request: time left for the call; 0 = none
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
  // device map named (rpc/wire/device.h); null when every tensor is on the CPU.
  std::shared_ptr<device::Arrival> arrival;
  // Received: why its tensors could not be placed on the devices the
  // sender's map named (a CUDA error, such as out of memory); empty when
  // they were. The message then fails alone (the agent answers a request
  // with this error, or fails the call an answer was for); its connection
  // stays up.
  std::string arrival_error;
  // Received: nonzero when tensors came by CUDA IPC (rpc/wire/device.h). Their
  // copies are done; the sender holds its buffers until this token is
  // released to it (the agent does so).
  uint64_t ipc_release = 0;
  // kHello: one step of the handshake (rpc/common/auth.h)
  std::string hello_worker;
  int32_t hello_rank = -1;
  uint8_t hello_step = 0;
  std::string hello_nonce;
  std::string hello_proof;
};

constexpr uint32_t kMagic = 0x4d444e54;  // "TNDM" read as little-endian
constexpr uint16_t kVersion = 2;         // 2: the token is proved, never sent (rpc/common/auth.h)
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
// Preamble flag: a heartbeat (rpc/transport.h, 9.), this flag alone with
// every length 0 and nothing after it. Decoders drop it in any state (the
// handshake's included); it only shows that the peer's transport thread
// runs.
constexpr uint16_t kFlagHeartbeat = 2;

// A frame's encoded envelope: the Cap'n Proto message as the 8-byte words
// it is written in (its own memory, aligned for a reader).
class Envelope {
 public:
  Envelope() = default;
  explicit Envelope(size_t words) : words_(words ? new uint64_t[words] : nullptr), size_(words) {}
  uint64_t* words() { return words_.get(); }
  const uint64_t* words() const { return words_.get(); }
  size_t size() const { return size_; }  // in words
  const char* bytes() const { return reinterpret_cast<const char*>(words_.get()); }
  size_t byte_size() const { return size_ * sizeof(uint64_t); }

 private:
  std::unique_ptr<uint64_t[]> words_;
  size_t size_ = 0;
};

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
  Envelope envelope;
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

}  // namespace tandem::rpc
