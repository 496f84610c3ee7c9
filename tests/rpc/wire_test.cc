// The frame codec on its own: round trips, chunked and direct reads, and every
// kind of malformed frame the decoder must refuse.
#include "test_util.h"

#include <filesystem>
#include <fstream>

#include <cstring>

#include <ATen/ops/imag.h>

#include "rpc/frames.h"
#include "tandem/rpc/common/auth.h"
#include "tandem/rpc/wire/device.h"

using namespace tandem::rpc;
using tandem::test::raw_frame;

namespace {

Message round_trip(const Message& m, size_t chunk = 0) {
  std::string bytes = tandem::test::frame_bytes(encode(m));
  FrameDecoder dec{Limits{}};
  if (chunk == 0) {
    dec.feed(bytes.data(), bytes.size());
  } else {
    for (size_t i = 0; i < bytes.size(); i += chunk) {
      dec.feed(bytes.data() + i, std::min(chunk, bytes.size() - i));
    }
  }
  REQUIRE(dec.has_message());
  Message out = dec.take();
  CHECK_FALSE(dec.has_message());
  CHECK(dec.idle());
  return out;
}

void expect_protocol_error(const std::string& bytes, const std::string& needle,
                           Limits limits = Limits{}) {
  FrameDecoder dec(limits);
  try {
    dec.feed(bytes.data(), bytes.size());
    FAIL("frame was accepted; expected: " << needle);
  } catch (const ProtocolError& e) {
    CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
  }
}

}  // namespace

TEST_CASE("wire: heartbeats are dropped anywhere between frames, the handshake's included") {
  Preamble p;
  p.flags = kFlagHeartbeat;
  const std::string beat(reinterpret_cast<const char*>(&p), sizeof p);
  Message hello;
  hello.kind = MessageKind::kHello;
  hello.hello_step = 1;
  hello.hello_worker = "w";
  hello.hello_nonce = std::string(16, 'n');
  Message call;
  call.kind = MessageKind::kRequest;
  call.id = 7;
  call.callee = "f";
  // A connection whose first frame must be a handshake: a heartbeat before
  // it, between frames, and one fed a byte at a time.
  const std::string bytes = beat + tandem::test::frame_bytes(encode(hello)) + beat + beat +
                            tandem::test::frame_bytes(encode(call));
  FrameDecoder dec(Limits{}, /*handshake_frames=*/1);
  for (char c : bytes) dec.feed(&c, 1);
  dec.feed(beat.data(), beat.size());
  REQUIRE(dec.has_message());
  CHECK(dec.take().kind == MessageKind::kHello);
  REQUIRE(dec.has_message());
  CHECK(dec.take().callee == "f");
  CHECK_FALSE(dec.has_message());
  CHECK(dec.idle());
  CHECK(dec.heartbeats() == 4);
  CHECK_FALSE(dec.in_handshake());
}

TEST_CASE("wire: scalars, strings and containers round-trip with their types") {
  Message m;
  m.kind = MessageKind::kRequest;
  m.id = 42;
  m.callee = "f";
  m.timeout_ms = 1500;
  std::string with_nul("a\0b", 3);
  c10::impl::GenericDict d(c10::StringType::get(), c10::IntType::get());
  d.insert("x", 1);
  d.insert("y", 2);
  m.values = {c10::IValue(),
              true,
              int64_t(-7),
              2.5,
              with_nul,
              c10::IValue(std::vector<int64_t>{}),
              c10::IValue(std::vector<double>{1.5, 2.5}),
              c10::ivalue::Tuple::create({int64_t(1), std::string("s")}),
              c10::IValue(d),
              c10::Device(c10::kCPU)};
  Message out = round_trip(m);
  CHECK(out.id == 42);
  CHECK(out.callee == "f");
  CHECK(out.timeout_ms == 1500);
  REQUIRE(out.values.size() == m.values.size());
  CHECK(out.values[0].isNone());
  CHECK(out.values[1].toBool());
  CHECK(out.values[2].toInt() == -7);
  CHECK(out.values[3].toDouble() == 2.5);
  CHECK(out.values[4].toStringRef() == with_nul);
  CHECK(out.values[5].isIntList());  // an empty List[int] stays a List[int]
  CHECK(out.values[5].toIntList().empty());
  CHECK((out.values[6].toDoubleVector() == std::vector<double>{1.5, 2.5}));
  CHECK(out.values[7].toTupleRef().elements()[1].toStringRef() == "s");
  auto dd = out.values[8].toGenericDict();
  CHECK((*dd.keyType() == *c10::StringType::get()));
  CHECK(dd.at("y").toInt() == 2);
  CHECK(out.values[9].toDevice() == c10::Device(c10::kCPU));
}

