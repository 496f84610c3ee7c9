#include "tandem/rpc/wire/wire.h"
#include "tandem/rpc/wire/device.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>
#include <ATen/ops/empty.h>
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>
#include <kj/io.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <optional>
#include <unordered_map>

#include "rpc/wire/wire.capnp.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "Tandem's wire format is little-endian");

namespace tandem::rpc {
namespace {

constexpr size_t kMaxDims = 64;

bool known_dtype(int v) {
  switch (static_cast<c10::ScalarType>(v)) {
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

// ---- encoding ----------------------------------------------------------------

class Encoder {
 public:
  Encoder(RRefHook* hook, int dest, const DeviceMap* devices, std::vector<RRefDesc>& forks)
      : forks(forks), hook_(hook), dest_(dest), devices_map_(devices) {}
  std::vector<at::Tensor> tensors;
  std::vector<at::Tensor> sources;  // the caller's tensor behind each wire tensor
  std::vector<RRefDesc>& forks;  // every fork made, so a failure can undo them

  void type(schema::TypeDesc::Builder b, const c10::TypePtr& t) {
    using K = schema::TypeKind;
    switch (t->kind()) {
      case c10::TypeKind::NoneType: b.setKind(K::NONE); return;
      case c10::TypeKind::BoolType: b.setKind(K::BOOL); return;
      case c10::TypeKind::IntType: b.setKind(K::INT); return;
      case c10::TypeKind::FloatType: b.setKind(K::FLOAT); return;
      case c10::TypeKind::NumberType: b.setKind(K::NUMBER); return;
      case c10::TypeKind::StringType: b.setKind(K::STRING); return;
      case c10::TypeKind::TensorType: b.setKind(K::TENSOR); return;
      case c10::TypeKind::DeviceObjType: b.setKind(K::DEVICE); return;
      case c10::TypeKind::ListType:
      case c10::TypeKind::DictType:
      case c10::TypeKind::TupleType:
      case c10::TypeKind::OptionalType: {
        auto contained = t->containedTypes();
        b.setKind(t->kind() == c10::TypeKind::ListType   ? K::LIST
                  : t->kind() == c10::TypeKind::DictType ? K::DICT
                  : t->kind() == c10::TypeKind::TupleType ? K::TUPLE
                                                          : K::OPTIONAL);
        auto els = b.initElements(contained.size());
        for (size_t i = 0; i < contained.size(); ++i) type(els[i], contained[i]);
        return;
      }
      default: b.setKind(K::ANY); return;
    }
  }

  void value(schema::Value::Builder b, const c10::IValue& v, int depth = 0) {
    if (depth > kMaxValueDepth) {
      throw std::invalid_argument("value nested deeper than " + std::to_string(kMaxValueDepth) +
                                  " levels cannot be sent over RPC");
    }
    if (v.isNone()) {
      b.setNone();
    } else if (v.isBool()) {
      b.setBool(v.toBool());
    } else if (v.isInt()) {
      b.setInt(v.toInt());
    } else if (v.isDouble()) {
      b.setDouble(v.toDouble());
    } else if (v.isString()) {
      const std::string& s = v.toStringRef();
      b.setString(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(s.data()), s.size()));
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        b.setNone();
      } else {
        b.setTensor(tensor(t));
      }
    } else if (v.isList()) {
      auto list = v.toList();
      auto lb = b.initList();
      type(lb.initElementType(), list.elementType());
      auto items = lb.initItems(list.size());
      for (size_t i = 0; i < list.size(); ++i) value(items[i], list.get(i), depth + 1);
    } else if (v.isTuple()) {
      const auto& elems = v.toTupleRef().elements();
      auto items = b.initTuple(elems.size());
      for (size_t i = 0; i < elems.size(); ++i) value(items[i], elems[i], depth + 1);
    } else if (v.isGenericDict()) {
      auto dict = v.toGenericDict();
      auto db = b.initDict();
      type(db.initKeyType(), dict.keyType());
      type(db.initValueType(), dict.valueType());
      auto keys = db.initKeys(dict.size());
      auto vals = db.initValues(dict.size());
      size_t i = 0;
      for (const auto& kv : dict) {
        value(keys[i], kv.key(), depth + 1);
        value(vals[i], kv.value(), depth + 1);
        ++i;
      }
    } else if (v.isRRef()) {
      auto* impl = dynamic_cast<RRefImpl*>(v.toRRef().get());
      if (!impl) throw std::invalid_argument("cannot send an RRef that Tandem did not make");
      if (!hook_) throw std::invalid_argument("an RRef can only travel in an agent's message");
      RRefDesc d = hook_->fork_for_send(RRefPtr::reclaim_copy(impl), dest_);
      forks.push_back(d);
      auto r = b.initRref();
      r.setOwner(d.owner);
      r.setIdWorker(d.id.worker);
      r.setIdLocal(d.id.local);
      r.setForkWorker(d.fork.worker);
      r.setForkLocal(d.fork.local);
      r.setParent(d.parent);
    } else if (v.isDevice()) {
      auto d = b.initDevice();
      d.setType(static_cast<int16_t>(v.toDevice().type()));
      d.setIndex(v.toDevice().index());
    } else {
      throw std::invalid_argument("cannot send a value of type " + v.tagKind() +
                                  " over RPC (supported: None, bool, int, float, str, Tensor, "
                                  "list, tuple, dict, Device)");
    }
  }

 private:
  std::unordered_map<const c10::TensorImpl*, uint32_t> index_;
  RRefHook* hook_;
  int dest_;
  const DeviceMap* devices_map_;

  // Where a tensor on `d` arrives: CPU stays CPU; a CUDA device goes where
  // the device map says, and nowhere without one.
  c10::Device target(c10::Device d) const {
    if (d.is_cpu()) return d;
    const std::string to = devices_map_ && !devices_map_->peer.empty()
                               ? " to " + devices_map_->peer
                               : std::string();
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
    throw std::invalid_argument(
        "cannot send a tensor on " + d.str() + to + ": no device map says where " + d.str() +
        "'s tensors go there (AgentOptions::set_device_map(\"" + peer + "\", {{" +
        std::to_string(d.index()) + ", <device there>}})); CUDA tensors are never moved to the "
        "CPU unasked (call .cpu() to send it through host memory)");
  }

  uint32_t tensor(const at::Tensor& t) {
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
      wire = ipc_ref ? at::empty({0}, at::TensorOptions().dtype(t.scalar_type()))
                     : staging.add(wire);
    }
    wire = wire.resolve_conj().resolve_neg().contiguous();
    index_.emplace(t.unsafeGetTensorImpl(), idx);
    devices_.push_back(to);  // where the receiver places it
    sources.push_back(t);
    tensors.push_back(std::move(wire));
    ipc_refs.push_back(std::move(ipc_ref));
    return idx;
  }

