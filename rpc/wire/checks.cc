#include "tandem/rpc/wire/checks.h"

#include <capnp/common.h>

#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/wire/wire.h"

namespace tandem::rpc {

void protocol_error(const std::string& what) { throw ProtocolError(what); }

std::string tensor_prefix(size_t tensor) { return "tensor " + std::to_string(tensor) + ": "; }

bool known_dtype(int dtype) {
  switch (static_cast<c10::ScalarType>(dtype)) {
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Half:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexHalf:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
    case c10::ScalarType::Bool:
    case c10::ScalarType::BFloat16:
      return true;
    default:
      return false;
  }
}

// ---- the preamble --------------------------------------------------------

void check_preamble(const Preamble& p, const Limits& limits, bool handshake) {
  require(p.magic == kMagic, [] { return "bad magic in frame preamble"; });
  require(p.version == kVersion,
          [&] { return "unsupported wire version " + std::to_string(p.version); });
  require(p.envelope_bytes != 0 && p.envelope_bytes % sizeof(capnp::word) == 0 &&
              p.envelope_bytes <= limits.max_envelope_bytes,
          [&] {
            return "impossible envelope length " + std::to_string(p.envelope_bytes) + " (limit " +
                   std::to_string(limits.max_envelope_bytes) + ")";
          });
  require(!handshake || (p.envelope_bytes <= limits.max_handshake_bytes && p.body_bytes == 0), [&] {
    return "the first frame must be a handshake (envelope of at most " +
           std::to_string(limits.max_handshake_bytes) + " bytes, no tensors)";
  });
  require(p.body_bytes <= limits.max_body_bytes, [&] {
    return "tensor body of " + std::to_string(p.body_bytes) + " bytes exceeds the limit of " +
           std::to_string(limits.max_body_bytes);
  });
  require((p.flags & ~kFlagSharedTensors) == 0, [&] {
    return (p.flags & kFlagHeartbeat) ? std::string("a heartbeat with lengths or other flags")
                                      : "unknown frame flags " + std::to_string(p.flags);
  });
}

bool is_heartbeat(const Preamble& p) {
  return p.magic == kMagic && p.version == kVersion && p.flags == kFlagHeartbeat &&
         p.envelope_bytes == 0 && p.table_bytes == 0 && p.body_bytes == 0;
}

size_t check_table_length(const Preamble& p, bool carried, bool handshake) {
  if (!(p.flags & kFlagSharedTensors)) {
    require(p.table_bytes == 0, [&] {
      return "shared tensor table of " + std::to_string(p.table_bytes) + " bytes without its flag";
    });
    return 0;
  }
  require(carried, [] {
    return "frame names tensors in shared memory, which this connection does not carry";
  });
  require(!handshake, [] { return "the first frame must be a handshake"; });
  require(p.table_bytes != 0 && p.table_bytes % sizeof(SharedRef) == 0 &&
              p.table_bytes <= kMaxSharedRefs * sizeof(SharedRef),
          [&] {
            return "impossible shared tensor table of " + std::to_string(p.table_bytes) + " bytes";
          });
  return p.table_bytes / sizeof(SharedRef);
}

void check_table_order(const SharedRef* refs, size_t count) {
  for (size_t i = 1; i < count; ++i) {
    require(refs[i].tensor > refs[i - 1].tensor,
            [] { return "shared tensor table is not in ascending tensor order"; });
  }
}

void check_table_names(const std::vector<SharedRef>& table, size_t tensors) {
  require(table.empty() || table.back().tensor < tensors, [&] {
    return "shared tensor table names tensor " + std::to_string(table.back().tensor) + " of " +
           std::to_string(tensors);
  });
}

// ---- the envelope's header -----------------------------------------------

MessageKind check_kind(uint16_t kind, bool handshake) {
  require(kind <= static_cast<uint16_t>(MessageKind::kHello),
          [&] { return "unknown message kind " + std::to_string(kind); });
  require(!handshake || kind == static_cast<uint16_t>(MessageKind::kHello),
          [] { return "the first frame must be a handshake"; });
  return static_cast<MessageKind>(kind);
}

void check_autograd(uint64_t context, uint64_t message) {
  require(message == 0 || context != 0,
          [&] { return "autograd message " + std::to_string(message) + " outside any context"; });
}

void check_autograd_reach(size_t reach, uint64_t message) {
  require(reach == 0 || message != 0, [] { return "autograd reach without an autograd message"; });
}

ErrorCode check_error_code(uint16_t code) {
  require(code <= static_cast<uint16_t>(ErrorCode::kProtocol),
          [&] { return "unknown error code " + std::to_string(code); });
  return static_cast<ErrorCode>(code);
}

void check_hello(uint8_t step, size_t nonce_bytes, size_t proof_bytes) {
  require(
      nonce_bytes == (step == 3 ? 0 : kNonceBytes) && proof_bytes == (step == 1 ? 0 : kProofBytes),
      [&] {
        return "step " + std::to_string(step) + " with a nonce of " + std::to_string(nonce_bytes) +
               " and a proof of " + std::to_string(proof_bytes) + " bytes";
      });
  require(step >= 1 && step <= 3, [&] { return "unknown step " + std::to_string(step); });
}

// ---- a tensor's description ----------------------------------------------

c10::ScalarType check_dtype(size_t tensor, int dtype) {
  require(known_dtype(dtype),
          [&] { return tensor_prefix(tensor) + "unknown dtype " + std::to_string(dtype); });
  return static_cast<c10::ScalarType>(dtype);
}

uint64_t check_byte_length(size_t tensor, uint64_t numel, c10::ScalarType dtype,
                           uint64_t byte_length) {
  uint64_t nbytes = 0;
  require(!__builtin_mul_overflow(numel, static_cast<uint64_t>(c10::elementSize(dtype)), &nbytes) &&
              nbytes == byte_length,
          [&] {
            return tensor_prefix(tensor) + "byte length " + std::to_string(byte_length) +
                   " does not match its shape and dtype";
          });
  return nbytes;
}

c10::Device check_device_value(int type, int index) {
  require(type >= 0 && type < static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES) &&
              index >= -1 && index <= std::numeric_limits<c10::DeviceIndex>::max(),
          [&] {
            return "invalid device (type " + std::to_string(type) + ", index " +
                   std::to_string(index) + ") in envelope";
          });
  return c10::Device(static_cast<c10::DeviceType>(type), static_cast<c10::DeviceIndex>(index));
}