TEST_CASE("wire: a large dict, list and tuple decode within the traversal limit") {
  // A module's state dict: each list is read once, not once per entry.
  c10::impl::GenericDict d(c10::StringType::get(), c10::TensorType::get());
  std::vector<c10::IValue> items;
  for (int i = 0; i < 64; ++i) {
    d.insert("layer" + std::to_string(i) + ".weight", at::full({2}, i));
    items.push_back(int64_t(i));
  }
  Message m;
  m.kind = MessageKind::kRequest;
  m.id = 1;
  m.callee = "load";
  m.values = {c10::IValue(d), c10::IValue(std::vector<int64_t>(200, 3)),
              c10::ivalue::Tuple::create(items)};
  Message out = round_trip(m);
  auto dd = out.values[0].toGenericDict();
  CHECK(dd.size() == 64);
  CHECK(dd.at("layer63.weight").toTensor()[1].item<float>() == 63);
  CHECK(out.values[1].toIntVector().size() == 200);
  CHECK(out.values[2].toTupleRef().elements().size() == 64);
}

TEST_CASE("wire: tensors of every dtype arrive equal, contiguous and 64-byte aligned") {
  std::vector<at::Tensor> ts = {
      at::randn({3, 5}),
      at::arange(10, at::TensorOptions().dtype(at::kLong)),
      at::randn({4}).to(at::kHalf),
      at::randn({2, 2}).to(at::kBFloat16),
      at::ones({7}, at::TensorOptions().dtype(at::kBool)),
      at::zeros({0, 3}),
      at::arange(24, at::TensorOptions().dtype(at::kByte)).reshape({2, 3, 4}).transpose(0, 2),
      at::randn({3}).to(at::kComplexFloat)};
  Message m;
  m.kind = MessageKind::kResponse;
  for (auto& t : ts) m.values.emplace_back(t);
  OutFrame frame = encode(m);
  uint64_t offset = 0;
  for (auto& t : frame.tensors) {
    offset += padding_before(offset);
    CHECK(offset % kTensorAlignment == 0);
    CHECK(t.is_contiguous());
    offset += t.nbytes();
  }
  CHECK(frame.preamble.body_bytes == offset);
  for (size_t chunk : {size_t(0), size_t(1), size_t(7), size_t(4096)}) {
    Message out = round_trip(m, chunk);
    REQUIRE(out.values.size() == ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      const at::Tensor& got = out.values[i].toTensor();
      CHECK((got.scalar_type() == ts[i].scalar_type()));
      CHECK((got.sizes() == ts[i].sizes()));
      CHECK(got.is_contiguous());
      CHECK(at::equal(got, ts[i]));
    }
    // CPU tensors only: nothing to copy to a device, nothing to wait for.
    CHECK(out.arrival == nullptr);
  }
}

TEST_CASE("wire: a tensor passed twice travels once and arrives as one tensor") {
  at::Tensor t = at::randn({16});
  Message m;
  m.values = {t, t, c10::IValue(std::vector<at::Tensor>{t})};
  OutFrame f = encode(m);
  CHECK(f.tensors.size() == 1);
  Message out = round_trip(m);
  CHECK(out.values[0].toTensor().is_same(out.values[1].toTensor()));
  CHECK(out.values[2].toTensorVector()[0].is_same(out.values[0].toTensor()));
}

