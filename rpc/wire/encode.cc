// encode(): a Message becomes an OutFrame. The values become the
// envelope's value tree (rpc/wire/values.h); the tensors they hold become
// the frame's tensor table here: each travels once, contiguous, in host
// memory or (same host, CUDA) as an IPC handle, described by a TensorMeta
// the receiver checks (rpc/wire/checks.h) before it allocates anything.
#include "tandem/rpc/wire/device.h"
#include "tandem/rpc/wire/wire.h"

#include <ATen/ops/empty.h>
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/io.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <unordered_map>

#include "rpc/wire/wire.capnp.h"
#include "tandem/rpc/wire/checks.h"
#include "tandem/rpc/wire/values.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "Tandem's wire format is little-endian");

namespace tandem::rpc {
namespace {

// The frame's tensors as the value tree meets them: where each arrives,
// and what is written in the body (or sent as a CUDA IPC handle) for it.
class TensorTable final : public TensorSink {
 public:
  explicit TensorTable(const DeviceMap* map) : devices_map_(map) {}
  std::vector<at::Tensor> tensors;
  std::vector<at::Tensor> sources;         // the caller's tensor behind each wire tensor
  std::vector<c10::Device> devices;        // where the receiver places each
  device::Staging staging;                 // the CUDA tensors' copies to host memory
  std::shared_ptr<device::IpcExport> ipc;  // set where CUDA tensors may go by IPC
  bool snapshot = true;                    // IPC from a copy made now (answers, one-way messages)
  std::vector<std::optional<device::IpcRef>> ipc_refs;  // by tensor: those that do

  uint32_t tensor(const at::Tensor& t) override {
    // The same tensor passed twice travels once and arrives as one tensor.
    auto it = index_.find(t.unsafeGetTensorImpl());
    if (it != index_.end()) return it->second;
    if (t.layout() != c10::kStrided) {
      throw std::invalid_argument("cannot send a non-strided (sparse or mkldnn) tensor over RPC");
    }
    if (!known_dtype(static_cast<int>(t.scalar_type()))) {
      throw std::invalid_argument(std::string("cannot send a tensor of dtype ") +
                                  c10::toString(t.scalar_type()) + " over RPC");
    }
    const c10::Device to = target(t.device());
    auto idx = static_cast<uint32_t>(tensors.size());
    std::optional<device::IpcRef> ipc_ref;
    at::Tensor wire = t;
    if (!wire.device().is_cpu()) {
      // Same host: a handle to a copy in device memory (rpc/wire/device.h), its
      // place in the body an empty tensor. Else, or where the driver
      // refuses, staged through pinned host memory, all of the frame's
      // copies waited for at once.
      if (ipc) ipc_ref = ipc->add(wire, snapshot);
      wire =
          ipc_ref ? at::empty({0}, at::TensorOptions().dtype(t.scalar_type())) : staging.add(wire);
    }
    // (Each a dispatched op even where it has nothing to do: asked first.
    // contiguous() asks itself.)
    if (wire.is_conj()) wire = wire.resolve_conj();
    if (wire.is_neg()) wire = wire.resolve_neg();
    wire = wire.contiguous();
    index_.emplace(t.unsafeGetTensorImpl(), idx);
    devices.push_back(to);
    sources.push_back(t);
    tensors.push_back(std::move(wire));
    ipc_refs.push_back(std::move(ipc_ref));
    return idx;
  }

 private:
  std::unordered_map<const c10::TensorImpl*, uint32_t> index_;
  const DeviceMap* devices_map_;

  // Where a tensor on `d` arrives: CPU stays CPU; a CUDA device goes where
  // the device map says, and nowhere without one.
  c10::Device target(c10::Device d) const {
    if (d.is_cpu()) return d;
    const std::string to =
        devices_map_ && !devices_map_->peer.empty() ? " to " + devices_map_->peer : std::string();
    if (!d.is_cuda()) {
      throw std::invalid_argument("cannot send a tensor on " + d.str() + to +
                                  ": only CPU and CUDA tensors travel over RPC");
    }
    if (devices_map_) {
      auto it = devices_map_->cuda.find(d.index());
      if (it != devices_map_->cuda.end()) {
        return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(it->second));
      }
    }
    const std::string peer = to.empty() ? "<worker>" : devices_map_->peer;
    throw std::invalid_argument("cannot send a tensor on " + d.str() + to +
                                ": no device map says where " + d.str() +
                                "'s tensors go there (AgentOptions::set_device_map(\"" + peer +
                                "\", {{" + std::to_string(d.index()) +
                                ", <device there>}})); CUDA tensors are never moved to the "
                                "CPU unasked (call .cpu() to send it through host memory)");
  }
};

}  // namespace