void check_tensor_device(size_t tensor, c10::Device device, int64_t cuda_devices) {
  require(
      device.is_cpu() || (device.is_cuda() && device.index() >= 0 && device.index() < cuda_devices),
      [&] {
        return tensor_prefix(tensor) + "is for " + device.str() +
               ", which this worker does not have (" + std::to_string(cuda_devices) +
               " CUDA device(s))";
      });
}

void check_requires_grad(size_t tensor, bool requires_grad, c10::ScalarType dtype) {
  require(!requires_grad || at::isFloatingType(dtype) || at::isComplexType(dtype), [&] {
    return tensor_prefix(tensor) + "requires grad but its dtype " + c10::toString(dtype) +
           " is not differentiable";
  });
}

// ---- a tensor's CUDA IPC placement ---------------------------------------

void check_ipc_allowed(size_t tensor, bool cuda_ipc, bool handshake, MessageKind kind) {
  require(cuda_ipc, [&] {
    return tensor_prefix(tensor) +
           "comes as a CUDA IPC handle, which this connection does not "
           "take (only same-host connections do)";
  });
  require(!handshake && (kind == MessageKind::kRequest || kind == MessageKind::kResponse), [&] {
    return tensor_prefix(tensor) + "comes as a CUDA IPC handle outside a request or answer";
  });
}

