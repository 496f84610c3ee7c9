// The value tree of a message (c10::IValue) and its Cap'n Proto form
// (rpc/wire/wire.capnp's Value and TypeDesc), both ways. Internal to the
// codec (it names the generated schema): encode.cc writes a message's values
// with a ValueWriter, decode.cc reads them with read_value().
//
// Tensors and RRefs are where a value tree meets the rest of the frame: a
// tensor is written as its index among the frame's tensors (the TensorSink
// decides how it travels), an RRef as the description of a fork made for
// the receiver; read back, a tensor index is checked against the frame's
// tensors and an RRef stands as a placeholder until fill_rrefs().
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <vector>

#include "rpc/wire/wire.capnp.h"
#include "tandem/rpc/rref_core.h"

namespace tandem::rpc {

// Where a ValueWriter puts the tensors it meets: returns each one's index
// among the frame's tensors.
class TensorSink {
 public:
  virtual uint32_t tensor(const at::Tensor& t) = 0;

 protected:
  ~TensorSink() = default;
};

class ValueWriter {
 public:
  // RRefs in the values are forked for worker `dest` through `hook`, each
  // fork listed in `forks` (so that a failure can undo them); without a
  // hook, a value holding an RRef is refused.
  ValueWriter(TensorSink& tensors, RRefHook* hook, int dest, std::vector<RRefDesc>& forks)
      : tensors_(tensors), hook_(hook), dest_(dest), forks_(forks) {}

  // Throws std::invalid_argument for a value that cannot travel (an
  // unsupported kind, nesting past kMaxValueDepth, an RRef Tandem did not make).
  void value(schema::Value::Builder b, const c10::IValue& v, int depth = 0);

 private:
  TensorSink& tensors_;
  RRefHook* hook_;
  int dest_;
  std::vector<RRefDesc>& forks_;
};

// A container's static type (List[int], Dict[str, Tensor] ...), so that an
// empty container arrives with its type.
void write_type(schema::TypeDesc::Builder b, const c10::TypePtr& t);

// The value `r` of a received envelope whose tensors are `tensors`; every
// RRef in it is appended to `rrefs` and stands in the value as a
// placeholder (fill_rrefs). Throws ProtocolError for what the checks refuse
// (rpc/wire/checks.h) and for kinds this version does not know.
c10::IValue read_value(schema::Value::Reader r, const std::vector<at::Tensor>& tensors,
                       std::vector<RRefDesc>& rrefs);

// A device as written in a value or a tensor's description (checked).
c10::Device read_device(schema::DeviceValue::Reader r);

}  // namespace tandem::rpc
