// rpc/device.h: the CUDA paths where LibTorch has CUDA (TANDEM_WITH_CUDA),
// plain CPU code elsewhere. The CUDA half is also compiled against the CUDA
// headers on machines without a GPU (the tandem_cuda_check target), so it
// cannot rot unseen.
#include "tandem/rpc/device.h"

#include <ATen/ops/empty.h>

#include <algorithm>

#if defined(TANDEM_WITH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <deque>
#endif

namespace tandem::rpc::device {

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

bool cuda_compiled() { return true; }

at::Tensor stage_out(const at::Tensor& t) {
  if (!t.is_cuda()) return t;
  const c10::cuda::CUDAGuard guard(t.device());
  // The caller's stream on that device: the copy is queued after whatever
  // produced the tensor there.
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(t.device().index());
  at::Tensor src = t.detach().resolve_conj().resolve_neg().contiguous();
  at::Tensor host = at::empty(
      src.sizes(), at::TensorOptions().dtype(src.scalar_type()).pinned_memory(true));
  host.copy_(src, /*non_blocking=*/true);
  at::cuda::CUDAEvent copied;
  copied.record(stream);
  copied.synchronize();  // this copy only: the device may go on with other work
  return host;
}

struct Arrival::Impl {
  struct Lane {
    explicit Lane(c10::Device d)
        : device(d), stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, d.index())) {}
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
  // From pinned memory, an asynchronous copy; the host allocator keeps the
  // buffer until the stream has read it.
  at::Tensor placed = host.to(at::TensorOptions().device(target), /*non_blocking=*/true);
  // Its memory belongs to this pool stream; whoever takes it most likely
  // works on the device's default stream, so when it is freed the allocator
  // must also wait for what that stream has queued before reusing it.
  placed.record_stream(c10::cuda::getDefaultCUDAStream(target.index()));
  return placed;
}

void Arrival::seal() {
  for (auto& l : impl_->lanes) l.done.record(l.stream);
}

void Arrival::wait() const {
  for (const auto& l : impl_->lanes) l.done.synchronize();
}

bool Arrival::empty() const { return impl_->lanes.empty(); }

std::vector<c10::Device> Arrival::devices() const {
  std::vector<c10::Device> out;
  for (const auto& l : impl_->lanes) out.push_back(l.device);
  return out;
}

struct Arrival::Scope::Impl {
  explicit Impl(const std::vector<c10::cuda::CUDAStream>& streams) : guard(streams) {}
  c10::cuda::CUDAMultiStreamGuard guard;
};

Arrival::Scope::Scope(const Arrival* arrival) {
  if (!arrival || arrival->empty()) return;
  std::vector<c10::cuda::CUDAStream> streams;
  for (const auto& l : arrival->impl_->lanes) streams.push_back(l.stream);
  impl_ = std::make_unique<Impl>(streams);
}

Arrival::Scope::~Scope() = default;

#else  // no CUDA: no CUDA tensor exists, and no frame may name a CUDA device

bool cuda_compiled() { return false; }

at::Tensor stage_out(const at::Tensor& t) { return t.is_cpu() ? t : t.cpu(); }

struct Arrival::Impl {
  std::vector<c10::Device> devices;
};

Arrival::Arrival() : impl_(std::make_unique<Impl>()) {}
Arrival::~Arrival() = default;

at::Tensor Arrival::place(const at::Tensor& host, c10::Device target) {
  auto& d = impl_->devices;
  if (std::find(d.begin(), d.end(), target) == d.end()) d.push_back(target);
  return host.to(target);
}

void Arrival::seal() {}
void Arrival::wait() const {}
bool Arrival::empty() const { return impl_->devices.empty(); }
std::vector<c10::Device> Arrival::devices() const { return impl_->devices; }

struct Arrival::Scope::Impl {};
Arrival::Scope::Scope(const Arrival*) {}
Arrival::Scope::~Scope() = default;

#endif

}  // namespace tandem::rpc::device