void check_ipc_tensor(size_t tensor, c10::Device device, bool shared, uint64_t nbytes) {
  require(device.is_cuda() && !shared && nbytes != 0, [&] {
    return tensor_prefix(tensor) + "comes as a CUDA IPC handle but is " +
           (shared        ? std::string("in shared memory too")
            : nbytes == 0 ? std::string("empty")
                          : "for " + device.str());
  });
}

void check_ipc_handles(size_t tensor, size_t mem_bytes, size_t event_bytes, size_t want_bytes) {
  require(mem_bytes == want_bytes && event_bytes == want_bytes, [&] {
    return tensor_prefix(tensor) + "CUDA IPC handles of " + std::to_string(mem_bytes) + " and " +
           std::to_string(event_bytes) + " bytes (want " + std::to_string(want_bytes) + ")";
  });
}

void check_ipc_range(size_t tensor, uint64_t offset, uint64_t nbytes, uint64_t alloc_bytes) {
  uint64_t end = 0;
  require(!__builtin_add_overflow(offset, nbytes, &end) && end <= alloc_bytes, [&] {
    return tensor_prefix(tensor) + "CUDA IPC bytes at " + std::to_string(offset) + "+" +
           std::to_string(nbytes) + " overrun the allocation of " + std::to_string(alloc_bytes) +
           " bytes";
  });
}

void check_ipc_total(size_t tensor, uint64_t nbytes, uint64_t max_body_bytes, uint64_t& total) {
  require(!__builtin_add_overflow(total, nbytes, &total) && total <= max_body_bytes, [&] {
    return tensor_prefix(tensor) + "CUDA IPC tensors exceed the limit of " +
           std::to_string(max_body_bytes) + " bytes";
  });
}

void check_ipc_token(bool any_ipc, uint64_t token) {
  require(!any_ipc || token != 0,
          [] { return "CUDA IPC tensors without a token to release them by"; });
}

// ---- the body's layout ---------------------------------------------------

void check_shared_tensor(size_t tensor, uint64_t nbytes) {
  require(nbytes != 0,
          [&] { return tensor_prefix(tensor) + "is empty but named in shared memory"; });
}

uint64_t check_body_place(uint64_t offset, uint64_t nbytes, uint64_t body_bytes) {
  offset += padding_before(offset);
  require(!__builtin_add_overflow(offset, nbytes, &offset) && offset <= body_bytes, [&] {
    return "tensors overrun the frame's body of " + std::to_string(body_bytes) + " bytes";
  });
  return offset;
}

void check_body_length(uint64_t need, uint64_t body_bytes) {
  require(need == body_bytes, [&] {
    return "frame body is " + std::to_string(body_bytes) + " bytes but its tensors need " +
           std::to_string(need);
  });
}

// ---- the value tree ------------------------------------------------------

void check_type_arity(size_t have, size_t want) {
  require(have == want, [] { return "malformed container type in envelope"; });
}

void check_tensor_index(uint32_t index, size_t tensors) {
  require(index < tensors, [&] {
    return "tensor index " + std::to_string(index) + " out of range (" + std::to_string(tensors) +
           " tensors in frame)";
  });
}

void check_dict_sizes(size_t keys, size_t values) {
  require(keys == values, [&] {
    return "dict with " + std::to_string(keys) + " keys and " + std::to_string(values) + " values";
  });
}

void check_dict_key(const c10::IValue& key) {
  require(key.isString() || key.isInt() || key.isDouble() || key.isBool() || key.isTensor() ||
              key.isDevice(),
          [&] { return "unhashable dict key of type " + key.tagKind(); });
}

void check_rref(const RRefDesc& d) {
  require(d.owner >= 0 && d.parent >= 0 && d.id.worker >= 0 && d.fork.worker >= 0,
          [] { return "RRef with a negative worker in envelope"; });
}

}  // namespace tandem::rpc
