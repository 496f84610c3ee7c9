// rpc/wire/device.h: the CUDA paths where LibTorch has CUDA (TANDEM_WITH_CUDA),
// plain CPU code elsewhere. The CUDA half is also compiled against the CUDA
// headers on machines without a GPU (the tandem_cuda_check target), so it
// cannot rot unseen.
#include "tandem/rpc/wire/device.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>

#if defined(TANDEM_WITH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <deque>
#include <map>
#include <mutex>
#endif

namespace tandem::rpc {

namespace testing {  // rpc/agent/testing.h
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

namespace {
std::atomic<uint64_t> g_ipc_exported{0};
std::atomic<uint64_t> g_ipc_imported{0};
}  // namespace

IpcStats ipc_stats() {
  IpcStats s;
  s.exported = g_ipc_exported.load();
  s.imported = g_ipc_imported.load();
  return s;
}

at::Tensor host_buffer(at::IntArrayRef shape, c10::ScalarType dtype, c10::Device target) {
#if defined(TANDEM_WITH_CUDA)
  if (target.is_cuda()) return at::empty(shape, at::TensorOptions().dtype(dtype).pinned_memory(true));
#else
  (void)target;
#endif
  // A plain CPU tensor, made without a trip through the dispatcher (one per
  // received tensor, on the path of every call).
  return at::detail::empty_cpu(shape, dtype, /*pin_memory=*/false, c10::nullopt);
}

#if defined(TANDEM_WITH_CUDA)

struct Staging::Impl {
  std::vector<c10::DeviceIndex> devices;  // those a copy was queued on
};

Staging::Staging() = default;   // made at the first CUDA tensor: most frames have none
Staging::~Staging() = default;  // pinned buffers are kept by the host allocator until copied

at::Tensor Staging::add(const at::Tensor& t) {
  if (!t.is_cuda()) return t;
  if (!impl_) impl_ = std::make_unique<Impl>();
  const c10::cuda::CUDAGuard guard(t.device());
  at::Tensor src = t.detach().resolve_conj().resolve_neg().contiguous();
  at::Tensor host =
      at::empty(src.sizes(), at::TensorOptions().dtype(src.scalar_type()).pinned_memory(true));
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

namespace {

// What this process opened of its peers' handles, each once and kept for
// the process: a sender's allocator hands out the same allocations again
// and again, and its events come from a pool.
template <class T, class Open>
T open_once(std::map<std::string, T>& opened, const std::string& handle, c10::Device target,
            Open open) {
  static auto* mu = new std::mutex;
  std::lock_guard<std::mutex> lock(*mu);
  auto it = opened.find(handle);
  if (it == opened.end()) {
    const c10::cuda::CUDAGuard guard(target);
    it = opened.emplace(handle, open(handle)).first;
  }
  return it->second;
}

// The peer's allocation `handle` names, mapped here.
const char* peer_allocation(const std::string& handle, c10::Device target) {
  static auto* opened = new std::map<std::string, void*>;
  return static_cast<const char*>(open_once(*opened, handle, target, [](const std::string& b) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, b.data(), sizeof h);
    void* base = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess));
    return base;
  }));
}

// The peer's interprocess event `handle` names, opened here.
cudaEvent_t peer_event(const std::string& handle, c10::Device target) {
  static auto* opened = new std::map<std::string, cudaEvent_t>;
  return open_once(*opened, handle, target, [](const std::string& b) {
    cudaIpcEventHandle_t h;
    std::memcpy(&h, b.data(), sizeof h);
    cudaEvent_t e = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenEventHandle(&e, h));
    return e;
  });
}

}  // namespace