 public:
  std::vector<c10::Device> devices_;
  device::Staging staging;  // the CUDA tensors' copies to host memory
  std::shared_ptr<device::IpcExport> ipc;  // set where CUDA tensors may go by IPC
  bool snapshot = true;  // IPC from a copy made now (answers, one-way messages)
  std::vector<std::optional<device::IpcRef>> ipc_refs;  // by tensor: those that do
};

// ---- decoding ----------------------------------------------------------------

c10::TypePtr decode_type(schema::TypeDesc::Reader r) {
  using K = schema::TypeKind;
  auto els = r.getElements();
  auto need = [&](size_t n) {
    if (els.size() != n) throw ProtocolError("malformed container type in envelope");
  };
  switch (r.getKind()) {
    case K::ANY: return c10::AnyType::get();
    case K::NONE: return c10::NoneType::get();
    case K::BOOL: return c10::BoolType::get();
    case K::INT: return c10::IntType::get();
    case K::FLOAT: return c10::FloatType::get();
    case K::NUMBER: return c10::NumberType::get();
    case K::STRING: return c10::StringType::get();
    case K::TENSOR: return c10::TensorType::get();
    case K::DEVICE: return c10::DeviceObjType::get();
    case K::LIST: need(1); return c10::ListType::create(decode_type(els[0]));
    case K::DICT: need(2); return c10::DictType::create(decode_type(els[0]), decode_type(els[1]));
    case K::OPTIONAL: need(1); return c10::OptionalType::create(decode_type(els[0]));
    case K::TUPLE: {
      std::vector<c10::TypePtr> items;
      for (auto e : els) items.push_back(decode_type(e));
      return c10::TupleType::create(std::move(items));
    }
  }
  throw ProtocolError("unknown type kind " + std::to_string(static_cast<int>(r.getKind())) +
                      " in envelope");
}

c10::Device decode_device(schema::DeviceValue::Reader r) {
  int type = r.getType();
  if (type < 0 || type >= static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES) ||
      r.getIndex() < -1 || r.getIndex() > std::numeric_limits<c10::DeviceIndex>::max()) {
    throw ProtocolError("invalid device (type " + std::to_string(type) + ", index " +
                        std::to_string(r.getIndex()) + ") in envelope");
  }
  return c10::Device(static_cast<c10::DeviceType>(type), static_cast<c10::DeviceIndex>(r.getIndex()));
}

// Where a received RRef stands in a decoded value until the agent puts the
// handle it made from the description there (fill_rrefs). Never seen outside.
class RRefSlot final : public c10::RRefInterface {
 public:
  RRefSlot(size_t index, int32_t owner) : index_(index), owner_(owner) {}
  size_t index() const { return index_; }
  c10::worker_id_t owner() const override { return static_cast<c10::worker_id_t>(owner_); }
  std::string ownerName() const override { return {}; }
  bool isOwner() const override { return false; }
  bool confirmedByOwner() const override { return false; }
  const c10::TypePtr type() const override { return c10::AnyType::get(); }