std::string OutFrame::to_bytes() const {
  std::string out(reinterpret_cast<const char*>(&preamble), kPreambleBytes);
  out.append(envelope.bytes(), envelope.byte_size());
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    uint64_t pad = padding_before(offset);
    out.append(pad, '\0');
    out.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
    offset += pad + t.nbytes();
  }
  return out;
}

uint64_t OutFrame::total_bytes() const {
  return kPreambleBytes + envelope.byte_size() + preamble.body_bytes;
}

namespace {
capnp::Data::Reader as_data(const std::string& bytes) {
  return capnp::Data::Reader(reinterpret_cast<const kj::byte*>(bytes.data()), bytes.size());
}

constexpr size_t kFirstSegmentWords = 256;

OutFrame encode_unchecked(const Message& m, const Limits& limits, RRefHook* rrefs, int dest,
                          const DeviceMap* devices, bool cuda_ipc, std::vector<RRefDesc>& forks) {
  // The first segment on the stack (zeroed, as capnp needs): no allocation
  // per frame. 2 KiB holds a call's usual envelope; a larger one goes on in
  // segments capnp allocates (the frame carries them all).
  capnp::word first[kFirstSegmentWords] = {};
  capnp::MallocMessageBuilder builder(kj::arrayPtr(first, kFirstSegmentWords));
  auto env = builder.initRoot<schema::Envelope>();
  env.setId(m.id);
  env.setKind(static_cast<schema::Kind>(m.kind));
  TensorTable table(devices);
  ValueWriter writer(table, rrefs, dest, forks);
  if (cuda_ipc && (m.kind == MessageKind::kRequest || m.kind == MessageKind::kResponse)) {
    table.ipc = std::make_shared<device::IpcExport>();
    // A call's arguments are read where they are until it completes; an
    // answer's or a one-way message's sender cannot tell when that is.
    table.snapshot = !(m.kind == MessageKind::kRequest && m.id != 0);
  }
  switch (m.kind) {
    case MessageKind::kRequest:
      env.setCallee(m.callee);
      env.setTimeoutMs(m.timeout_ms);
      break;
    case MessageKind::kResponse:
      break;
    case MessageKind::kError: {
      auto e = env.initError();
      e.setCode(static_cast<schema::ErrorCode>(m.error_code));
      e.setWorker(m.error_worker);
      e.setMessage(m.error_message);
      break;
    }
    case MessageKind::kHello: {
      auto h = env.initHello();
      h.setWorker(m.hello_worker);
      h.setRank(m.hello_rank);
      h.setStep(m.hello_step);
      h.setNonce(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(m.hello_nonce.data()),
                                     m.hello_nonce.size()));
      h.setProof(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(m.hello_proof.data()),
                                     m.hello_proof.size()));
      break;
    }
  }
  if (m.kind == MessageKind::kRequest || m.kind == MessageKind::kResponse) {
    env.setAutogradContext(m.autograd_context);
    env.setAutogradMessage(m.autograd_message);
    if (!m.autograd_reach.empty()) {
      auto reach = env.initAutogradReach(m.autograd_reach.size());
      for (size_t i = 0; i < m.autograd_reach.size(); ++i) reach.set(i, m.autograd_reach[i]);
    }
  }
  if (!m.values.empty()) {
    auto vals = env.initValues(m.values.size());
    for (size_t i = 0; i < m.values.size(); ++i) writer.value(vals[i], m.values[i]);
  }
  table.staging.done();  // the body's bytes are read from the host copies
  OutFrame frame;
  if (table.ipc && table.ipc->size() > 0) {
    table.ipc->seal();  // the events the receiver's copies wait for
    static std::atomic<uint64_t> next_token{0};
    frame.ipc_token = ++next_token;
    frame.ipc = table.ipc;
    env.setIpcToken(frame.ipc_token);
  }
  uint64_t offset = 0;
  if (!table.tensors.empty()) {
    auto metas = env.initTensors(table.tensors.size());
    for (size_t i = 0; i < table.tensors.size(); ++i) {
      // A tensor that goes by IPC is described by its source (its place in
      // the body is empty).
      const std::optional<device::IpcRef>& ipc = table.ipc_refs[i];
      const at::Tensor& t = ipc ? table.sources[i] : table.tensors[i];
      auto meta = metas[i];
      meta.setDtype(static_cast<int16_t>(t.scalar_type()));
      auto sizes = meta.initSizes(t.dim());
      auto strides = meta.initStrides(t.dim());
      // Standard contiguous strides from the sizes: an empty tensor may be
      // "contiguous" with other strides, which the receiver would refuse.
      int64_t stride = 1;
      for (int64_t d = t.dim() - 1; d >= 0; --d) {
        sizes.set(d, t.size(d));
        strides.set(d, stride);
        stride *= std::max<int64_t>(t.size(d), 1);
      }
      auto dev = meta.initDevice();
      dev.setType(static_cast<int16_t>(table.devices[i].type()));
      dev.setIndex(table.devices[i].index());
      uint64_t nbytes = t.nbytes();
      meta.setByteLength(nbytes);
      if (table.sources[i].requires_grad()) {
        meta.setRequiresGrad(true);
        if (m.autograd_message != 0) frame.grad_sources.push_back(table.sources[i]);
      }
      if (ipc) {
        auto c = meta.initCudaIpc();
        c.setMemHandle(as_data(ipc->mem_handle));
        c.setAllocBytes(ipc->alloc_bytes);
        c.setOffset(ipc->offset);
        c.setEventHandle(as_data(table.ipc->event_handle(table.sources[i].device().index())));
        nbytes = 0;  // not in the body
      }
      offset += padding_before(offset) + nbytes;
    }
  }
  // Written straight into the frame's own words (rpc/message.h's Envelope):
  // the same one copy of the segments as capnp::messageToFlatArray.
  frame.envelope = Envelope(capnp::computeSerializedSizeInWords(builder));
  {
    kj::ArrayOutputStream out(kj::arrayPtr(reinterpret_cast<kj::byte*>(frame.envelope.words()),
                                           frame.envelope.byte_size()));
    capnp::writeMessage(out, builder);
  }
  const uint64_t envelope_bytes = frame.envelope.byte_size();
  if (envelope_bytes > limits.max_envelope_bytes) {
    throw std::invalid_argument("message envelope of " + std::to_string(envelope_bytes) +
                                " bytes exceeds the limit of " +
                                std::to_string(limits.max_envelope_bytes));
  }
  if (offset > limits.max_body_bytes) {
    throw std::invalid_argument("message tensors of " + std::to_string(offset) +
                                " bytes exceed the limit of " +
                                std::to_string(limits.max_body_bytes));
  }
  frame.preamble.envelope_bytes = static_cast<uint32_t>(frame.envelope.byte_size());
  frame.preamble.body_bytes = offset;
  frame.tensors = std::move(table.tensors);
  return frame;
}
}  // namespace

OutFrame encode(const Message& m, const Limits& limits, RRefHook* rrefs, int dest,
                const DeviceMap* devices, bool cuda_ipc) {
  std::vector<RRefDesc> forks;
  try {
    OutFrame frame = encode_unchecked(m, limits, rrefs, dest, devices, cuda_ipc, forks);
    frame.kind = m.kind;
    frame.forks = Forks(rrefs, std::move(forks));
    return frame;
  } catch (...) {
    Forks undo(rrefs, std::move(forks));  // nothing was sent
    throw;
  }
}

void Forks::abort() noexcept {
  if (!hook_ || forks_.empty()) return;
  try {
    hook_->abort_forks(forks_);
  } catch (...) {
    // The RRef context is shutting down: nothing is left to undo.
  }
  forks_.clear();
}

}  // namespace tandem::rpc