TEST_CASE("wire: large tensors can be read straight into their storage") {
  at::Tensor big = at::randn({1 << 18});  // 1 MiB
  at::Tensor small = at::randn({5});
  Message m;
  m.values = {small, big};
  std::string bytes = tandem::test::frame_bytes(encode(m));
  FrameDecoder dec{Limits{}};
  size_t pos = 0;
  size_t direct_bytes = 0;
  while (pos < bytes.size()) {
    auto [ptr, len] = dec.direct_target(16 << 10);
    if (ptr) {
      size_t n = std::min<size_t>(len, 100000);  // partial reads, like recv()
      std::memcpy(ptr, bytes.data() + pos, n);
      dec.direct_commit(n);
      direct_bytes += n;
      pos += n;
    } else {
      size_t n = std::min<size_t>(bytes.size() - pos, 3000);
      dec.feed(bytes.data() + pos, n);
      pos += n;
    }
  }
  REQUIRE(dec.has_message());
  Message out = dec.take();
  CHECK(direct_bytes > big.nbytes() / 2);
  CHECK(at::equal(out.values[0].toTensor(), small));
  CHECK(at::equal(out.values[1].toTensor(), big));
}

TEST_CASE("wire: several frames in one read are all decoded") {
  std::string bytes;
  for (int i = 0; i < 5; ++i) {
    Message m;
    m.id = i;
    m.values = {at::full_like(at::zeros({3}), i)};
    bytes += tandem::test::frame_bytes(encode(m));
  }
  FrameDecoder dec{Limits{}};
  dec.feed(bytes.data(), bytes.size());
  for (int i = 0; i < 5; ++i) {
    REQUIRE(dec.has_message());
    Message out = dec.take();
    CHECK(out.id == static_cast<uint64_t>(i));
    CHECK(out.values[0].toTensor()[2].item<float>() == i);
  }
}

TEST_CASE("wire: errors and handshakes round-trip") {
  Message e;
  e.kind = MessageKind::kError;
  e.id = 9;
  e.error_code = ErrorCode::kUnknownFunction;
  e.error_worker = "worker3";
  e.error_message = "no such thing";
  Message out = round_trip(e);
  CHECK(out.kind == MessageKind::kError);
  CHECK(out.error_code == ErrorCode::kUnknownFunction);
  CHECK(out.error_worker == "worker3");
  CHECK(out.error_message == "no such thing");
  Message h;
  h.kind = MessageKind::kHello;
  h.hello_worker = "trainer";
  h.hello_rank = 5;
  h.hello_step = 2;
  h.hello_nonce = std::string("n\0nce", 5);
  h.hello_proof = std::string(32, '\xab');
  out = round_trip(h);
  CHECK(out.hello_worker == "trainer");
  CHECK(out.hello_rank == 5);
  CHECK(out.hello_step == 2);
  CHECK(out.hello_nonce == h.hello_nonce);
  CHECK(out.hello_proof == h.hello_proof);
}

namespace {
// Forks every RRef for the test's receiver (rank 1) as rank 0, and keeps
// what it made; no agent is involved.
struct RecordingHook final : RRefHook {
  RRefDesc fork_for_send(const RRefPtr& rref, int dest) override {
    RRefDesc d = rref->desc();
    d.fork = {0, 100 + static_cast<uint64_t>(forks.size())};
    d.parent = 0;
    CHECK(dest == 1);
    forks.push_back(d);
    return d;
  }
  void abort_forks(const std::vector<RRefDesc>& undone) override { aborted += undone.size(); }
  std::vector<RRefDesc> forks;
  size_t aborted = 0;
};

RRefPtr handle(int32_t owner, uint64_t local) {
  RRefDesc d{owner, {owner, local}, {owner, local}, owner};
  return c10::make_intrusive<RRefImpl>(d, RRefImpl::Kind::kFork, "w" + std::to_string(owner),
                                       make_raw_future(), std::weak_ptr<RRefContext>(), false);
}

bool holds(const c10::IValue& v, const RRefPtr& h) {
  return v.isRRef() && v.toRRef().get() == h.get();
}
}  // namespace

