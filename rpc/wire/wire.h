// Tandem's frame codec. The frame's layout and the Message it carries are
// in rpc/message.h; this is how one becomes the other.
//
// encode() turns a Message into an OutFrame whose buffers point into the
// tensors' own storage (scatter-gather: the frame keeps the tensors alive).
// FrameDecoder is the receiving state machine: it validates every length and
// field before use, allocates each tensor with at::empty once the envelope has
// been checked, and can hand out the tensor's storage as the target of the next
// socket read so large tensors arrive with no copy in user space.
// Any violation throws ProtocolError; the caller closes that connection.
//
// The codec's files: encode.cc (Message -> OutFrame), decode.cc
// (FrameDecoder), values.h (the value tree <-> its Cap'n Proto form) and
// checks.h (every check a received frame passes, each alone).
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
#include "tandem/rpc/limits.h"
#include "tandem/rpc/message.h"
#include "tandem/rpc/rref_core.h"

namespace tandem::rpc {

// How deep a value tree may nest (lists in lists ...): deeper values are
// refused by encode() and cannot pass the reader's nesting limit either.
constexpr int kMaxValueDepth = 16;

// Where a tensor of a frame lies in shared memory (rpc/transport/shm/).
struct SharedRef {
  uint32_t tensor = 0;   // index among the frame's tensors (ascending in a table)
  uint32_t segment = 0;  // the sender's segment, numbered in announcement order
  uint64_t offset = 0;   // the tensor's first byte, 64-byte aligned, behind its block header
};
static_assert(sizeof(SharedRef) == 16, "shared ref layout");
constexpr size_t kMaxSharedRefs = 1 << 16;

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
OutFrame encode(const Message& message, const Limits& limits = Limits{}, RRefHook* rrefs = nullptr,
                int dest = -1, const DeviceMap* devices = nullptr, bool cuda_ipc = false);

// Puts handles[i] where a received message's values hold the placeholder of
// its rrefs[i]. Throws std::logic_error unless every placeholder is filled.
void fill_rrefs(std::vector<c10::IValue>& values, const std::vector<RRefPtr>& handles);

// Number of zero bytes that precede a tensor starting at body offset `offset`.
inline uint64_t padding_before(uint64_t offset) {
  return (kTensorAlignment - offset % kTensorAlignment) % kTensorAlignment;
}

struct TensorPlan;  // a received tensor's checked description (decode.cc)

class FrameDecoder {
 public:
  // The first `handshake_frames` frames must be small kHellos (no tensors,
  // an envelope of at most Limits::max_handshake_bytes): an accepted
  // connection's peer writes two (steps 1 and 3 of rpc/common/auth.h), a dialed
  // one's one (step 2). Until then nothing large is read or allocated.
  explicit FrameDecoder(const Limits& limits, int handshake_frames = 0)
      : limits_(limits), handshake_frames_(handshake_frames) {}
  // Makes the tensor a frame's SharedRef names (checked; throws
  // ProtocolError). Without one, a frame with shared tensors is refused.
  using SharedResolver =
      std::function<at::Tensor(const SharedRef& ref, c10::ScalarType dtype,
                               const std::vector<int64_t>& shape, uint64_t nbytes)>;
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
  // Heartbeats dropped (rpc/message.h, kFlagHeartbeat).
  uint64_t heartbeats() const { return heartbeats_; }

 private:
  enum class State { kPreamble, kTable, kEnvelope, kBody };
  void on_preamble();
  void on_table();
  void on_envelope();
  // Allocates (or resolves, or stands in for) the planned tensors; returns
  // all of them, in frame order, for the values to index.
  std::vector<at::Tensor> make_tensors(std::vector<TensorPlan>& plans);
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
  uint64_t heartbeats_ = 0;

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
  uint64_t tensor_done_ = 0;   // bytes of tensors_[tensor_index_] filled
  uint64_t padding_left_ = 0;  // padding bytes before the current tensor
  uint64_t body_offset_ = 0;   // bytes of the body consumed so far
  std::deque<Message> ready_;
};

}  // namespace tandem::rpc
