// The RPC layer's CUDA work, in one place: how a CUDA tensor leaves for the
// wire, where a received one is read to, and how it reaches its device.
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

#include <memory>
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
