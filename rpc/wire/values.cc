#include "tandem/rpc/wire/values.h"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>

#include <stdexcept>
#include <string>

#include "tandem/rpc/wire/checks.h"
#include "tandem/rpc/wire/wire.h"

namespace tandem::rpc {

// ---- writing -----------------------------------------------------------------

void write_type(schema::TypeDesc::Builder b, const c10::TypePtr& t) {
  using K = schema::TypeKind;
  switch (t->kind()) {
    case c10::TypeKind::NoneType:
      b.setKind(K::NONE);
      return;
    case c10::TypeKind::BoolType:
      b.setKind(K::BOOL);
      return;
    case c10::TypeKind::IntType:
      b.setKind(K::INT);
      return;
    case c10::TypeKind::FloatType:
      b.setKind(K::FLOAT);
      return;
    case c10::TypeKind::NumberType:
      b.setKind(K::NUMBER);
      return;
    case c10::TypeKind::StringType:
      b.setKind(K::STRING);
      return;
    case c10::TypeKind::TensorType:
      b.setKind(K::TENSOR);
      return;
    case c10::TypeKind::DeviceObjType:
      b.setKind(K::DEVICE);
      return;
    case c10::TypeKind::ListType:
    case c10::TypeKind::DictType:
    case c10::TypeKind::TupleType:
    case c10::TypeKind::OptionalType: {
      auto contained = t->containedTypes();
      b.setKind(t->kind() == c10::TypeKind::ListType    ? K::LIST
                : t->kind() == c10::TypeKind::DictType  ? K::DICT
                : t->kind() == c10::TypeKind::TupleType ? K::TUPLE
                                                        : K::OPTIONAL);
      auto els = b.initElements(contained.size());
      for (size_t i = 0; i < contained.size(); ++i) write_type(els[i], contained[i]);
      return;
    }
    default:
      b.setKind(K::ANY);
      return;
  }
}

void ValueWriter::value(schema::Value::Builder b, const c10::IValue& v, int depth) {
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
      b.setTensor(tensors_.tensor(t));
    }
  } else if (v.isList()) {
    auto list = v.toList();
    auto lb = b.initList();
    write_type(lb.initElementType(), list.elementType());
    auto items = lb.initItems(list.size());
    for (size_t i = 0; i < list.size(); ++i) value(items[i], list.get(i), depth + 1);
  } else if (v.isTuple()) {
    const auto& elems = v.toTupleRef().elements();
    auto items = b.initTuple(elems.size());
    for (size_t i = 0; i < elems.size(); ++i) value(items[i], elems[i], depth + 1);
  } else if (v.isGenericDict()) {
    auto dict = v.toGenericDict();
    auto db = b.initDict();
    write_type(db.initKeyType(), dict.keyType());
    write_type(db.initValueType(), dict.valueType());
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
    forks_.push_back(d);
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

// ---- reading -----------------------------------------------------------------

namespace {

c10::TypePtr read_type(schema::TypeDesc::Reader r) {
  using K = schema::TypeKind;
  auto els = r.getElements();
  switch (r.getKind()) {
    case K::ANY:
      return c10::AnyType::get();
    case K::NONE:
      return c10::NoneType::get();
    case K::BOOL:
      return c10::BoolType::get();
    case K::INT:
      return c10::IntType::get();
    case K::FLOAT:
      return c10::FloatType::get();
    case K::NUMBER:
      return c10::NumberType::get();
    case K::STRING:
      return c10::StringType::get();
    case K::TENSOR:
      return c10::TensorType::get();
    case K::DEVICE:
      return c10::DeviceObjType::get();
    case K::LIST:
      check_type_arity(els.size(), 1);
      return c10::ListType::create(read_type(els[0]));
    case K::DICT:
      check_type_arity(els.size(), 2);
      return c10::DictType::create(read_type(els[0]), read_type(els[1]));
    case K::OPTIONAL:
      check_type_arity(els.size(), 1);
      return c10::OptionalType::create(read_type(els[0]));
    case K::TUPLE: {
      std::vector<c10::TypePtr> items;
      for (auto e : els) items.push_back(read_type(e));
      return c10::TupleType::create(std::move(items));
    }
  }
  throw ProtocolError("unknown type kind " + std::to_string(static_cast<int>(r.getKind())) +
                      " in envelope");
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
    for (auto it = dict.begin(); it != dict.end(); ++it) {  // keys are never RRefs (see read_value)
      c10::IValue item = it->value();
      if (size_t k = fill_slots(item, handles)) {
        it->setValue(std::move(item));
        n += k;
      }
    }
  }
  return n;
}

}  // namespace