TEST_CASE("wire: a received RRef is a plain description until the agent puts its handle there") {
  RecordingHook hook;
  RRefPtr a = handle(2, 7), b = handle(0, 8), c = handle(2, 9), d = handle(1, 10);
  c10::impl::GenericList list(c10::AnyType::get());
  list.push_back(c10::IValue(int64_t(5)));
  list.push_back(c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(b)));
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("k", c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(d)));
  Message m;
  m.values = {c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(a)), c10::IValue(list),
              c10::ivalue::Tuple::create(
                  {int64_t(1), c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(c))}),
              c10::IValue(dict)};
  OutFrame frame = encode(m, Limits{}, &hook, 1);
  REQUIRE(hook.forks.size() == 4);
  std::string bytes = tandem::test::frame_bytes(frame);
  frame.forks.commit();
  CHECK(hook.aborted == 0);

  FrameDecoder dec{Limits{}};
  dec.feed(bytes.data(), bytes.size());
  REQUIRE(dec.has_message());
  Message out = dec.take();
  REQUIRE(out.rrefs.size() == 4);
  for (size_t i = 0; i < 4; ++i) {  // frame order: the descriptions the sender made
    CHECK(out.rrefs[i].owner == hook.forks[i].owner);
    CHECK(out.rrefs[i].id == hook.forks[i].id);
    CHECK(out.rrefs[i].fork == hook.forks[i].fork);
    CHECK(out.rrefs[i].parent == 0);
  }
  // Until filled, no place holds a usable handle.
  REQUIRE(out.values[0].isRRef());
  CHECK(dynamic_cast<RRefImpl*>(out.values[0].toRRef().get()) == nullptr);

  std::vector<RRefPtr> mine = {handle(2, 1), handle(0, 2), handle(2, 3), handle(1, 4)};
  CHECK_THROWS_AS(fill_rrefs(out.values, {mine[0], mine[1], mine[2]}),
                  std::logic_error);  // one place left
  FrameDecoder dec2{Limits{}};
  std::string bytes2 = tandem::test::frame_bytes(encode(m, Limits{}, &hook, 1));
  dec2.feed(bytes2.data(), bytes2.size());
  Message fresh = dec2.take();
  fill_rrefs(fresh.values, mine);
  CHECK(holds(fresh.values[0], mine[0]));
  CHECK(holds(fresh.values[1].toList().get(1), mine[1]));
  CHECK(fresh.values[1].toList().get(0).toInt() == 5);
  CHECK(holds(fresh.values[2].toTupleRef().elements()[1], mine[2]));
  CHECK(holds(fresh.values[3].toGenericDict().at("k"), mine[3]));
  std::vector<RRefPtr> five = mine;
  five.push_back(handle(2, 5));
  FrameDecoder dec3{Limits{}};
  dec3.feed(bytes2.data(), bytes2.size());
  Message third = dec3.take();
  CHECK_THROWS_AS(fill_rrefs(third.values, five), std::logic_error);  // one handle has no place
}

TEST_CASE("wire: values that cannot travel are refused at the sender") {
  Message m;
  m.values = {c10::IValue(c10::complex<double>(1, 2))};
  CHECK_THROWS_AS(encode(m), std::invalid_argument);
  m.values = {at::randn({4}).to_sparse()};
  CHECK_THROWS_AS(encode(m), std::invalid_argument);
}