 private:
  size_t index_;
  int32_t owner_;
};

// Replaces every RRefSlot under `v` with its handle; returns how many.
size_t fill_slots(c10::IValue& v, const std::vector<RRefPtr>& handles) {
  if (v.isRRef()) {
    auto* slot = dynamic_cast<RRefSlot*>(v.toRRef().get());
    if (!slot) return 0;
    v = c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(handles.at(slot->index())));
    return 1;
  }
  size_t n = 0;
  if (v.isList()) {
    auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) {
      c10::IValue item = list.get(i);
      if (size_t k = fill_slots(item, handles)) {
        list.set(i, std::move(item));
        n += k;
      }
    }
  } else if (v.isTuple()) {
    auto& tuple = v.toTupleRef();
    for (size_t i = 0; i < tuple.elements().size(); ++i) {
      c10::IValue item = tuple.elements()[i];
      if (size_t k = fill_slots(item, handles)) {
        tuple.unsafeSetElement(i, std::move(item));
        n += k;
      }
    }
  } else if (v.isGenericDict()) {
    auto dict = v.toGenericDict();
    for (auto it = dict.begin(); it != dict.end(); ++it) {  // keys are never RRefs (see decode)
      c10::IValue item = it->value();
      if (size_t k = fill_slots(item, handles)) {
        it->setValue(std::move(item));
        n += k;
      }
    }
  }
  return n;
}

c10::IValue decode_value(schema::Value::Reader r, const std::vector<at::Tensor>& tensors,
                         std::vector<RRefDesc>& rrefs) {
  using V = schema::Value;
  switch (r.which()) {
    case V::NONE: return c10::IValue();
    case V::BOOL: return c10::IValue(r.getBool());
    case V::INT: return c10::IValue(static_cast<int64_t>(r.getInt()));
    case V::DOUBLE: return c10::IValue(r.getDouble());
    case V::STRING: {
      auto d = r.getString();
      return c10::IValue(std::string(reinterpret_cast<const char*>(d.begin()), d.size()));
    }
    case V::TENSOR: {
      uint32_t i = r.getTensor();
      if (i >= tensors.size()) {
        throw ProtocolError("tensor index " + std::to_string(i) + " out of range (" +
                            std::to_string(tensors.size()) + " tensors in frame)");
      }
      return c10::IValue(tensors[i]);
    }
    case V::LIST: {
      auto l = r.getList();
      c10::impl::GenericList list(decode_type(l.getElementType()));
      auto items = l.getItems();
      list.reserve(items.size());
      for (auto item : items) list.push_back(decode_value(item, tensors, rrefs));
      return c10::IValue(std::move(list));
    }
    case V::TUPLE: {
      auto tuple = r.getTuple();
      std::vector<c10::IValue> items;
      items.reserve(tuple.size());
      for (auto item : tuple) items.push_back(decode_value(item, tensors, rrefs));
      return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
    }
    case V::DICT: {
      auto d = r.getDict();
      // Each list once: every get*() follows its pointer again and counts
      // against the traversal limit (a dict of n entries read as 2n lists
      // would exceed it).
      auto keys = d.getKeys();
      auto values = d.getValues();
      if (keys.size() != values.size()) {
        throw ProtocolError("dict with " + std::to_string(keys.size()) + " keys and " +
                            std::to_string(values.size()) + " values");
      }
      c10::impl::GenericDict dict(decode_type(d.getKeyType()), decode_type(d.getValueType()));
      dict.reserve(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) {
        auto key = decode_value(keys[i], tensors, rrefs);
        if (!(key.isString() || key.isInt() || key.isDouble() || key.isBool() ||
              key.isTensor() || key.isDevice())) {
          throw ProtocolError("unhashable dict key of type " + key.tagKind());
        }
        dict.insert_or_assign(std::move(key), decode_value(values[i], tensors, rrefs));
      }
      return c10::IValue(std::move(dict));
    }
    case V::DEVICE: return c10::IValue(decode_device(r.getDevice()));
    case V::RREF: {
      auto x = r.getRref();
      RRefDesc d;
      d.owner = x.getOwner();
      d.id = {x.getIdWorker(), x.getIdLocal()};
      d.fork = {x.getForkWorker(), x.getForkLocal()};
      d.parent = x.getParent();
      if (d.owner < 0 || d.parent < 0 || d.id.worker < 0 || d.fork.worker < 0) {
        throw ProtocolError("RRef with a negative worker in envelope");
      }
      rrefs.push_back(d);
      return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(
          c10::make_intrusive<RRefSlot>(rrefs.size() - 1, d.owner)));
    }
  }
  throw ProtocolError("unknown value kind " + std::to_string(static_cast<int>(r.which())));
}

}  // namespace

