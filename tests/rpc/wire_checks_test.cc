// The frame checks (rpc/wire/checks.h) called one at a time: each takes the
// good case and refuses each bad field with the message the decoder gives
// for it (wire_test.cc sends the same faults through FrameDecoder).
#include "test_util.h"

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/rpc/wire/checks.h"
#include "tandem/rpc/wire/wire.h"

using namespace tandem::rpc;

// The check throws ProtocolError with exactly `message`.
#define REFUSES(expr, message) \
  CHECK_THROWS_WITH_AS(expr, std::string(message).c_str(), ProtocolError)

namespace {

const std::string kLimitText = std::to_string(Limits{}.max_envelope_bytes);

Preamble good_preamble() {
  Preamble p;
  p.envelope_bytes = 64;
  p.body_bytes = 128;
  return p;
}

template <class Change>
Preamble preamble_with(Change change) {
  Preamble p = good_preamble();
  change(p);
  return p;
}

}  // namespace

TEST_CASE("wire checks: the preamble") {
  const Limits limits;
  CHECK_NOTHROW(check_preamble(good_preamble(), limits, /*handshake=*/false));
  REFUSES(check_preamble(preamble_with([](Preamble& p) { p.magic = 0x58444e54; }), limits, false),
          "bad magic in frame preamble");
  REFUSES(check_preamble(preamble_with([](Preamble& p) { p.version = 9; }), limits, false),
          "unsupported wire version 9");
  REFUSES(check_preamble(preamble_with([](Preamble& p) { p.envelope_bytes = 0; }), limits, false),
          "impossible envelope length 0 (limit " + kLimitText + ")");
  REFUSES(check_preamble(preamble_with([](Preamble& p) { p.envelope_bytes = 13; }), limits, false),
          "impossible envelope length 13 (limit " + kLimitText + ")");
  const auto over = static_cast<uint32_t>(limits.max_envelope_bytes + 8);
  REFUSES(
      check_preamble(preamble_with([=](Preamble& p) { p.envelope_bytes = over; }), limits, false),
      "impossible envelope length " + std::to_string(over) + " (limit " + kLimitText + ")");
  REFUSES(
      check_preamble(preamble_with([&](Preamble& p) { p.body_bytes = limits.max_body_bytes + 1; }),
                     limits, false),
      "tensor body of 17179869185 bytes exceeds the limit of 17179869184");
  CHECK_NOTHROW(check_preamble(
      preamble_with([&](Preamble& p) { p.body_bytes = limits.max_body_bytes; }), limits, false));
  REFUSES(check_preamble(preamble_with([](Preamble& p) { p.flags = 4; }), limits, false),
          "unknown frame flags 4");
  // A heartbeat is its flag alone with every length 0, nothing else.
  Preamble beat;
  beat.flags = kFlagHeartbeat;
  CHECK(is_heartbeat(beat));
  CHECK_FALSE(is_heartbeat(good_preamble()));
  CHECK_FALSE(is_heartbeat(preamble_with([](Preamble& p) { p.flags = kFlagHeartbeat; })));
  for (auto change : std::vector<std::function<void(Preamble&)>>{
           [](Preamble& p) { p.body_bytes = 8; }, [](Preamble& p) { p.table_bytes = 16; },
           [](Preamble& p) { p.flags |= kFlagSharedTensors; }, [](Preamble& p) { p.version = 9; },
           [](Preamble& p) { p.magic = 0; }}) {
    Preamble p = beat;
    change(p);
    CHECK_FALSE(is_heartbeat(p));
  }
  REFUSES(check_preamble(preamble_with([](Preamble& p) { p.flags = kFlagHeartbeat; }), limits,
                         false),
          "a heartbeat with lengths or other flags");
  CHECK_NOTHROW(check_preamble(preamble_with([](Preamble& p) { p.flags = kFlagSharedTensors; }),
                               limits, false));

  SUBCASE("during the handshake: small, with no body") {
    const std::string want =
        "the first frame must be a handshake (envelope of at most 4096 bytes, no tensors)";
    CHECK_NOTHROW(check_preamble(preamble_with([](Preamble& p) { p.body_bytes = 0; }), limits,
                                 /*handshake=*/true));
    REFUSES(check_preamble(good_preamble(), limits, true), want);
    REFUSES(check_preamble(preamble_with([](Preamble& p) {
                             p.body_bytes = 0;
                             p.envelope_bytes = 4104;
                           }),
                           limits, true),
            want);
    // The checks come in order: a bad magic is named first.
    REFUSES(check_preamble(preamble_with([](Preamble& p) { p.magic = 0; }), limits, true),
            "bad magic in frame preamble");
  }
}