TEST_CASE("wire: malformed frames are refused with a protocol error") {
  SUBCASE("bad magic") {
    std::string f = raw_frame([](auto) {}, 0);
    f[0] = 'X';
    expect_protocol_error(f, "bad magic");
  }
  SUBCASE("unsupported version") {
    std::string f = raw_frame([](auto) {}, 0);
    f[4] = 9;
    expect_protocol_error(f, "wire version");
  }
  SUBCASE("envelope length not a whole number of words") {
    Preamble p;
    p.envelope_bytes = 13;
    expect_protocol_error(std::string(reinterpret_cast<char*>(&p), sizeof(p)), "envelope length");
  }
  SUBCASE("envelope over the limit") {
    Preamble p;
    p.envelope_bytes = 1u << 30;
    expect_protocol_error(std::string(reinterpret_cast<char*>(&p), sizeof(p)), "envelope length");
  }
  SUBCASE("body over the limit") {
    Preamble p;
    p.envelope_bytes = 64;
    p.body_bytes = ~0ull;
    expect_protocol_error(std::string(reinterpret_cast<char*>(&p), sizeof(p)), "exceeds the limit");
  }
  SUBCASE("unknown dtype") {
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto t = env.initTensors(1)[0];
                                t.setDtype(99);
                                t.setByteLength(0);
                              },
                              0),
                          "unknown dtype");
  }
  SUBCASE("a tensor for a device this worker does not have") {
    // A device map's target (DeviceMap) is checked where the tensor lands.
    auto cuda_tensor = [](int16_t type, int16_t index) {
      return raw_frame([=](auto env) { tandem::test::one_float_for_device(env, type, index); }, 4,
                       std::string(4, 'x'));
    };
    if (!at::hasCUDA()) {
      expect_protocol_error(cuda_tensor(static_cast<int16_t>(c10::DeviceType::CUDA), 0),
                            "is for cuda:0, which this worker does not have (0 CUDA device(s))");
    }
    expect_protocol_error(cuda_tensor(static_cast<int16_t>(c10::DeviceType::CUDA), 99),
                          "is for cuda:99, which this worker does not have");
    expect_protocol_error(cuda_tensor(static_cast<int16_t>(c10::DeviceType::Meta), 0),
                          "which this worker does not have");
  }
  SUBCASE("quantized dtypes are not accepted from the wire") {
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto t = env.initTensors(1)[0];
                                t.setDtype(static_cast<int16_t>(c10::ScalarType::QInt8));
                              },
                              0),
                          "unknown dtype");
  }
  SUBCASE("byte length that does not match the shape") {
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto t = env.initTensors(1)[0];
                                t.setDtype(static_cast<int16_t>(c10::ScalarType::Float));
                                t.initSizes(1).set(0, 4);
                                t.initStrides(1).set(0, 1);
                                t.setByteLength(15);
                              },
                              15, std::string(15, 'x')),
                          "does not match");
  }
  SUBCASE("shape whose product overflows") {
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto t = env.initTensors(1)[0];
                                t.setDtype(static_cast<int16_t>(c10::ScalarType::Float));
                                auto s = t.initSizes(3);
                                s.set(0, int64_t(1) << 40);
                                s.set(1, int64_t(1) << 40);
                                s.set(2, 4);
                                auto st = t.initStrides(3);
                                st.set(0, int64_t(1) << 42);
                                st.set(1, 4);
                                st.set(2, 1);
                                t.setByteLength(16);
                              },
                              16),
                          "overflows");
  }
  SUBCASE("negative size") {
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto t = env.initTensors(1)[0];
                                t.setDtype(static_cast<int16_t>(c10::ScalarType::Float));
                                t.initSizes(1).set(0, -4);
                                t.initStrides(1).set(0, 1);
                              },
                              0),
                          "negative size");
  }
  SUBCASE("non-contiguous strides") {
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto t = env.initTensors(1)[0];
                                t.setDtype(static_cast<int16_t>(c10::ScalarType::Float));
                                auto s = t.initSizes(2);
                                s.set(0, 2);
                                s.set(1, 2);
                                auto st = t.initStrides(2);
                                st.set(0, 1);
                                st.set(1, 2);
                                t.setByteLength(16);
                              },
                              16),
                          "not contiguous");
  }
  SUBCASE("body length that disagrees with the tensors") {
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto t = env.initTensors(1)[0];
                                t.setDtype(static_cast<int16_t>(c10::ScalarType::Float));
                                t.initSizes(1).set(0, 4);
                                t.initStrides(1).set(0, 1);
                                t.setByteLength(16);
                              },
                              64),
                          "need 16");
  }
  SUBCASE("tensor index out of range") {
    expect_protocol_error(raw_frame([](auto env) { env.initValues(1)[0].setTensor(3); }, 0),
                          "out of range");
  }
  SUBCASE("unknown message kind") {
    expect_protocol_error(
        raw_frame([](auto env) { env.setKind(static_cast<schema::Kind>(77)); }, 0),
        "unknown message kind");
  }
  SUBCASE("dict with more keys than values") {
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto d = env.initValues(1)[0].initDict();
                                d.initKeys(2)[0].setInt(1);
                                d.initValues(1);
                              },
                              0),
                          "keys");
  }
  SUBCASE("value tree nested past the capnp limit") {
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto v = env.initValues(1)[0];
                                for (int i = 0; i < 100; ++i) v = v.initTuple(1)[0];
                                v.setInt(1);
                              },
                              0),
                          "malformed envelope");
  }
  SUBCASE("envelope that makes the reader traverse too much") {
    Limits tight;
    tight.traversal_limit_words = 64;
    expect_protocol_error(raw_frame(
                              [](auto env) {
                                auto l = env.initValues(1)[0].initList().initItems(200);
                                for (auto v : l) v.setInt(1);
                              },
                              0),
                          "malformed envelope", tight);
  }
  SUBCASE("garbage in place of an envelope") {
    Preamble p;
    p.envelope_bytes = 64;
    std::string f(reinterpret_cast<char*>(&p), sizeof(p));
    f.append(64, '\xff');
    expect_protocol_error(f, "malformed envelope");
  }
}