void fill_rrefs(std::vector<c10::IValue>& values, const std::vector<RRefPtr>& handles) {
  size_t filled = 0;
  for (auto& v : values) filled += fill_slots(v, handles);
  if (filled != handles.size()) {
    throw std::logic_error("fill_rrefs: " + std::to_string(handles.size()) + " handles for " +
                           std::to_string(filled) + " RRefs in the message");
  }
}

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

OutFrame encode_unchecked(const Message& m, const Limits& limits, RRefHook* rrefs, int dest,
                          const DeviceMap* devices, bool cuda_ipc, std::vector<RRefDesc>& forks) {
  capnp::MallocMessageBuilder builder;
  auto env = builder.initRoot<schema::Envelope>();
  env.setId(m.id);
  env.setKind(static_cast<schema::Kind>(m.kind));
  Encoder enc(rrefs, dest, devices, forks);
  if (cuda_ipc && (m.kind == MessageKind::kRequest || m.kind == MessageKind::kResponse)) {
    enc.ipc = std::make_shared<device::IpcExport>();
    // A call's arguments are read where they are until it completes; an
    // answer's or a one-way message's sender cannot tell when that is.
    enc.snapshot = !(m.kind == MessageKind::kRequest && m.id != 0);
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
    for (size_t i = 0; i < m.values.size(); ++i) enc.value(vals[i], m.values[i]);
  }
  enc.staging.done();  // the body's bytes are read from the host copies
  OutFrame frame;
  if (enc.ipc && enc.ipc->size() > 0) {
    enc.ipc->seal();  // the events the receiver's copies wait for
    static std::atomic<uint64_t> next_token{0};
    frame.ipc_token = ++next_token;
    frame.ipc = enc.ipc;
    env.setIpcToken(frame.ipc_token);
  }
  uint64_t offset = 0;
  if (!enc.tensors.empty()) {
    auto metas = env.initTensors(enc.tensors.size());
    for (size_t i = 0; i < enc.tensors.size(); ++i) {
      // A tensor that goes by IPC is described by its source (its place in
      // the body is empty).
      const std::optional<device::IpcRef>& ipc = enc.ipc_refs[i];
      const at::Tensor& t = ipc ? enc.sources[i] : enc.tensors[i];
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
      dev.setType(static_cast<int16_t>(enc.devices_[i].type()));
      dev.setIndex(enc.devices_[i].index());
      uint64_t nbytes = t.nbytes();
      meta.setByteLength(nbytes);
      if (enc.sources[i].requires_grad()) {
        meta.setRequiresGrad(true);
        if (m.autograd_message != 0) frame.grad_sources.push_back(enc.sources[i]);
      }
      if (ipc) {
        auto c = meta.initCudaIpc();
        c.setMemHandle(as_data(ipc->mem_handle));
        c.setAllocBytes(ipc->alloc_bytes);
        c.setOffset(ipc->offset);
        c.setEventHandle(as_data(enc.ipc->event_handle(enc.sources[i].device().index())));
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
  frame.tensors = std::move(enc.tensors);
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


// ---- FrameDecoder ----------------------------------------------------------------

void FrameDecoder::feed(const char* data, size_t n) {
  while (n > 0) {
    size_t take = 0;
    switch (state_) {
      case State::kPreamble:
        take = std::min(n, kPreambleBytes - have_);
        std::memcpy(preamble_buf_.data() + have_, data, take);
        have_ += take;
        if (have_ == kPreambleBytes) on_preamble();
        break;
      case State::kTable: {
        auto* bytes = reinterpret_cast<char*>(table_.data());
        const size_t size = table_.size() * sizeof(SharedRef);
        take = std::min(n, size - have_);
        std::memcpy(bytes + have_, data, take);
        have_ += take;
        if (have_ == size) on_table();
        break;
      }
      case State::kEnvelope: {
        auto bytes = envelope_.asBytes();
        take = std::min(n, bytes.size() - have_);
        std::memcpy(bytes.begin() + have_, data, take);
        have_ += take;
        if (have_ == bytes.size()) on_envelope();
        break;
      }
      case State::kBody:
        if (padding_left_ > 0) {
          take = std::min<uint64_t>(n, padding_left_);
          padding_left_ -= take;
        } else {
          const at::Tensor& t = tensors_[tensor_index_];
          take = std::min<uint64_t>(n, t.nbytes() - tensor_done_);
          std::memcpy(static_cast<char*>(t.data_ptr()) + tensor_done_, data, take);
          tensor_done_ += take;
        }
        body_offset_ += take;
        advance_body();
        break;
    }
    data += take;
    n -= take;
  }
}

std::pair<char*, size_t> FrameDecoder::direct_target(size_t min_bytes) const {
  if (state_ != State::kBody || padding_left_ > 0 || tensor_index_ >= tensors_.size()) {
    return {nullptr, 0};
  }
  const at::Tensor& t = tensors_[tensor_index_];
  uint64_t left = t.nbytes() - tensor_done_;
  if (left < min_bytes) return {nullptr, 0};
  return {static_cast<char*>(t.data_ptr()) + tensor_done_, left};
}

void FrameDecoder::direct_commit(size_t n) {
  tensor_done_ += n;
  body_offset_ += n;
  advance_body();
}

Message FrameDecoder::take() {
  Message m = std::move(ready_.front());
  ready_.pop_front();
  return m;
}

void FrameDecoder::on_preamble() {
  std::memcpy(&preamble_, preamble_buf_.data(), kPreambleBytes);
  if (preamble_.magic != kMagic) throw ProtocolError("bad magic in frame preamble");
  if (preamble_.version != kVersion) {
    throw ProtocolError("unsupported wire version " + std::to_string(preamble_.version));
  }
  if (preamble_.envelope_bytes == 0 || preamble_.envelope_bytes % sizeof(capnp::word) != 0 ||
      preamble_.envelope_bytes > limits_.max_envelope_bytes) {
    throw ProtocolError("impossible envelope length " + std::to_string(preamble_.envelope_bytes) +
                        " (limit " + std::to_string(limits_.max_envelope_bytes) + ")");
  }
  if (handshake_frames_ > 0 &&
      (preamble_.envelope_bytes > limits_.max_handshake_bytes || preamble_.body_bytes != 0)) {
    throw ProtocolError("the first frame must be a handshake (envelope of at most " +
                        std::to_string(limits_.max_handshake_bytes) + " bytes, no tensors)");
  }
  if (preamble_.body_bytes > limits_.max_body_bytes) {
    throw ProtocolError("tensor body of " + std::to_string(preamble_.body_bytes) +
                        " bytes exceeds the limit of " + std::to_string(limits_.max_body_bytes));
  }
  if (preamble_.flags & ~kFlagSharedTensors) {
    throw ProtocolError("unknown frame flags " + std::to_string(preamble_.flags));
  }
  table_.clear();
  if (preamble_.flags & kFlagSharedTensors) {
    if (!resolve_shared_) {
      throw ProtocolError("frame names tensors in shared memory, which this connection does "
                          "not carry");
    }
    if (handshake_frames_ > 0) throw ProtocolError("the first frame must be a handshake");
    if (preamble_.table_bytes == 0 || preamble_.table_bytes % sizeof(SharedRef) != 0 ||
        preamble_.table_bytes > kMaxSharedRefs * sizeof(SharedRef)) {
      throw ProtocolError("impossible shared tensor table of " +
                          std::to_string(preamble_.table_bytes) + " bytes");
    }
    table_.resize(preamble_.table_bytes / sizeof(SharedRef));
  } else if (preamble_.table_bytes != 0) {
    throw ProtocolError("shared tensor table of " + std::to_string(preamble_.table_bytes) +
                        " bytes without its flag");
  }
  envelope_ = kj::heapArray<capnp::word>(preamble_.envelope_bytes / sizeof(capnp::word));
  have_ = 0;
  state_ = table_.empty() ? State::kEnvelope : State::kTable;
}

void FrameDecoder::on_table() {
  for (size_t i = 1; i < table_.size(); ++i) {
    if (table_[i].tensor <= table_[i - 1].tensor) {
      throw ProtocolError("shared tensor table is not in ascending tensor order");
    }
  }
  have_ = 0;
  state_ = State::kEnvelope;
}

void FrameDecoder::on_envelope() {
  pending_ = Message();
  tensors_.clear();
  placements_.clear();
  try {
    capnp::ReaderOptions opts;
    // A word may be visited more than once (lists of empty structs cost a
    // word each), but not much more: bound the work by the envelope's size.
    opts.traversalLimitInWords =
        std::min<uint64_t>(limits_.traversal_limit_words, envelope_.size() * 4 + 64);
    opts.nestingLimit = limits_.nesting_limit;
    capnp::FlatArrayMessageReader reader(envelope_.asPtr(), opts);
    auto env = reader.getRoot<schema::Envelope>();
    auto kind = static_cast<uint16_t>(env.getKind());
    if (kind > static_cast<uint16_t>(MessageKind::kHello)) {
      throw ProtocolError("unknown message kind " + std::to_string(kind));
    }
    pending_.kind = static_cast<MessageKind>(kind);
    if (handshake_frames_ > 0) {
      if (pending_.kind != MessageKind::kHello) {
        throw ProtocolError("the first frame must be a handshake");
      }
      --handshake_frames_;
    }
    pending_.id = env.getId();
    ipc_token_ = env.getIpcToken();
    if (pending_.kind == MessageKind::kRequest || pending_.kind == MessageKind::kResponse) {
      pending_.autograd_context = env.getAutogradContext();
      pending_.autograd_message = env.getAutogradMessage();
      if (pending_.autograd_message != 0 && pending_.autograd_context == 0) {
        throw ProtocolError("autograd message " + std::to_string(pending_.autograd_message) +
                            " outside any context");
      }
      auto reach = env.getAutogradReach();
      if (reach.size() > 0 && pending_.autograd_message == 0) {
        throw ProtocolError("autograd reach without an autograd message");
      }
      pending_.autograd_reach.reserve(reach.size());
      for (uint64_t r : reach) pending_.autograd_reach.push_back(r);
    }
    if (pending_.kind == MessageKind::kRequest) {
      pending_.callee = env.getCallee();
      pending_.timeout_ms = env.getTimeoutMs();
    } else if (pending_.kind == MessageKind::kError) {
      auto e = env.getError();
      auto code = static_cast<uint16_t>(e.getCode());
      if (code > static_cast<uint16_t>(ErrorCode::kProtocol)) {
        throw ProtocolError("unknown error code " + std::to_string(code));
      }
      pending_.error_code = static_cast<ErrorCode>(code);
      pending_.error_worker = e.getWorker();
      pending_.error_message = e.getMessage();
    } else if (pending_.kind == MessageKind::kHello) {
      auto h = env.getHello();
      pending_.hello_worker = h.getWorker();
      pending_.hello_rank = h.getRank();
      pending_.hello_step = h.getStep();
      auto nonce = h.getNonce();
      pending_.hello_nonce.assign(reinterpret_cast<const char*>(nonce.begin()), nonce.size());
      auto proof = h.getProof();
      pending_.hello_proof.assign(reinterpret_cast<const char*>(proof.begin()), proof.size());
    }

    // Check every tensor's description and the body length before allocating.
    uint64_t offset = 0;
    auto metas = env.getTensors();
    std::vector<std::pair<c10::ScalarType, std::vector<int64_t>>> shapes;
    shapes.reserve(metas.size());
    std::vector<c10::Device> devices;
    if (!table_.empty() && table_.back().tensor >= metas.size()) {
      throw ProtocolError("shared tensor table names tensor " +
                          std::to_string(table_.back().tensor) + " of " +
                          std::to_string(metas.size()));
    }
    std::vector<const SharedRef*> shared(metas.size(), nullptr);
    for (const auto& ref : table_) shared[ref.tensor] = &ref;
    std::vector<std::optional<IpcPlacement>> ipc(metas.size());
    uint64_t ipc_bytes = 0;  // (counted against max_body_bytes, as body bytes are)
    for (size_t i = 0; i < metas.size(); ++i) {
      auto meta = metas[i];
      const std::string which = "tensor " + std::to_string(i) + ": ";
      if (!known_dtype(meta.getDtype())) {
        throw ProtocolError(which + "unknown dtype " + std::to_string(meta.getDtype()));
      }
      auto dtype = static_cast<c10::ScalarType>(meta.getDtype());
      auto sizes = meta.getSizes();
      auto strides = meta.getStrides();
      if (sizes.size() > kMaxDims || strides.size() != sizes.size()) {
        throw ProtocolError(which + "bad shape (" + std::to_string(sizes.size()) + " sizes, " +
                            std::to_string(strides.size()) + " strides)");
      }
      uint64_t numel = 1;
      std::vector<int64_t> shape(sizes.size());
      for (size_t d = 0; d < sizes.size(); ++d) {
        int64_t s = sizes[d];
        if (s < 0) throw ProtocolError(which + "negative size");
        if (s > (int64_t(1) << 48)) throw ProtocolError(which + "size " + std::to_string(s) + " too large");
        if (__builtin_mul_overflow(numel, static_cast<uint64_t>(s), &numel)) {
          throw ProtocolError(which + "shape product overflows");
        }
        shape[d] = s;
      }
      int64_t expect = 1;
      for (size_t d = sizes.size(); d-- > 0;) {
        if (sizes[d] != 1 && strides[d] != expect) {
          throw ProtocolError(which + "strides are not contiguous");
        }
        if (__builtin_mul_overflow(expect, std::max<int64_t>(sizes[d], 1), &expect)) {
          throw ProtocolError(which + "shape product overflows");
        }
      }
      uint64_t nbytes = 0;
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(c10::elementSize(dtype)), &nbytes) ||
          nbytes != meta.getByteLength()) {
        throw ProtocolError(which + "byte length " + std::to_string(meta.getByteLength()) +
                            " does not match its shape and dtype");
      }
      const c10::Device device = decode_device(meta.getDevice());
      if (!device.is_cpu()) {
        const int64_t have = device::cuda_device_count();
        if (!device.is_cuda() || device.index() < 0 || device.index() >= have) {
          throw ProtocolError(which + "is for " + device.str() + ", which this worker does not "
                              "have (" + std::to_string(have) + " CUDA device(s))");
        }
      }
      devices.push_back(device);
      if (meta.getRequiresGrad() && !at::isFloatingType(dtype) && !at::isComplexType(dtype)) {
        throw ProtocolError(which + "requires grad but its dtype " + c10::toString(dtype) +
                            " is not differentiable");
      }
      if (meta.hasCudaIpc()) {
        if (!cuda_ipc_) {
          throw ProtocolError(which + "comes as a CUDA IPC handle, which this connection does "
                              "not take (only same-host connections do)");
        }
        if (in_handshake() || (pending_.kind != MessageKind::kRequest &&
                               pending_.kind != MessageKind::kResponse)) {
          throw ProtocolError(which + "comes as a CUDA IPC handle outside a request or answer");
        }
        if (!device.is_cuda() || shared[i] || nbytes == 0) {
          throw ProtocolError(which + "comes as a CUDA IPC handle but is " +
                              (shared[i] ? std::string("in shared memory too")
                               : nbytes == 0 ? std::string("empty")
                                             : "for " + device.str()));
        }
        auto c = meta.getCudaIpc();
        auto mem = c.getMemHandle();
        auto event = c.getEventHandle();
        if (mem.size() != device::kIpcHandleBytes || event.size() != device::kIpcHandleBytes) {
          throw ProtocolError(which + "CUDA IPC handles of " + std::to_string(mem.size()) +
                              " and " + std::to_string(event.size()) + " bytes (want " +
                              std::to_string(device::kIpcHandleBytes) + ")");
        }
        uint64_t end = 0;
        if (__builtin_add_overflow(c.getOffset(), nbytes, &end) || end > c.getAllocBytes()) {
          throw ProtocolError(which + "CUDA IPC bytes at " + std::to_string(c.getOffset()) +
                              "+" + std::to_string(nbytes) + " overrun the allocation of " +
                              std::to_string(c.getAllocBytes()) + " bytes");
        }
        if (__builtin_add_overflow(ipc_bytes, nbytes, &ipc_bytes) ||
            ipc_bytes > limits_.max_body_bytes) {
          throw ProtocolError(which + "CUDA IPC tensors exceed the limit of " +
                              std::to_string(limits_.max_body_bytes) + " bytes");
        }
        IpcPlacement p;
        p.mem_handle.assign(reinterpret_cast<const char*>(mem.begin()), mem.size());
        p.offset = c.getOffset();
        p.event_handle.assign(reinterpret_cast<const char*>(event.begin()), event.size());
        p.dtype = dtype;
        p.shape = shape;
        p.device = device;
        ipc[i] = std::move(p);
        nbytes = 0;  // its place in the body is empty
      }
      if (shared[i]) {
        if (nbytes == 0) throw ProtocolError(which + "is empty but named in shared memory");
        shapes.emplace_back(dtype, std::move(shape));
        continue;  // not in the body
      }
      offset += padding_before(offset);
      if (__builtin_add_overflow(offset, nbytes, &offset) || offset > preamble_.body_bytes) {
        throw ProtocolError("tensors overrun the frame's body of " +
                            std::to_string(preamble_.body_bytes) + " bytes");
      }
      shapes.emplace_back(dtype, std::move(shape));
    }
    if (offset != preamble_.body_bytes) {
      throw ProtocolError("frame body is " + std::to_string(preamble_.body_bytes) +
                          " bytes but its tensors need " + std::to_string(offset));
    }
    if (std::any_of(ipc.begin(), ipc.end(), [](const auto& p) { return p.has_value(); }) &&
        ipc_token_ == 0) {
      throw ProtocolError("CUDA IPC tensors without a token to release them by");
    }
    // tensors_ are the ones still to be read from the body; all of them,
    // with those in shared memory, are what the values index.
    std::vector<at::Tensor> all;
    all.reserve(shapes.size());
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (shared[i]) {
        all.push_back(resolve_shared_(*shared[i], shapes[i].first, shapes[i].second,
                                      metas[i].getByteLength()));
      } else if (ipc[i]) {
        // A placeholder in the values until finish() copies it; an empty
        // tensor in the body.
        ipc[i]->placeholder = at::empty({0}, at::TensorOptions().dtype(shapes[i].first));
        all.push_back(ipc[i]->placeholder);
        tensors_.push_back(at::empty({0}, at::TensorOptions().dtype(shapes[i].first)));
        ipc_placements_.push_back(std::move(*ipc[i]));
      } else {
        all.push_back(device::host_buffer(shapes[i].second, shapes[i].first, devices[i]));
        tensors_.push_back(all.back());
      }
      if (!devices[i].is_cpu() && !ipc[i]) placements_.emplace_back(all.back(), devices[i]);
      if (metas[i].getRequiresGrad()) {
        if (pending_.autograd_message != 0) {
          pending_.grad_tensors.push_back(all.back());  // the layer above records it
        } else {
          all.back().set_requires_grad(true);  // a new leaf, as in PyTorch
        }
      }
    }
    auto values = env.getValues();
    pending_.values.reserve(values.size());
    for (auto v : values) pending_.values.push_back(decode_value(v, all, pending_.rrefs));
  } catch (const kj::Exception& e) {
    throw ProtocolError(std::string("malformed envelope: ") + e.getDescription().cStr());
  }
  envelope_ = nullptr;
  state_ = State::kBody;
  tensor_index_ = 0;
  tensor_done_ = 0;
  padding_left_ = 0;
  body_offset_ = 0;
  advance_body();
}

void FrameDecoder::advance_body() {
  while (tensor_index_ < tensors_.size()) {
    if (padding_left_ > 0) return;
    if (tensor_done_ < tensors_[tensor_index_].nbytes()) return;
    ++tensor_index_;
    tensor_done_ = 0;
    if (tensor_index_ < tensors_.size()) padding_left_ = padding_before(body_offset_);
  }
  finish();
}

namespace {
using Placed = std::unordered_map<const c10::TensorImpl*, at::Tensor>;

// `v` with every tensor in `placed` replaced by its placed copy (lists in
// place: the decoder made them).
c10::IValue with_placed(const c10::IValue& v, const Placed& placed) {
  if (v.isTensor()) {
    auto it = placed.find(v.toTensor().unsafeGetTensorImpl());
    return it == placed.end() ? v : c10::IValue(it->second);
  }
  if (v.isList()) {
    auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) list.set(i, with_placed(list.get(i), placed));
    return v;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elems;
    for (const auto& e : v.toTupleRef().elements()) elems.push_back(with_placed(e, placed));
    return c10::ivalue::Tuple::create(std::move(elems));
  }
  if (v.isGenericDict()) {
    auto dict = v.toGenericDict();
    for (auto it = dict.begin(); it != dict.end(); ++it) {
      it->setValue(with_placed(it->value(), placed));
    }
    return v;
  }
  return v;
}
}  // namespace