TEST_CASE("wire checks: the shared-memory table's length") {
  Preamble p = good_preamble();
  CHECK(check_table_length(p, /*carried=*/false, /*handshake=*/false) == 0);
  p.table_bytes = 16;
  REFUSES(check_table_length(p, true, false), "shared tensor table of 16 bytes without its flag");
  p.flags = kFlagSharedTensors;
  p.table_bytes = 2 * sizeof(SharedRef);
  CHECK(check_table_length(p, true, false) == 2);
  REFUSES(check_table_length(p, /*carried=*/false, false),
          "frame names tensors in shared memory, which this connection does not carry");
  REFUSES(check_table_length(p, true, /*handshake=*/true), "the first frame must be a handshake");
  p.table_bytes = 0;
  REFUSES(check_table_length(p, true, false), "impossible shared tensor table of 0 bytes");
  p.table_bytes = 24;
  REFUSES(check_table_length(p, true, false), "impossible shared tensor table of 24 bytes");
  p.table_bytes = kMaxSharedRefs * sizeof(SharedRef);
  CHECK(check_table_length(p, true, false) == kMaxSharedRefs);
  p.table_bytes += sizeof(SharedRef);
  REFUSES(check_table_length(p, true, false),
          "impossible shared tensor table of " + std::to_string(p.table_bytes) + " bytes");
}

TEST_CASE("wire checks: the shared-memory table's entries") {
  const std::vector<SharedRef> ascending{{0, 0, 64}, {2, 0, 4160}};
  CHECK_NOTHROW(check_table_order(ascending.data(), ascending.size()));
  CHECK_NOTHROW(check_table_order(nullptr, 0));
  const std::vector<SharedRef> twice{{2, 0, 64}, {2, 0, 4160}};
  REFUSES(check_table_order(twice.data(), twice.size()),
          "shared tensor table is not in ascending tensor order");
  const std::vector<SharedRef> descending{{3, 0, 64}, {1, 0, 4160}};
  REFUSES(check_table_order(descending.data(), descending.size()),
          "shared tensor table is not in ascending tensor order");

  CHECK_NOTHROW(check_table_names(ascending, 3));
  CHECK_NOTHROW(check_table_names({}, 0));
  REFUSES(check_table_names(ascending, 2), "shared tensor table names tensor 2 of 2");
}

TEST_CASE("wire checks: the envelope's header") {
  CHECK((check_kind(0, false) == MessageKind::kRequest));
  CHECK((check_kind(2, false) == MessageKind::kError));
  CHECK((check_kind(3, /*handshake=*/true) == MessageKind::kHello));
  REFUSES(check_kind(4, false), "unknown message kind 4");
  REFUSES(check_kind(77, true), "unknown message kind 77");
  REFUSES(check_kind(0, true), "the first frame must be a handshake");

  CHECK_NOTHROW(check_autograd(0, 0));
  CHECK_NOTHROW(check_autograd(5, 7));
  CHECK_NOTHROW(check_autograd(5, 0));
  REFUSES(check_autograd(0, 7), "autograd message 7 outside any context");
  CHECK_NOTHROW(check_autograd_reach(0, 0));
  CHECK_NOTHROW(check_autograd_reach(2, 7));
  REFUSES(check_autograd_reach(2, 0), "autograd reach without an autograd message");

  CHECK((check_error_code(0) == ErrorCode::kRemote));
  CHECK((check_error_code(5) == ErrorCode::kProtocol));
  REFUSES(check_error_code(6), "unknown error code 6");
}