TEST_CASE("wire: empty, conjugated and negated views travel as what they show") {
  at::Tensor empty = at::zeros({3, 4}).narrow(1, 0, 0);  // "contiguous" with strides (4, 1)
  at::Tensor z = at::randn({5}).to(at::kComplexFloat);
  at::Tensor neg = at::imag(z.conj());  // a negative view
  Message m;
  m.values = {empty, z.conj(), neg};
  Message out = round_trip(m);
  CHECK((out.values[0].toTensor().sizes() == empty.sizes()));
  CHECK(at::equal(out.values[1].toTensor(), z.conj().resolve_conj()));
  CHECK(at::equal(out.values[2].toTensor(), neg.resolve_neg()));
}

TEST_CASE("wire: the sender refuses what the receiver would refuse") {
  Message m;
  c10::IValue v = int64_t(1);
  for (int i = 0; i < kMaxValueDepth + 2; ++i) v = c10::ivalue::Tuple::create({v});
  m.values = {v};
  CHECK_THROWS_WITH_AS(encode(m), doctest::Contains("nested deeper"), std::invalid_argument);
  Limits small;
  small.max_envelope_bytes = 1024;
  small.max_body_bytes = 100;
  m.values = {std::string(4096, 'x')};
  CHECK_THROWS_WITH_AS(encode(m, small), doctest::Contains("envelope"), std::invalid_argument);
  m.values = {at::zeros({1000})};
  CHECK_THROWS_WITH_AS(encode(m, small), doctest::Contains("exceed the limit"),
                       std::invalid_argument);
  // Just inside the depth limit still round-trips.
  v = int64_t(1);
  for (int i = 0; i < kMaxValueDepth; ++i) v = c10::ivalue::Tuple::create({v});
  m.values = {v};
  CHECK_NOTHROW(round_trip(m));
}

TEST_CASE("wire: the handshake's frames come first and are small") {
  Message h;
  h.kind = MessageKind::kHello;
  h.hello_worker = "w";
  Message req;
  req.callee = "f";
  const std::string hello = tandem::test::frame_bytes(encode(h));
  const std::string request = tandem::test::frame_bytes(encode(req));
  SUBCASE("an accepted connection: two handshake frames, then anything") {
    FrameDecoder dec(Limits{}, /*handshake_frames=*/2);
    std::string b = hello + hello + request;
    CHECK(dec.in_handshake());
    dec.feed(b.data(), b.size());
    CHECK_FALSE(dec.in_handshake());
    CHECK(dec.take().kind == MessageKind::kHello);
    CHECK(dec.take().kind == MessageKind::kHello);
    CHECK(dec.take().kind == MessageKind::kRequest);
  }
  SUBCASE("a request in place of the second handshake frame") {
    FrameDecoder dec(Limits{}, 2);
    std::string b = hello + request;
    CHECK_THROWS_WITH_AS(dec.feed(b.data(), b.size()), doctest::Contains("handshake"),
                         ProtocolError);
  }
  SUBCASE("a request first") {
    FrameDecoder dec(Limits{}, 1);
    CHECK_THROWS_WITH_AS(dec.feed(request.data(), request.size()), doctest::Contains("handshake"),
                         ProtocolError);
  }
  SUBCASE("a handshake with a tensor body") {
    FrameDecoder dec(Limits{}, 2);
    Message big = h;
    big.values = {at::zeros({4})};  // a tensor body before anyone is trusted
    std::string b = hello + tandem::test::frame_bytes(encode(big));
    CHECK_THROWS_WITH_AS(dec.feed(b.data(), b.size()), doctest::Contains("handshake"),
                         ProtocolError);
  }
}

