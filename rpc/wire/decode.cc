// FrameDecoder: received bytes become Messages. A state machine over the
// frame's parts (preamble, shared-memory table, envelope, body) that runs
// each part's checks (rpc/wire/checks.h) as soon as the part is complete,
// and allocates a frame's tensors only once every one of their
// descriptions passed; the body is then read into the tensors' own storage.
#include "tandem/rpc/wire/device.h"
#include "tandem/rpc/wire/wire.h"

#include <ATen/ops/empty.h>
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "rpc/wire/wire.capnp.h"
#include "tandem/rpc/wire/checks.h"
#include "tandem/rpc/wire/values.h"

namespace tandem::rpc {

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
  if (is_heartbeat(preamble_)) {  // nothing to deliver: the bytes were the news
    have_ = 0;
    ++heartbeats_;
    return;
  }
  check_preamble(preamble_, limits_, in_handshake());
  table_.clear();
  table_.resize(check_table_length(preamble_, static_cast<bool>(resolve_shared_), in_handshake()));
  envelope_ = kj::heapArray<capnp::word>(preamble_.envelope_bytes / sizeof(capnp::word));
  have_ = 0;
  state_ = table_.empty() ? State::kEnvelope : State::kTable;
}

void FrameDecoder::on_table() {
  check_table_order(table_.data(), table_.size());
  have_ = 0;
  state_ = State::kEnvelope;
}

// One received tensor as its description says, checked: what the decoder
// makes for it once every tensor of the frame passed.
struct TensorPlan {
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  c10::Device device{c10::kCPU};
  uint64_t byte_length = 0;
  bool requires_grad = false;
  const SharedRef* shared = nullptr;  // where in shared memory, for one named in the table
  // For one that comes by CUDA IPC: its handles (in the envelope, which
  // outlives the plan) and where its bytes start in the sender's allocation.
  bool ipc = false;
  capnp::Data::Reader ipc_mem;
  capnp::Data::Reader ipc_event;
  uint64_t ipc_offset = 0;
};