TEST_CASE("wire checks: the handshake's fields") {
  CHECK_NOTHROW(check_hello(1, 16, 0));
  CHECK_NOTHROW(check_hello(2, 16, 32));
  CHECK_NOTHROW(check_hello(3, 0, 32));
  REFUSES(check_hello(1, 15, 0), "step 1 with a nonce of 15 and a proof of 0 bytes");
  REFUSES(check_hello(1, 16, 32), "step 1 with a nonce of 16 and a proof of 32 bytes");
  REFUSES(check_hello(2, 16, 31), "step 2 with a nonce of 16 and a proof of 31 bytes");
  REFUSES(check_hello(3, 16, 32), "step 3 with a nonce of 16 and a proof of 32 bytes");
  // Sizes are checked first: an unknown step with a step 2's sizes is named as unknown.
  REFUSES(check_hello(4, 16, 32), "unknown step 4");
  REFUSES(check_hello(0, 16, 32), "unknown step 0");
  REFUSES(check_hello(4, 0, 0), "step 4 with a nonce of 0 and a proof of 0 bytes");
}

TEST_CASE("wire checks: a tensor's dtype, byte length and grad") {
  CHECK(known_dtype(static_cast<int>(c10::ScalarType::Float)));
  CHECK(known_dtype(static_cast<int>(c10::ScalarType::BFloat16)));
  CHECK_FALSE(known_dtype(static_cast<int>(c10::ScalarType::QInt8)));
  CHECK_FALSE(known_dtype(-1));
  CHECK_FALSE(known_dtype(99));

  CHECK((check_dtype(0, static_cast<int>(c10::ScalarType::Long)) == c10::ScalarType::Long));
  REFUSES(check_dtype(2, 99), "tensor 2: unknown dtype 99");
  const int qint8 = static_cast<int>(c10::ScalarType::QInt8);
  REFUSES(check_dtype(0, qint8), "tensor 0: unknown dtype " + std::to_string(qint8));

  CHECK(check_byte_length(0, 4, c10::ScalarType::Float, 16) == 16);
  CHECK(check_byte_length(0, 0, c10::ScalarType::Double, 0) == 0);
  REFUSES(check_byte_length(0, 4, c10::ScalarType::Float, 15),
          "tensor 0: byte length 15 does not match its shape and dtype");
  REFUSES(check_byte_length(1, uint64_t(1) << 62, c10::ScalarType::Float, 0),
          "tensor 1: byte length 0 does not match its shape and dtype");  // (overflows)

  CHECK_NOTHROW(check_requires_grad(0, true, c10::ScalarType::Float));
  CHECK_NOTHROW(check_requires_grad(0, true, c10::ScalarType::ComplexFloat));
  CHECK_NOTHROW(check_requires_grad(0, false, c10::ScalarType::Long));
  REFUSES(check_requires_grad(0, true, c10::ScalarType::Long),
          "tensor 0: requires grad but its dtype Long is not differentiable");
  REFUSES(check_requires_grad(3, true, c10::ScalarType::Bool),
          "tensor 3: requires grad but its dtype Bool is not differentiable");
}

TEST_CASE("wire checks: a tensor's shape and strides") {
  using Ints = std::vector<int64_t>;
  std::vector<int64_t> shape;
  CHECK(check_shape(0, Ints{2, 3}, Ints{3, 1}, shape) == 6);
  CHECK(shape == Ints{2, 3});
  CHECK(check_shape(0, Ints{}, Ints{}, shape) == 1);  // a scalar
  CHECK(shape.empty());
  CHECK(check_shape(0, Ints{0, 4}, Ints{4, 1}, shape) == 0);
  CHECK(check_shape(0, Ints{2, 1, 3}, Ints{3, 999, 1}, shape) ==
        6);  // a size-1 dim's stride is free
  CHECK(check_shape(0, Ints{kMaxDimSize}, Ints{1}, shape) == uint64_t(kMaxDimSize));
  CHECK(check_shape(0, Ints(kMaxDims, 1), Ints(kMaxDims, 1), shape) == 1);

  REFUSES(check_shape(0, Ints(kMaxDims + 1, 1), Ints(kMaxDims + 1, 1), shape),
          "tensor 0: bad shape (65 sizes, 65 strides)");
  REFUSES(check_shape(0, Ints{2, 3}, Ints{1}, shape), "tensor 0: bad shape (2 sizes, 1 strides)");
  REFUSES(check_shape(1, Ints{-4}, Ints{1}, shape), "tensor 1: negative size");
  REFUSES(check_shape(0, Ints{kMaxDimSize + 1}, Ints{1}, shape),
          "tensor 0: size 281474976710657 too large");
  REFUSES(check_shape(0, Ints{int64_t(1) << 40, int64_t(1) << 40, 4}, Ints{int64_t(1) << 42, 4, 1},
                      shape),
          "tensor 0: shape product overflows");
  // 2^63 elements fit the unsigned count but not the signed strides.
  REFUSES(
      check_shape(0, Ints{int64_t(1) << 32, int64_t(1) << 31}, Ints{int64_t(1) << 31, 1}, shape),
      "tensor 0: shape product overflows");
  REFUSES(check_shape(0, Ints{2, 2}, Ints{1, 2}, shape), "tensor 0: strides are not contiguous");
  REFUSES(check_shape(0, Ints{2, 0}, Ints{0, 1}, shape), "tensor 0: strides are not contiguous");
}

