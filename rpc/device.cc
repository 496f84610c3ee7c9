// rpc/device.h: the CUDA paths where LibTorch has CUDA (TANDEM_WITH_CUDA),
// plain CPU code elsewhere. The CUDA half is also compiled against the CUDA
// headers on machines without a GPU (the tandem_cuda_check target), so it
// cannot rot unseen.
#include "tandem/rpc/device.h"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>

#if defined(TANDEM_WITH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <deque>
#include <map>
#include <mutex>
#endif

namespace tandem::rpc {

namespace testing {  // rpc/testing.h
namespace {
std::atomic<int> g_cuda_devices{-1};
}
void set_cuda_devices(int n) { g_cuda_devices.store(n); }
}  // namespace testing

namespace device {

int cuda_device_count() {
  const int faked = testing::g_cuda_devices.load();
  if (faked >= 0) return faked;
  return at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
}

at::Tensor host_buffer(at::IntArrayRef shape, c10::ScalarType dtype, c10::Device target) {
  auto options = at::TensorOptions().dtype(dtype);
#if defined(TANDEM_WITH_CUDA)
  if (target.is_cuda()) options = options.pinned_memory(true);
#else
  (void)target;
#endif
  return at::empty(shape, options);
}

#if defined(TANDEM_WITH_CUDA)

struct Staging::Impl {
  std::vector<c10::DeviceIndex> devices;  // those a copy was queued on
};

Staging::Staging() = default;  // made at the first CUDA tensor: most frames have none
Staging::~Staging() = default;  // pinned buffers are kept by the host allocator until copied

at::Tensor Staging::add(const at::Tensor& t) {
  if (!t.is_cuda()) return t;
  if (!impl_) impl_ = std::make_unique<Impl>();
  const c10::cuda::CUDAGuard guard(t.device());
  at::Tensor src = t.detach().resolve_conj().resolve_neg().contiguous();
  at::Tensor host = at::empty(
      src.sizes(), at::TensorOptions().dtype(src.scalar_type()).pinned_memory(true));
  host.copy_(src, /*non_blocking=*/true);  // on the device's current stream
  auto& d = impl_->devices;
  if (std::find(d.begin(), d.end(), t.device().index()) == d.end()) d.push_back(t.device().index());
  return host;
}

void Staging::done() {
  if (!impl_) return;
  for (c10::DeviceIndex d : impl_->devices) {
    at::cuda::CUDAEvent copied;
    copied.record(c10::cuda::getCurrentCUDAStream(d));
    copied.synchronize();  // these copies only: the device goes on with other work
  }
  impl_->devices.clear();
}

namespace {

// The agent's own stream on device `d`: non-blocking (no implicit order with
// the legacy default stream) and used for arrivals alone, so a copy never
// waits behind a collective or a handler's kernels, as it could on a stream
// of LibTorch's shared pool. Made once per device, kept for the process.
c10::cuda::CUDAStream arrival_stream(c10::DeviceIndex d) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(d);
  if (it != streams.end()) return it->second;
  const c10::cuda::CUDAGuard guard(d);
  cudaStream_t raw = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  return streams.emplace(d, c10::cuda::getStreamFromExternal(raw, d)).first->second;
}

}  // namespace

struct Arrival::Impl {
  struct Lane {
    explicit Lane(c10::Device d) : device(d), stream(arrival_stream(d.index())) {}
    c10::Device device;
    c10::cuda::CUDAStream stream;
    at::cuda::CUDAEvent done;
  };
  std::deque<Lane> lanes;  // a deque: a Lane (its event) never moves

  Lane& lane(c10::Device d) {
    for (auto& l : lanes) {
      if (l.device == d) return l;
    }
    return lanes.emplace_back(d);
  }
};

Arrival::Arrival() : impl_(std::make_unique<Impl>()) {}
Arrival::~Arrival() = default;

at::Tensor Arrival::place(const at::Tensor& host, c10::Device target) {
  if (!target.is_cuda()) return host.to(target);
  Impl::Lane& lane = impl_->lane(target);
  const c10::cuda::CUDAStreamGuard guard(lane.stream);  // sets the device too
  // From pinned memory (host_buffer), an asynchronous copy: the host
  // allocator keeps the buffer until the stream has read it. A tensor read
  // into a shared-memory segment is pageable and goes back to its sender
  // when the frame is done, so its copy must be complete on return.
  const bool pinned = host.is_pinned();
  at::Tensor placed = host.to(at::TensorOptions().device(target), /*non_blocking=*/pinned);
  // Its memory belongs to the arrival stream, but the default stream is
  // where it is used: the allocator must wait for that stream too before
  // reusing it.
  placed.record_stream(c10::cuda::getDefaultCUDAStream(target.index()));
  return placed;
}

void Arrival::seal() {
  for (auto& l : impl_->lanes) {
    l.done.record(l.stream);
    l.done.block(c10::cuda::getDefaultCUDAStream(l.device.index()));  // on the GPU
  }
}

void Arrival::wait() const {
  for (const auto& l : impl_->lanes) l.done.synchronize();
}

#else  // no CUDA: no CUDA tensor exists, and no frame may name a CUDA device
       // (but one with faked devices: placing there then fails, as it should)

struct Staging::Impl {};
Staging::Staging() = default;
Staging::~Staging() = default;
at::Tensor Staging::add(const at::Tensor& t) { return t.is_cpu() ? t : t.cpu(); }
void Staging::done() {}

struct Arrival::Impl {};
Arrival::Arrival() = default;
Arrival::~Arrival() = default;
at::Tensor Arrival::place(const at::Tensor& host, c10::Device target) { return host.to(target); }
void Arrival::seal() {}
void Arrival::wait() const {}

#endif

}  // namespace device
}  // namespace tandem::rpc