namespace {

// What a frame's tensor descriptions are checked against.
struct FrameRules {
  const Limits& limits;
  const std::vector<SharedRef>& table;
  bool cuda_ipc;
  bool handshake;
  MessageKind kind;
  uint64_t body_bytes;
  uint64_t ipc_token;
};

// The kind-specific fields of `env` (autograd, callee, error, hello),
// checked, into `m`, whose kind is set.
void read_fields(schema::Envelope::Reader env, Message& m) {
  if (m.kind == MessageKind::kRequest || m.kind == MessageKind::kResponse) {
    m.autograd_context = env.getAutogradContext();
    m.autograd_message = env.getAutogradMessage();
    check_autograd(m.autograd_context, m.autograd_message);
    auto reach = env.getAutogradReach();
    check_autograd_reach(reach.size(), m.autograd_message);
    m.autograd_reach.reserve(reach.size());
    for (uint64_t r : reach) m.autograd_reach.push_back(r);
  }
  if (m.kind == MessageKind::kRequest) {
    m.callee = env.getCallee();
    m.timeout_ms = env.getTimeoutMs();
  } else if (m.kind == MessageKind::kError) {
    auto e = env.getError();
    m.error_code = check_error_code(static_cast<uint16_t>(e.getCode()));
    m.error_worker = e.getWorker();
    m.error_message = e.getMessage();
  } else if (m.kind == MessageKind::kHello) {
    auto h = env.getHello();
    m.hello_worker = h.getWorker();
    m.hello_rank = h.getRank();
    m.hello_step = h.getStep();
    auto nonce = h.getNonce();
    m.hello_nonce.assign(reinterpret_cast<const char*>(nonce.begin()), nonce.size());
    auto proof = h.getProof();
    m.hello_proof.assign(reinterpret_cast<const char*>(proof.begin()), proof.size());
  }
}

// Checks every tensor's description and the body's length (before anything
// is allocated for them) and returns what to make of each.
std::vector<TensorPlan> plan_tensors(capnp::List<schema::TensorMeta>::Reader metas,
                                     const FrameRules& rules) {
  check_table_names(rules.table, metas.size());
  std::vector<TensorPlan> plans(metas.size());
  for (const SharedRef& ref : rules.table) plans[ref.tensor].shared = &ref;
  uint64_t offset = 0;     // the body's bytes so far
  uint64_t ipc_bytes = 0;  // (counted against max_body_bytes, as body bytes are)
  bool any_ipc = false;
  for (size_t i = 0; i < metas.size(); ++i) {
    auto meta = metas[i];
    TensorPlan& p = plans[i];
    p.dtype = check_dtype(i, meta.getDtype());
    auto sizes = meta.getSizes();
    auto strides = meta.getStrides();
    const uint64_t numel = check_shape(i, sizes, strides, p.shape);
    p.byte_length = meta.getByteLength();
    uint64_t nbytes = check_byte_length(i, numel, p.dtype, p.byte_length);
    p.device = read_device(meta.getDevice());
    // (CUDA is asked only for a CUDA tensor: a CPU worker never starts it.)
    check_tensor_device(i, p.device, p.device.is_cpu() ? 0 : device::cuda_device_count());
    p.requires_grad = meta.getRequiresGrad();
    check_requires_grad(i, p.requires_grad, p.dtype);
    if (meta.hasCudaIpc()) {
      check_ipc_allowed(i, rules.cuda_ipc, rules.handshake, rules.kind);
      check_ipc_tensor(i, p.device, p.shared != nullptr, nbytes);
      auto c = meta.getCudaIpc();
      p.ipc_mem = c.getMemHandle();
      p.ipc_event = c.getEventHandle();
      check_ipc_handles(i, p.ipc_mem.size(), p.ipc_event.size(), device::kIpcHandleBytes);
      p.ipc_offset = c.getOffset();
      check_ipc_range(i, p.ipc_offset, nbytes, c.getAllocBytes());
      check_ipc_total(i, nbytes, rules.limits.max_body_bytes, ipc_bytes);
      p.ipc = any_ipc = true;
      nbytes = 0;  // its place in the body is empty
    }
    if (p.shared) {
      check_shared_tensor(i, nbytes);
      continue;  // not in the body
    }
    offset = check_body_place(offset, nbytes, rules.body_bytes);
  }
  check_body_length(offset, rules.body_bytes);
  check_ipc_token(any_ipc, rules.ipc_token);
  return plans;
}

}  // namespace

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
    pending_.kind = check_kind(static_cast<uint16_t>(env.getKind()), in_handshake());
    if (in_handshake()) --handshake_frames_;
    pending_.id = env.getId();
    ipc_token_ = env.getIpcToken();
    read_fields(env, pending_);
    std::vector<TensorPlan> plans =
        plan_tensors(env.getTensors(), FrameRules{limits_, table_, cuda_ipc_, in_handshake(),
                                                  pending_.kind, preamble_.body_bytes, ipc_token_});
    const std::vector<at::Tensor> all = make_tensors(plans);
    auto values = env.getValues();
    pending_.values.reserve(values.size());
    for (auto v : values) pending_.values.push_back(read_value(v, all, pending_.rrefs));
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

std::vector<at::Tensor> FrameDecoder::make_tensors(std::vector<TensorPlan>& plans) {
  // tensors_ are the ones still to be read from the body; all of them,
  // with those in shared memory, are what the values index.
  std::vector<at::Tensor> all;
  all.reserve(plans.size());
  for (TensorPlan& p : plans) {
    if (p.shared) {
      all.push_back(resolve_shared_(*p.shared, p.dtype, p.shape, p.byte_length));
    } else if (p.ipc) {
      // A placeholder in the values until finish() copies it; an empty
      // tensor in the body.
      IpcPlacement placement;
      placement.placeholder = at::empty({0}, at::TensorOptions().dtype(p.dtype));
      placement.mem_handle.assign(reinterpret_cast<const char*>(p.ipc_mem.begin()),
                                  p.ipc_mem.size());
      placement.offset = p.ipc_offset;
      placement.event_handle.assign(reinterpret_cast<const char*>(p.ipc_event.begin()),
                                    p.ipc_event.size());
      placement.dtype = p.dtype;
      placement.shape = std::move(p.shape);
      placement.device = p.device;
      all.push_back(placement.placeholder);
      tensors_.push_back(at::empty({0}, at::TensorOptions().dtype(p.dtype)));
      ipc_placements_.push_back(std::move(placement));
    } else {
      all.push_back(device::host_buffer(p.shape, p.dtype, p.device));
      tensors_.push_back(all.back());
    }
    if (!p.device.is_cpu() && !p.ipc) placements_.emplace_back(all.back(), p.device);
    if (p.requires_grad) {
      if (pending_.autograd_message != 0) {
        pending_.grad_tensors.push_back(all.back());  // the layer above records it
      } else {
        all.back().set_requires_grad(true);  // a new leaf, as in PyTorch
      }
    }
  }
  return all;
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
