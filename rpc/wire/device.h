// The RPC layer's CUDA work, in one place: how a CUDA tensor leaves for the
// wire, where a received one is read to, and how it reaches its device.
//
// Between processes on one host (the shared-memory transport), CUDA tensors
// go as CUDA IPC handles and are copied device to device (IpcExport and
// Arrival::import, below). Elsewhere, through host memory:
//
// Sending: the tensor is copied into pinned host memory on its device's
// current stream (so after whatever the caller queued that produces it), and
// the sender waits for the frame's copies' events alone, never for the
// whole device (Staging).
//
// Receiving: a tensor whose frame says it goes to cuda:N is read from the
// connection into pinned host memory (host_buffer), then copied to cuda:N
// on the agent's own arrival stream of that device (an Arrival), a
// non-blocking stream made for this alone, so the copies never queue behind
// a collective or a handler's work. When the frame's copies are queued,
// the device's default stream is made to wait for them (an event, on the
// GPU: no host waits), so:
//   - a request's handler, which runs on the default stream, and whatever
//     later takes its arguments (a pipeline stage, the autograd engine, an
//     RRef's owner) see them complete;
//   - a response's future completes after the copies' events on the host
//     (wait()), so whoever takes the value may use it on any stream.
// A placed tensor's memory is also recorded as used by the default stream,
// so the allocator does not reuse it before work queued there is done.
//
// Where LibTorch has no CUDA all of this compiles to plain CPU code (no CUDA
// tensor can exist there, and the decoder refuses frames for CUDA devices).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tandem::rpc::device {

// How many CUDA devices this process has (rpc::testing::set_cuda_devices
// may say otherwise, on machines without a GPU).
int cuda_device_count();

// A frame's tensors on their way to host memory. add() returns a CPU
// tensor with `t`'s bytes: a CPU tensor as it is; for a CUDA tensor, a
// pinned host buffer whose copy is queued on the device's current stream
// (after whatever the sender queued that produces it). done() waits for
// every copy, with one event per device, never for the whole device; the
// host tensors may be read only after it.
class Staging {
 public:
  Staging();
  ~Staging();
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  at::Tensor add(const at::Tensor& t);
  void done();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// CUDA IPC, between processes on one host (the shared-memory transport):
// a CUDA tensor travels as a handle to device memory instead of its bytes.
//
// The sender exports the tensor's own memory (a call's arguments; a copy
// for answers, one-way messages and tensors that are not contiguous) and
// records an interprocess event on the device's current stream, after
// whatever produces it (IpcExport). It holds the memory until the receiver
// says it is done with it (a release, by the frame's token): so a call's
// tensor argument may not be changed in place until the call completes, as
// with PyTorch's RPC. The receiver has copied it by the time it answers.
//
// The receiver opens the handle (once per allocation, kept for the
// process), makes its arrival stream wait for the sender's event (on the GPU),
// and copies device to device into a tensor of its own (Arrival::import).
// It waits for those copies before releasing the buffers.
struct IpcRef {
  std::string mem_handle;    // cudaIpcMemHandle_t of the allocation holding the bytes
  uint64_t alloc_bytes = 0;  // the allocation's size
  uint64_t offset = 0;       // the bytes' start within it
  std::string event_handle;  // cudaIpcEventHandle_t recorded after the bytes were written
};
constexpr size_t kIpcHandleBytes = 64;  // both handles' size (CUDA_IPC_HANDLE_SIZE)

// A frame's CUDA tensors exported over IPC. add() returns the tensor's
// reference, or nullopt where the driver or the allocator refuses (such a
// tensor goes through host memory instead). With `snapshot`, the receiver
// reads a copy made now (on the current stream) rather than the tensor
// itself: for answers and one-way messages, whose senders cannot tell when
// they may change the tensor again (a handler that returns a parameter).
// A call's arguments go as they are, held until the call completes.
class IpcExport {
 public:
  IpcExport();
  ~IpcExport();
  IpcExport(const IpcExport&) = delete;
  IpcExport& operator=(const IpcExport&) = delete;
  std::optional<IpcRef> add(const at::Tensor& t, bool snapshot);
  // Records each device's event after its copies, on its current stream.
  void seal();
  // The event handle of cuda:`device` (after seal()).
  const std::string& event_handle(c10::DeviceIndex device) const;
  size_t size() const;  // the buffers held

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Counters of this process's CUDA IPC traffic (tests and metrics).
struct IpcStats {
  uint64_t exported = 0;  // tensors sent as handles
  uint64_t imported = 0;  // tensors received as handles
};
IpcStats ipc_stats();

// Host memory to read a received tensor bound for `target` into: pinned when
// `target` is a CUDA device, so that its copy there can run asynchronously.
at::Tensor host_buffer(at::IntArrayRef shape, c10::ScalarType dtype, c10::Device target);

// The copies of one received message's tensors to their devices.
class Arrival {
 public:
  Arrival();
  ~Arrival();
  Arrival(const Arrival&) = delete;
  Arrival& operator=(const Arrival&) = delete;

  // `host`'s copy on `target`, queued on the arrival stream there.
  at::Tensor place(const at::Tensor& host, c10::Device target);
  // The bytes `ref` names in a peer's device memory, copied into a new
  // tensor on `target` on the arrival stream there, after the peer's event.
  at::Tensor import(const IpcRef& ref, at::IntArrayRef shape, c10::ScalarType dtype,
                    c10::Device target);
  // After the last place(): marks the copies' end on each stream and makes
  // the devices' default streams wait for it.
  void seal();
  // Blocks until every copy is done (their events, not the devices).
  void wait() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::rpc::device