at::Tensor Arrival::import(const IpcRef& ref, at::IntArrayRef shape, c10::ScalarType dtype,
                           c10::Device target) {
  if (!target.is_cuda()) throw std::invalid_argument("a CUDA IPC tensor must go to a CUDA device");
  Impl::Lane& lane = impl_->lane(target);
  const c10::cuda::CUDAStreamGuard guard(lane.stream);
  const char* src = peer_allocation(ref.mem_handle, target);
  // Whatever the sender queued that produces the bytes comes first: its
  // event (the sender records it again only after this frame's release).
  const cudaEvent_t written = peer_event(ref.event_handle, target);
  C10_CUDA_CHECK(cudaStreamWaitEvent(lane.stream.stream(), written, 0));
  at::Tensor placed = at::empty(shape, at::TensorOptions().dtype(dtype).device(target));
  C10_CUDA_CHECK(cudaMemcpyAsync(placed.data_ptr(), src + ref.offset, placed.nbytes(),
                                 cudaMemcpyDeviceToDevice, lane.stream.stream()));
  placed.record_stream(c10::cuda::getDefaultCUDAStream(target.index()));
  ++g_ipc_imported;
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

struct IpcExport::Impl {
  struct Device {
    c10::DeviceIndex index = 0;
    cudaEvent_t event = nullptr;
    std::string handle;
  };
  std::vector<at::Tensor> buffers;  // what the receiver copies from, held until the release
  std::vector<Device> devices;

  // Interprocess events are slow to make and to open: each device's are
  // kept for the process and used again once a frame's receiver released
  // them, and a receiver opens each once (peer_event).
  // Kept for the life of the process (never destroyed: an IpcExport may
  // go back to it from a static's destructor at exit).
  static std::mutex& pool_mu() {
    static auto* mu = new std::mutex;
    return *mu;
  }
  static std::map<c10::DeviceIndex, std::vector<Device>>& pool() {
    static auto* p = new std::map<c10::DeviceIndex, std::vector<Device>>;
    return *p;
  }

  static Device take(c10::DeviceIndex index) {
    {
      std::lock_guard<std::mutex> lock(pool_mu());
      auto& free = pool()[index];
      if (!free.empty()) {
        Device d = std::move(free.back());
        free.pop_back();
        return d;
      }
    }
    Device d;
    d.index = index;
    const c10::cuda::CUDAGuard guard(index);
    C10_CUDA_CHECK(
        cudaEventCreateWithFlags(&d.event, cudaEventDisableTiming | cudaEventInterprocess));
    cudaIpcEventHandle_t h;
    C10_CUDA_CHECK(cudaIpcGetEventHandle(&h, d.event));
    d.handle.assign(reinterpret_cast<const char*>(&h), sizeof h);
    return d;
  }

  ~Impl() {
    std::lock_guard<std::mutex> lock(pool_mu());
    for (auto& d : devices) {
      if (d.event) pool()[d.index].push_back(std::move(d));
    }
  }
};

IpcExport::IpcExport() = default;  // made at the first CUDA tensor
IpcExport::~IpcExport() = default;

std::optional<IpcRef> IpcExport::add(const at::Tensor& t, bool snapshot) {
  if (!t.is_cuda() || t.nbytes() == 0) return std::nullopt;
  if (!impl_) impl_ = std::make_unique<Impl>();
  const c10::cuda::CUDAGuard guard(t.device());
  try {
    // The receiver copies straight from `buf`, whose memory is held until
    // the release: the tensor itself, or a copy made now on the current
    // stream (after whatever produces `t`).
    at::Tensor buf = t.detach().resolve_conj().resolve_neg();
    buf = snapshot ? buf.clone(at::MemoryFormat::Contiguous) : buf.contiguous();
    // The allocator knows its blocks by their first byte, which is the
    // storage's, not a view's.
    const char* storage = static_cast<const char*>(buf.storage().data_ptr().get());
    size_t base_size = 0;
    void* base =
        c10::cuda::CUDACachingAllocator::getBaseAllocation(const_cast<char*>(storage), &base_size);
    cudaIpcMemHandle_t h;
    if (base == nullptr || cudaIpcGetMemHandle(&h, base) != cudaSuccess) {
      (void)cudaGetLastError();  // (the allocator's memory cannot be shared: expandable segments)
      return std::nullopt;
    }
    IpcRef ref;
    ref.mem_handle.assign(reinterpret_cast<const char*>(&h), sizeof h);
    ref.alloc_bytes = base_size;
    ref.offset = static_cast<uint64_t>(static_cast<const char*>(buf.data_ptr()) -
                                       static_cast<const char*>(base));
    impl_->buffers.push_back(std::move(buf));
    auto& ds = impl_->devices;
    if (std::none_of(ds.begin(), ds.end(),
                     [&](const Impl::Device& d) { return d.index == t.device().index(); })) {
      ds.push_back(Impl::Device{t.device().index(), nullptr, {}});
    }
    ++g_ipc_exported;
    return ref;
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

void IpcExport::seal() {
  if (!impl_) return;
  for (auto& d : impl_->devices) {
    if (d.event) continue;
    Impl::Device taken = Impl::take(d.index);
    const c10::cuda::CUDAGuard guard(d.index);
    const cudaError_t recorded =
        cudaEventRecord(taken.event, c10::cuda::getCurrentCUDAStream(d.index).stream());
    d = std::move(taken);  // back to the pool with the rest, whatever happens
    C10_CUDA_CHECK(recorded);
  }
}

const std::string& IpcExport::event_handle(c10::DeviceIndex device) const {
  if (impl_) {
    for (const auto& d : impl_->devices) {
      if (d.index == device && d.event) return d.handle;
    }
  }
  throw std::logic_error("IpcExport: no event for cuda:" + std::to_string(device) +
                         " (seal() first)");
}

size_t IpcExport::size() const { return impl_ ? impl_->buffers.size() : 0; }

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
at::Tensor Arrival::import(const IpcRef&, at::IntArrayRef, c10::ScalarType, c10::Device target) {
  throw std::runtime_error("a tensor for " + target.str() +
                           " came by CUDA IPC, but this build "
                           "has no CUDA");
}
void Arrival::seal() {}
void Arrival::wait() const {}

struct IpcExport::Impl {};
IpcExport::IpcExport() = default;
IpcExport::~IpcExport() = default;
std::optional<IpcRef> IpcExport::add(const at::Tensor&, bool) { return std::nullopt; }
void IpcExport::seal() {}
const std::string& IpcExport::event_handle(c10::DeviceIndex device) const {
  throw std::logic_error("IpcExport: no event for cuda:" + std::to_string(device));
}
size_t IpcExport::size() const { return 0; }

#endif

}  // namespace device
}  // namespace tandem::rpc