TEST_CASE("wire checks: a device as written, and a tensor's device") {
  CHECK((check_device_value(0, -1) == c10::Device(c10::kCPU)));
  CHECK((check_device_value(static_cast<int>(c10::DeviceType::CUDA), 1) ==
         c10::Device(c10::kCUDA, 1)));
  REFUSES(check_device_value(-1, 0), "invalid device (type -1, index 0) in envelope");
  const int past = static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);
  REFUSES(check_device_value(past, 0),
          "invalid device (type " + std::to_string(past) + ", index 0) in envelope");
  REFUSES(check_device_value(0, -2), "invalid device (type 0, index -2) in envelope");
  REFUSES(check_device_value(0, 300), "invalid device (type 0, index 300) in envelope");

  CHECK_NOTHROW(check_tensor_device(0, c10::Device(c10::kCPU), 0));
  CHECK_NOTHROW(check_tensor_device(0, c10::Device(c10::kCUDA, 1), 2));
  REFUSES(check_tensor_device(0, c10::Device(c10::kCUDA, 0), 0),
          "tensor 0: is for cuda:0, which this worker does not have (0 CUDA device(s))");
  REFUSES(check_tensor_device(2, c10::Device(c10::kCUDA, 2), 2),
          "tensor 2: is for cuda:2, which this worker does not have (2 CUDA device(s))");
  REFUSES(check_tensor_device(0, c10::Device(c10::kMeta), 2),
          "tensor 0: is for meta, which this worker does not have (2 CUDA device(s))");
  CHECK_THROWS_AS(check_tensor_device(0, c10::Device(c10::kCUDA), 2), ProtocolError);  // no index
}

