// Shared-memory segments: how the shm backend moves a large tensor between
// two processes on one host with one copy.
//
//  1. The sender of each connection owns a small pool of segments: memfd
//     files (anonymous: nothing in /dev/shm, gone when the last process
//     holding one exits, also after a SIGKILL), sealed against shrinking so
//     that the receiver's mapping can never turn into SIGBUS, and mapped
//     once on each side. A segment's descriptor travels to the receiver once,
//     as SCM_RIGHTS beside the frame that first uses it.
//  2. Sending a tensor copies its bytes into a free block of the pool (the
//     one copy) and the frame carries (segment, offset) instead of the bytes
//     (wire.h, SharedRef). The receiver's tensor is that block itself
//     (at::from_blob over its mapping): nothing is copied on that side.
//  3. Every block starts behind a 64-byte header in the segment whose state
//     word the two sides hand back and forth: kSent (the sender wrote it),
//     kHeld (the receiver made a tensor of it: a second reference to the
//     same block is refused), kFree (the receiver's tensor died: the
//     sender may reuse it). The sender reclaims freed blocks at each
//     placement, lowest offsets first, so a steady stream reuses the same
//     warm pages.
//  4. A pool that is full (the receiver holds on to what it got), or that
//     could not make a segment, sends the bytes inline through the socket
//     instead: slower, never wrong. Why it could not is logged once.
//  5. Everything the receiver reads from a segment or a frame is checked:
//     the descriptor must be a sealed memfd of a bounded size, a reference
//     must name a known segment and an aligned block whose header says
//     kSent and whose bytes fit the segment. A violation is a ProtocolError
//     that closes the connection, as for TCP frames.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/rpc/wire/wire.h"

namespace tandem::rpc {

// Sender side of one connection. Not thread-safe: the connection's write
// lock guards it (placements and the descriptors they announce must be
// written in the same order).
class SegmentWriter {
 public:
  explicit SegmentWriter(const Limits& limits);
  ~SegmentWriter();
  SegmentWriter(const SegmentWriter&) = delete;
  SegmentWriter& operator=(const SegmentWriter&) = delete;

  // Copies `t` (contiguous, CPU, at least Limits::min_shared_tensor_bytes)
  // into a block and returns where it is; tensor index `index` of its frame.
  // A segment made for it appends its descriptor to `announce` (the caller
  // sends those with the frame). nullopt: send it inline.
  std::optional<SharedRef> place(const at::Tensor& t, uint32_t index, std::vector<int>& announce);
  // Why segments could not be made; empty while they can.
  const std::string& unavailable() const { return unavailable_; }

 private:
  struct Segment;
  bool grow(uint64_t need, std::vector<int>& announce);
  Limits limits_;
  std::vector<std::unique_ptr<Segment>> segments_;
  uint64_t mapped_bytes_ = 0;
  std::string unavailable_;
};

// Receiver side of one connection: the segments the peer announced, and the
// tensors made over them. Used by the transport thread only; the tensors
// it makes may die on any thread.
class SegmentReader {
 public:
  explicit SegmentReader(const Limits& limits) : limits_(limits) {}
  // Takes ownership of a descriptor received from the peer (closes it on
  // error). Throws ProtocolError for anything but a sealed memfd in bounds.
  void adopt(int fd);
  // The tensor over block `ref` (wire.h, SharedRef). Throws ProtocolError.
  at::Tensor tensor(const SharedRef& ref, c10::ScalarType dtype, const std::vector<int64_t>& shape,
                    uint64_t nbytes);
  size_t segments() const { return mappings_.size(); }

 private:
  struct Mapping;
  Limits limits_;
  std::vector<std::shared_ptr<Mapping>> mappings_;
  uint64_t mapped_bytes_ = 0;
};

namespace testing {
// Makes every SegmentWriter fail to create segments, and every same-host
// connection fail to make its ring (ring.h), with `why` (empty: normal
// again), as a machine that forbids memfd would.
void fail_shared_segments(const std::string& why);
// The reason set above; empty when none.
std::string shared_segments_failure();
}  // namespace testing

}  // namespace tandem::rpc