c10::Device read_device(schema::DeviceValue::Reader r) {
  return check_device_value(r.getType(), r.getIndex());
}

c10::IValue read_value(schema::Value::Reader r, const std::vector<at::Tensor>& tensors,
                       std::vector<RRefDesc>& rrefs) {
  using V = schema::Value;
  switch (r.which()) {
    case V::NONE:
      return c10::IValue();
    case V::BOOL:
      return c10::IValue(r.getBool());
    case V::INT:
      return c10::IValue(static_cast<int64_t>(r.getInt()));
    case V::DOUBLE:
      return c10::IValue(r.getDouble());
    case V::STRING: {
      auto d = r.getString();
      return c10::IValue(std::string(reinterpret_cast<const char*>(d.begin()), d.size()));
    }
    case V::TENSOR: {
      uint32_t i = r.getTensor();
      check_tensor_index(i, tensors.size());
      return c10::IValue(tensors[i]);
    }
    case V::LIST: {
      auto l = r.getList();
      c10::impl::GenericList list(read_type(l.getElementType()));
      auto items = l.getItems();
      list.reserve(items.size());
      for (auto item : items) list.push_back(read_value(item, tensors, rrefs));
      return c10::IValue(std::move(list));
    }
    case V::TUPLE: {
      auto tuple = r.getTuple();
      std::vector<c10::IValue> items;
      items.reserve(tuple.size());
      for (auto item : tuple) items.push_back(read_value(item, tensors, rrefs));
      return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
    }
    case V::DICT: {
      auto d = r.getDict();
      // Each list once: every get*() follows its pointer again and counts
      // against the traversal limit (a dict of n entries read as 2n lists
      // would exceed it).
      auto keys = d.getKeys();
      auto values = d.getValues();
      check_dict_sizes(keys.size(), values.size());
      c10::impl::GenericDict dict(read_type(d.getKeyType()), read_type(d.getValueType()));
      dict.reserve(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) {
        auto key = read_value(keys[i], tensors, rrefs);
        check_dict_key(key);
        dict.insert_or_assign(std::move(key), read_value(values[i], tensors, rrefs));
      }
      return c10::IValue(std::move(dict));
    }
    case V::DEVICE:
      return c10::IValue(read_device(r.getDevice()));
    case V::RREF: {
      auto x = r.getRref();
      RRefDesc d;
      d.owner = x.getOwner();
      d.id = {x.getIdWorker(), x.getIdLocal()};
      d.fork = {x.getForkWorker(), x.getForkLocal()};
      d.parent = x.getParent();
      check_rref(d);
      rrefs.push_back(d);
      return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(
          c10::make_intrusive<RRefSlot>(rrefs.size() - 1, d.owner)));
    }
  }
  throw ProtocolError("unknown value kind " + std::to_string(static_cast<int>(r.which())));
}

void fill_rrefs(std::vector<c10::IValue>& values, const std::vector<RRefPtr>& handles) {
  size_t filled = 0;
  for (auto& v : values) filled += fill_slots(v, handles);
  if (filled != handles.size()) {
    throw std::logic_error("fill_rrefs: " + std::to_string(handles.size()) + " handles for " +
                           std::to_string(filled) + " RRefs in the message");
  }
}

}  // namespace tandem::rpc
