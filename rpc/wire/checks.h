// The checks a received frame passes before anything in it is used, one
// idea each: the preamble, the shared-memory table, the envelope's header
// fields, each tensor's description (dtype, shape, byte length, device), its
// CUDA IPC placement, the body's layout, the value tree's indices, and the
// handshake's fields. Each is a pure function of the fields it is given and
// the limits it is told, and throws ProtocolError with the text logs and
// tests match; so each can be tested and fuzzed alone, and FrameDecoder
// (rpc/wire/decode.cc) is the sequence that calls them in frame order.
// check_hello is the rule for a handshake step's fields, which the agent
// applies when a step arrives (the decoder knows nothing of steps).
//
// The good path allocates nothing: a message is built only when a check
// fails (require() below). Where a check names a tensor, it is by its index
// in the frame ("tensor 3: ...").
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tandem/rpc/errors.h"
#include "tandem/rpc/limits.h"
#include "tandem/rpc/message.h"
#include "tandem/rpc/rref_core.h"

namespace tandem::rpc {

struct SharedRef;  // rpc/wire/wire.h

// How many dimensions a received tensor may have.
constexpr size_t kMaxDims = 64;
// How large one dimension may be (a bound well past any real tensor, so
// that shape products are checked in plain 64-bit arithmetic).
constexpr int64_t kMaxDimSize = int64_t(1) << 48;

// Throws ProtocolError(what).
[[noreturn]] void protocol_error(const std::string& what);
// "tensor 3: ", the prefix of a check's message about the frame's tensor 3.
std::string tensor_prefix(size_t tensor);

// Throws ProtocolError(what()) unless `ok`; `what` is called only then, so
// a check that passes builds no message.
template <class What>
inline void require(bool ok, const What& what) {
  if (__builtin_expect(!ok, 0)) protocol_error(what());
}

// Whether `dtype` (a c10::ScalarType) may travel: the plain numeric types
// and bool; never a quantized or an unknown one. (The encoder asks too.)
bool known_dtype(int dtype);

// ---- the preamble --------------------------------------------------------

// Refuses a preamble with a wrong magic or version; an envelope length that
// is 0, not a whole number of words, or over limits.max_envelope_bytes;
// while `handshake`, an envelope over limits.max_handshake_bytes or any
// body; a body over limits.max_body_bytes; a flag this version does not know
// (the heartbeat's included: a heartbeat is taken by is_heartbeat() first).
void check_preamble(const Preamble& p, const Limits& limits, bool handshake);
// A heartbeat (rpc/message.h, kFlagHeartbeat): our magic and version, that
// flag alone and every length 0. The decoder drops it, in any state.
bool is_heartbeat(const Preamble& p);

// The number of SharedRefs in the table that follows the preamble (0: none).
// Refuses a table where the connection carries no shared memory
// (`carried`), during the handshake, of 0 bytes, not a whole number of
// entries, or of more than kMaxSharedRefs; and table bytes without the flag.
size_t check_table_length(const Preamble& p, bool carried, bool handshake);

// Refuses a table whose tensor indices do not strictly ascend.
void check_table_order(const SharedRef* refs, size_t count);

// Refuses an (ascending) table that names a tensor past the frame's `tensors`.
void check_table_names(const std::vector<SharedRef>& table, size_t tensors);

// ---- the envelope's header -----------------------------------------------

// The message kind `kind`; refuses one this version does not know, and any
// but kHello while `handshake`.
MessageKind check_kind(uint16_t kind, bool handshake);

// Refuses an autograd message id outside a context.
void check_autograd(uint64_t context, uint64_t message);

// Refuses an autograd reach list (`reach` entries) without an autograd message.
void check_autograd_reach(size_t reach, uint64_t message);

// The error code `code`; refuses one this version does not know.
ErrorCode check_error_code(uint16_t code);

// A handshake step's fields (rpc/common/auth.h): step 1 carries a nonce,
// step 2 a nonce and a proof, step 3 a proof. Refuses other sizes, then a
// step other than 1, 2 or 3.
void check_hello(uint8_t step, size_t nonce_bytes, size_t proof_bytes);

// ---- a tensor's description ----------------------------------------------

// The dtype `dtype`; refuses one known_dtype() does not know.
c10::ScalarType check_dtype(size_t tensor, int dtype);

// The number of elements of a tensor of `sizes` with `strides` (any two
// indexable lists of int64: Cap'n Proto readers, vectors), its sizes copied
// into `shape`. Refuses more than kMaxDims dimensions or strides of another
// count; a negative size or one over kMaxDimSize; a shape whose element
// count overflows; strides that are not the standard contiguous ones
// (ignoring dimensions of size 1).
template <class Ints>
uint64_t check_shape(size_t tensor, const Ints& sizes, const Ints& strides,
                     std::vector<int64_t>& shape);

// The byte length of `numel` elements of `dtype`; refuses a product that
// overflows or differs from the `byte_length` the sender wrote.
uint64_t check_byte_length(size_t tensor, uint64_t numel, c10::ScalarType dtype,
                           uint64_t byte_length);

// The device (`type`, `index`) as written in a value or a tensor's
// description; refuses a type c10 does not know, an index below -1 or past
// c10::DeviceIndex.
c10::Device check_device_value(int type, int index);

// Refuses a tensor for a device other than the CPU or one of this worker's
// `cuda_devices` CUDA devices.
void check_tensor_device(size_t tensor, c10::Device device, int64_t cuda_devices);

// Refuses a tensor that requires grad with a dtype that cannot (integral, bool).
void check_requires_grad(size_t tensor, bool requires_grad, c10::ScalarType dtype);

// ---- a tensor's CUDA IPC placement ---------------------------------------

// Refuses a CUDA IPC handle where the connection takes none (`cuda_ipc`:
// only same-host ones do), during the handshake, or in a message other
// than a request or an answer.
void check_ipc_allowed(size_t tensor, bool cuda_ipc, bool handshake, MessageKind kind);

// Refuses an IPC handle for a tensor not on a CUDA device, also named in
// the shared-memory table (`shared`), or empty (`nbytes` 0).
void check_ipc_tensor(size_t tensor, c10::Device device, bool shared, uint64_t nbytes);

// Refuses memory and event handles not of device::kIpcHandleBytes each.
void check_ipc_handles(size_t tensor, size_t mem_bytes, size_t event_bytes, size_t want_bytes);

// Refuses `nbytes` at `offset` that do not lie within the sender's
// allocation of `alloc_bytes`.
void check_ipc_range(size_t tensor, uint64_t offset, uint64_t nbytes, uint64_t alloc_bytes);

// Adds `nbytes` to the frame's IPC bytes `total`, which count against
// `max_body_bytes` as body bytes do; refuses a total over it.
void check_ipc_total(size_t tensor, uint64_t nbytes, uint64_t max_body_bytes, uint64_t& total);

// Refuses a frame with IPC tensors (`any_ipc`) but no token to release
// the sender's buffers by.
void check_ipc_token(bool any_ipc, uint64_t token);

// ---- the body's layout ---------------------------------------------------

// Refuses an empty tensor named in the shared-memory table.
void check_shared_tensor(size_t tensor, uint64_t nbytes);

// Where the body's next tensor of `nbytes` ends, after the body's first
// `offset` bytes and its alignment padding; refuses one that ends past the
// body's `body_bytes`.
uint64_t check_body_place(uint64_t offset, uint64_t nbytes, uint64_t body_bytes);

// Refuses a body of `body_bytes` whose tensors take `need` bytes.
void check_body_length(uint64_t need, uint64_t body_bytes);

// ---- the value tree ------------------------------------------------------

// Refuses a container type with `have` element types where it needs `want`.
void check_type_arity(size_t have, size_t want);

// Refuses a tensor index `index` past the frame's `tensors`.
void check_tensor_index(uint32_t index, size_t tensors);

// Refuses a dict with `keys` keys and another number of `values`.
void check_dict_sizes(size_t keys, size_t values);

// Refuses a dict key that is not a string, int, float, bool, tensor or device.
void check_dict_key(const c10::IValue& key);

// Refuses an RRef description with a negative worker.
void check_rref(const RRefDesc& d);

// ---- (template definitions) ----------------------------------------------

template <class Ints>
uint64_t check_shape(size_t tensor, const Ints& sizes, const Ints& strides,
                     std::vector<int64_t>& shape) {
  const size_t dims = sizes.size();
  require(dims <= kMaxDims && strides.size() == dims, [&] {
    return tensor_prefix(tensor) + "bad shape (" + std::to_string(dims) + " sizes, " +
           std::to_string(strides.size()) + " strides)";
  });
  shape.resize(dims);
  uint64_t numel = 1;
  for (size_t d = 0; d < dims; ++d) {
    const int64_t s = sizes[d];
    require(s >= 0, [&] { return tensor_prefix(tensor) + "negative size"; });
    require(s <= kMaxDimSize,
            [&] { return tensor_prefix(tensor) + "size " + std::to_string(s) + " too large"; });
    require(!__builtin_mul_overflow(numel, static_cast<uint64_t>(s), &numel),
            [&] { return tensor_prefix(tensor) + "shape product overflows"; });
    shape[d] = s;
  }
  int64_t expect = 1;
  for (size_t d = dims; d-- > 0;) {
    require(shape[d] == 1 || strides[d] == expect,
            [&] { return tensor_prefix(tensor) + "strides are not contiguous"; });
    require(!__builtin_mul_overflow(expect, shape[d] > 1 ? shape[d] : int64_t(1), &expect),
            [&] { return tensor_prefix(tensor) + "shape product overflows"; });
  }
  return numel;
}

}  // namespace tandem::rpc