void FrameDecoder::finish() {
  if (!placements_.empty() || !ipc_placements_.empty()) {
    // The device map's target: a copy from the (pinned) host tensor the body
    // was read into, or from the sender's device memory (CUDA IPC), queued
    // on a stream of the target device (rpc/wire/device.h).
    auto arrival = std::make_shared<device::Arrival>();
    Placed placed;
    try {
      for (auto& [host, device] : placements_) {
        at::Tensor t = arrival->place(host.detach(), device);
        if (host.requires_grad()) t.set_requires_grad(true);
        placed.emplace(host.unsafeGetTensorImpl(), std::move(t));
      }
      for (auto& p : ipc_placements_) {
        device::IpcRef ref;
        ref.mem_handle = p.mem_handle;
        ref.offset = p.offset;
        ref.event_handle = p.event_handle;
        at::Tensor t = arrival->import(ref, p.shape, p.dtype, p.device);
        if (p.placeholder.requires_grad()) t.set_requires_grad(true);
        placed.emplace(p.placeholder.unsafeGetTensorImpl(), std::move(t));
      }
      arrival->seal();
    } catch (const std::exception& e) {
      // Not the peer's fault, and no reason to drop the connection: this
      // message fails alone (its values stay as read, for its RRefs).
      pending_.arrival_error = e.what();
      placed.clear();
    }
    if (!ipc_placements_.empty()) {
      // The sender's buffers go back to it (the agent releases the token)
      // once the copies from them are done; where that cannot be told (a
      // CUDA error), the sender keeps them until the connection closes.
      try {
        if (!pending_.arrival_error.empty()) arrival->seal();
        arrival->wait();
        pending_.ipc_release = ipc_token_;
      } catch (const std::exception&) {
      }
    }
    placements_.clear();
    ipc_placements_.clear();
    if (pending_.arrival_error.empty()) {
      for (auto& v : pending_.values) v = with_placed(v, placed);
      for (auto& g : pending_.grad_tensors) {
        auto it = placed.find(g.unsafeGetTensorImpl());
        if (it != placed.end()) g = it->second;
      }
      pending_.arrival = std::move(arrival);
    }
  }
  pending_.wire_bytes =
      kPreambleBytes + preamble_.table_bytes + preamble_.envelope_bytes + preamble_.body_bytes;
  table_.clear();
  ready_.push_back(std::move(pending_));
  pending_ = Message();
  tensors_.clear();
  tensor_index_ = 0;
  have_ = 0;
  state_ = State::kPreamble;
}

}  // namespace tandem::rpc