TEST_CASE("auth: SHA-256 and HMAC-SHA256 match the published test vectors") {
  auto hex = [](const Sha256Digest& d) { return tandem::rpc::to_hex(d.data(), d.size()); };
  // FIPS 180-4 examples, and lengths around the padding's block edge.
  CHECK(hex(sha256("")) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(sha256("abc")) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(hex(sha256(std::string(1000000, 'a'))) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // RFC 4231 cases 1, 2 and 6 (a key longer than a block).
  CHECK(hex(hmac_sha256(std::string(20, '\x0b'), "Hi There")) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(hex(hmac_sha256("Jefe", "what do ya want for nothing?")) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  CHECK(hex(hmac_sha256(std::string(131, '\xaa'),
                        "Test Using Larger Than Block-Size Key - Hash Key First")) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  // The two proofs differ by role and by every input.
  const std::string nd(kNonceBytes, 'd'), na(kNonceBytes, 'a');
  const std::string pa = acceptor_proof("t", nd, na, 0, 1);
  CHECK(pa.size() == kProofBytes);
  CHECK(pa != dialer_proof("t", nd, na, 0, 1));
  CHECK(pa != acceptor_proof("u", nd, na, 0, 1));
  CHECK(pa != acceptor_proof("t", na, nd, 0, 1));
  CHECK(pa != acceptor_proof("t", nd, na, 1, 0));
  CHECK(random_bytes(kNonceBytes) != random_bytes(kNonceBytes));
  CHECK(constant_time_equal(pa, acceptor_proof("t", nd, na, 0, 1)));
  CHECK_FALSE(constant_time_equal(pa, pa.substr(1)));
}

TEST_CASE("wire: a device index out of range is refused") {
  expect_protocol_error(raw_frame(
                            [](auto env) {
                              auto d = env.initValues(1)[0].initDevice();
                              d.setType(0);
                              d.setIndex(300);
                            },
                            0),
                        "invalid device");
}

TEST_CASE("wire: CUDA IPC handles are taken only on same-host connections, and checked") {
  // The decoder's checks run here as on a GPU machine: the worker says it
  // has one CUDA device (rpc/agent/testing.h); placing there then fails alone.
  struct Devices {
    Devices() { testing::set_cuda_devices(1); }
    ~Devices() { testing::set_cuda_devices(-1); }
  } fake;
  // (on a GPU machine, opening the handle below starts CUDA: not this case's leak)
  tandem::test::process_lifetime([] {
    if (at::hasCUDA()) (void)at::ones({1}, at::TensorOptions().device(at::kCUDA));
  });
  auto ipc_frame = [](size_t mem_bytes, int16_t type, uint64_t token,
                      uint64_t alloc_bytes = 1 << 20, schema::Kind kind = schema::Kind::REQUEST) {
    return raw_frame(
        [=](auto env) {
          env.setKind(kind);
          tandem::test::one_float_for_device(env, type, 0);
          auto c = env.getTensors()[0].initCudaIpc();
          c.setMemHandle(capnp::Data::Reader(
              reinterpret_cast<const kj::byte*>(std::string(mem_bytes, 'm').data()), mem_bytes));
          c.setAllocBytes(alloc_bytes);
          c.setOffset(128);
          std::string event(device::kIpcHandleBytes, 'e');
          c.setEventHandle(
              capnp::Data::Reader(reinterpret_cast<const kj::byte*>(event.data()), event.size()));
          env.setIpcToken(token);
        },
        0);  // its place in the body is empty
  };
  const auto cuda = static_cast<int16_t>(c10::DeviceType::CUDA);
  const auto cpu = static_cast<int16_t>(c10::DeviceType::CPU);
  // A connection to another host never takes them.
  expect_protocol_error(ipc_frame(device::kIpcHandleBytes, cuda, 7),
                        "comes as a CUDA IPC handle, which this connection does not take");
  auto refused_on_same_host = [](const std::string& bytes, const std::string& needle) {
    FrameDecoder dec(Limits{});
    dec.set_cuda_ipc(true);
    CHECK_THROWS_WITH_AS(dec.feed(bytes.data(), bytes.size()), doctest::Contains(needle.c_str()),
                         ProtocolError);
  };
  refused_on_same_host(ipc_frame(3, cuda, 7), "CUDA IPC handles of 3 and 64 bytes (want 64)");
  refused_on_same_host(ipc_frame(device::kIpcHandleBytes, cpu, 7),
                       "comes as a CUDA IPC handle but is for cpu");
  refused_on_same_host(ipc_frame(device::kIpcHandleBytes, cuda, 0), "without a token");
  // The bytes (4, at offset 128) must lie in the allocation the sender named.
  refused_on_same_host(ipc_frame(device::kIpcHandleBytes, cuda, 7, 131),
                       "CUDA IPC bytes at 128+4 overrun the allocation of 131 bytes");
  refused_on_same_host(ipc_frame(device::kIpcHandleBytes, cuda, 7, 1 << 20, schema::Kind::ERROR),
                       "comes as a CUDA IPC handle outside a request or answer");
  {
    Limits small;
    small.max_body_bytes = 2;
    FrameDecoder dec(small);
    dec.set_cuda_ipc(true);
    const std::string big = ipc_frame(device::kIpcHandleBytes, cuda, 7);
    CHECK_THROWS_WITH_AS(dec.feed(big.data(), big.size()),
                         doctest::Contains("CUDA IPC tensors exceed the limit of 2 bytes"),
                         ProtocolError);
  }
  // A well-formed one whose handle cannot be opened (no CUDA here; a stale
  // handle on a GPU machine) fails that message alone, and the sender's
  // buffers are released all the same.
  FrameDecoder dec(Limits{});
  dec.set_cuda_ipc(true);
  const std::string ok = ipc_frame(device::kIpcHandleBytes, cuda, 7);
  dec.feed(ok.data(), ok.size());
  REQUIRE(dec.has_message());
  Message m = dec.take();
  CHECK_FALSE(m.arrival_error.empty());
  CHECK(m.ipc_release == 7);
  // A message of CPU tensors is encoded as ever where IPC is allowed.
  Message plain;
  plain.kind = MessageKind::kRequest;
  plain.callee = "f";
  plain.values.emplace_back(at::ones({4}));
  OutFrame f = encode(plain, Limits{}, nullptr, -1, nullptr, /*cuda_ipc=*/true);
  CHECK(f.ipc == nullptr);
  CHECK(f.ipc_token == 0);
}

// The fuzz target's seeds (tests/fuzz/corpus, and any input a past `./dev
// fuzz` found and that was added there) run through the same checks in
// every build: the decoder in every mode the control byte picks, the round
// trip, the handshake's proof check. A finding aborts.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" void tandem_fuzz_release();

TEST_CASE("wire: the fuzz corpus replays without a finding") {
  namespace fs = std::filesystem;
  size_t inputs = 0;
  for (const auto& entry : fs::directory_iterator(TANDEM_FUZZ_CORPUS)) {
    std::ifstream in(entry.path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CAPTURE(entry.path().filename().string());
    CHECK(LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()) ==
          0);
    // And with every other control byte: each mode of the decoder.
    for (int control = 0; control < 256; control += 7) {
      if (bytes.empty()) break;
      bytes[0] = static_cast<char>(control);
      CHECK(LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()) ==
            0);
    }
    ++inputs;
  }
  tandem_fuzz_release();
  CHECK(inputs >= 6);
}
