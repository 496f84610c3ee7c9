// Frames as bytes, for tests that feed decoders or sockets by hand.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <functional>
#include <string>

#include "rpc/wire/wire.capnp.h"
#include "tandem/rpc/wire/wire.h"

namespace tandem::test {

// The bytes a socket carries for `f`.
inline std::string frame_bytes(const rpc::OutFrame& f) { return f.to_bytes(); }

// A frame from a hand-made envelope (a request to "f" unless `fill` says
// otherwise) whose preamble announces `body_bytes`; `body` follows it.
inline std::string raw_frame(const std::function<void(rpc::schema::Envelope::Builder)>& fill,
                             uint64_t body_bytes, const std::string& body = {}) {
  capnp::MallocMessageBuilder b;
  auto env = b.initRoot<rpc::schema::Envelope>();
  env.setKind(rpc::schema::Kind::REQUEST);
  env.setCallee("f");
  fill(env);
  auto words = capnp::messageToFlatArray(b);
  rpc::Preamble p;
  p.envelope_bytes = static_cast<uint32_t>(words.size() * sizeof(capnp::word));
  p.body_bytes = body_bytes;
  std::string out(reinterpret_cast<const char*>(&p), sizeof(p));
  out.append(reinterpret_cast<const char*>(words.asBytes().begin()), words.asBytes().size());
  return out + body;
}

// Describes in `env` one float tensor of one element (4 body bytes) that
// its sender says goes to device (`type`, `index`), and makes it the value.
inline void one_float_for_device(rpc::schema::Envelope::Builder env, int16_t type, int16_t index) {
  auto t = env.initTensors(1)[0];
  t.setDtype(static_cast<int16_t>(c10::ScalarType::Float));
  t.initSizes(1).set(0, 1);
  t.initStrides(1).set(0, 1);
  t.setByteLength(4);
  auto d = t.initDevice();
  d.setType(type);
  d.setIndex(index);
  env.initValues(1)[0].setTensor(0);
}

}  // namespace tandem::test
