// Frames as bytes, for tests that feed decoders or sockets by hand.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <functional>
#include <string>

#include "rpc/wire.capnp.h"
#include "tandem/rpc/wire.h"

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

}  // namespace tandem::test