TEST_CASE("wire checks: a tensor's CUDA IPC placement") {
  const c10::Device cuda(c10::kCUDA, 0);
  CHECK_NOTHROW(check_ipc_allowed(0, true, false, MessageKind::kRequest));
  CHECK_NOTHROW(check_ipc_allowed(0, true, false, MessageKind::kResponse));
  REFUSES(check_ipc_allowed(0, /*cuda_ipc=*/false, false, MessageKind::kRequest),
          "tensor 0: comes as a CUDA IPC handle, which this connection does not take (only "
          "same-host connections do)");
  const std::string outside = "tensor 1: comes as a CUDA IPC handle outside a request or answer";
  REFUSES(check_ipc_allowed(1, true, /*handshake=*/true, MessageKind::kRequest), outside);
  REFUSES(check_ipc_allowed(1, true, false, MessageKind::kError), outside);
  REFUSES(check_ipc_allowed(1, true, false, MessageKind::kHello), outside);

  CHECK_NOTHROW(check_ipc_tensor(0, cuda, false, 4));
  REFUSES(check_ipc_tensor(0, c10::Device(c10::kCPU), false, 4),
          "tensor 0: comes as a CUDA IPC handle but is for cpu");
  REFUSES(check_ipc_tensor(0, cuda, /*shared=*/true, 4),
          "tensor 0: comes as a CUDA IPC handle but is in shared memory too");
  REFUSES(check_ipc_tensor(0, cuda, false, 0), "tensor 0: comes as a CUDA IPC handle but is empty");

  CHECK_NOTHROW(check_ipc_handles(0, 64, 64, 64));
  REFUSES(check_ipc_handles(0, 3, 64, 64),
          "tensor 0: CUDA IPC handles of 3 and 64 bytes (want 64)");
  REFUSES(check_ipc_handles(0, 64, 0, 64),
          "tensor 0: CUDA IPC handles of 64 and 0 bytes (want 64)");

  CHECK_NOTHROW(check_ipc_range(0, 128, 4, 132));
  REFUSES(check_ipc_range(0, 128, 4, 131),
          "tensor 0: CUDA IPC bytes at 128+4 overrun the allocation of 131 bytes");
  REFUSES(check_ipc_range(0, ~uint64_t(0), 4, ~uint64_t(0)),
          "tensor 0: CUDA IPC bytes at 18446744073709551615+4 overrun the allocation of "
          "18446744073709551615 bytes");

  uint64_t total = 0;
  check_ipc_total(0, 4, 8, total);
  check_ipc_total(1, 4, 8, total);
  CHECK(total == 8);
  REFUSES(check_ipc_total(2, 1, 8, total),
          "tensor 2: CUDA IPC tensors exceed the limit of 8 bytes");
  total = ~uint64_t(0) - 1;
  REFUSES(check_ipc_total(0, 4, ~uint64_t(0), total),
          "tensor 0: CUDA IPC tensors exceed the limit of 18446744073709551615 bytes");

  CHECK_NOTHROW(check_ipc_token(false, 0));
  CHECK_NOTHROW(check_ipc_token(true, 7));
  REFUSES(check_ipc_token(true, 0), "CUDA IPC tensors without a token to release them by");
}

TEST_CASE("wire checks: the body's layout") {
  CHECK_NOTHROW(check_shared_tensor(0, 4));
  REFUSES(check_shared_tensor(3, 0), "tensor 3: is empty but named in shared memory");

  CHECK(check_body_place(0, 16, 100) == 16);
  CHECK(check_body_place(16, 4, 100) == 68);  // after padding to 64
  CHECK(check_body_place(64, 0, 64) == 64);
  REFUSES(check_body_place(16, 40, 100), "tensors overrun the frame's body of 100 bytes");
  REFUSES(check_body_place(64, ~uint64_t(0), ~uint64_t(0)),
          "tensors overrun the frame's body of 18446744073709551615 bytes");

  CHECK_NOTHROW(check_body_length(16, 16));
  REFUSES(check_body_length(16, 64), "frame body is 64 bytes but its tensors need 16");
}

TEST_CASE("wire checks: the value tree") {
  CHECK_NOTHROW(check_type_arity(2, 2));
  REFUSES(check_type_arity(0, 1), "malformed container type in envelope");

  CHECK_NOTHROW(check_tensor_index(0, 1));
  REFUSES(check_tensor_index(3, 0), "tensor index 3 out of range (0 tensors in frame)");
  REFUSES(check_tensor_index(1, 1), "tensor index 1 out of range (1 tensors in frame)");

  CHECK_NOTHROW(check_dict_sizes(2, 2));
  REFUSES(check_dict_sizes(2, 1), "dict with 2 keys and 1 values");

  for (const c10::IValue& key :
       {c10::IValue(std::string("k")), c10::IValue(int64_t(1)), c10::IValue(1.5), c10::IValue(true),
        c10::IValue(at::ones({1})), c10::IValue(c10::Device(c10::kCPU))}) {
    CHECK_NOTHROW(check_dict_key(key));
  }
  REFUSES(check_dict_key(c10::IValue()), "unhashable dict key of type None");

  RRefDesc d;
  d.owner = 1;
  d.id = {1, 5};
  d.fork = {0, 6};
  d.parent = 0;
  CHECK_NOTHROW(check_rref(d));
  for (int field = 0; field < 4; ++field) {
    RRefDesc bad = d;
    (field == 0   ? bad.owner
     : field == 1 ? bad.id.worker
     : field == 2 ? bad.fork.worker
                  : bad.parent) = -1;
    REFUSES(check_rref(bad), "RRef with a negative worker in envelope");
  }
}
