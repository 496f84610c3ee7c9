# Tandem's wire envelope. A frame on the wire is
#   [24-byte preamble][this envelope, capnp flat array][tensor bytes, each 64-byte aligned]
# (see wire.h). Tensor bytes never pass through capnp: the envelope only
# describes them, and the receiver reads them straight into fresh storage.
@0xd3a1c27be0f4a95c;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tandem::rpc::schema");

enum Kind {
  request @0;
  response @1;
  error @2;
  hello @3;     # the handshake's frames (rpc/common/auth.h): who is calling, and proofs of the cluster token
}

enum ErrorCode {
  remote @0;
  timeout @1;
  disconnected @2;
  unknownFunction @3;
  shutdown @4;
  protocol @5;
}

enum TypeKind {
  any @0;
  none @1;
  bool @2;
  int @3;
  float @4;
  string @5;
  tensor @6;
  device @7;
  list @8;      # elements: [item]
  dict @9;      # elements: [key, value]
  tuple @10;    # elements: the items
  optional @11; # elements: [item]
  number @12;
}

# The static type of a container, so that a List[int] arrives as a List[int]
# (and not as a list of anything) even when it is empty.
struct TypeDesc {
  kind @0 :TypeKind;
  elements @1 :List(TypeDesc);
}

struct DeviceValue {
  type @0 :Int16;   # c10::DeviceType
  index @1 :Int16;
}

struct Value {
  union {
    none @0 :Void;
    bool @1 :Bool;
    int @2 :Int64;
    double @3 :Float64;
    string @4 :Data;  # bytes: strings may hold anything
    tensor @5 :UInt32; # index into Envelope.tensors
    list @6 :ListValue;
    tuple @7 :List(Value);
    dict @8 :DictValue;
    device @9 :DeviceValue;
    rref @10 :RRefValue;
  }
}

# A remote reference: the value lives on `owner`; this copy is fork
# (forkWorker, forkLocal) of RRef (idWorker, idLocal), sent by `parent`.
struct RRefValue {
  owner @0 :Int32;
  idWorker @1 :Int32;
  idLocal @2 :UInt64;
  forkWorker @3 :Int32;
  forkLocal @4 :UInt64;
  parent @5 :Int32;
}

struct ListValue {
  elementType @0 :TypeDesc;
  items @1 :List(Value);
}

struct DictValue {
  keyType @0 :TypeDesc;
  valueType @1 :TypeDesc;
  keys @2 :List(Value);
  values @3 :List(Value);
}

struct TensorMeta {
  dtype @0 :Int16;          # c10::ScalarType
  sizes @1 :List(Int64);
  strides @2 :List(Int64);  # always contiguous on the wire
  device @3 :DeviceValue;   # where it lived on the sender
  byteLength @4 :UInt64;    # numel * itemsize, checked by the receiver
  requiresGrad @5 :Bool;    # with Envelope.autogradMessage the receiver records it; else a new leaf
  cudaIpc @6 :CudaIpc;      # set: the bytes are in the sender's device memory (same host), not the body
}

# A CUDA tensor's bytes in its sender's device memory (rpc/wire/device.h): the
# receiver opens the allocation, waits for the event, copies them, and
# releases the frame's buffers (Envelope.ipcToken) when its copies are done.
struct CudaIpc {
  memHandle @0 :Data;    # cudaIpcMemHandle_t of the allocation
  offset @1 :UInt64;     # where the bytes start in it
  eventHandle @2 :Data;  # cudaIpcEventHandle_t, recorded after the bytes were written
  allocBytes @3 :UInt64; # the allocation's size: the bytes must lie within it
}

struct ErrorInfo {
  code @0 :ErrorCode;
  worker @1 :Text;
  message @2 :Text;
}

struct Hello {
  worker @0 :Text;
  rank @1 :Int32;
  retiredToken @2 :Data;  # wire version 1 sent the token itself; never set now
  step @3 :UInt8;         # 1: dialer's nonce; 2: acceptor's nonce and proof; 3: dialer's proof
  nonce @4 :Data;
  proof @5 :Data;
}

struct Envelope {
  id @0 :UInt64;
  kind @1 :Kind;
  callee @2 :Text;
  timeoutMs @3 :UInt64;     # time left for the call when sent; 0 = none
  values @4 :List(Value);   # request: the arguments; response: one result
  tensors @5 :List(TensorMeta);
  error @6 :ErrorInfo;
  hello @7 :Hello;
  # Opaque to the RPC layer (the autograd layer gives them meaning): the
  # distributed autograd context the message belongs to (0 = none), and the
  # id pairing its recorded send and receive (0 = nothing recorded).
  autogradContext @8 :UInt64;
  autogradMessage @9 :UInt64;
  # With autogradMessage: the recorded sends (by message id) that a gradient
  # for this message would reach, transitively (see autograd/engine.h).
  autogradReach @10 :List(UInt64);
  # Nonzero when tensors travel by CUDA IPC: the sender holds their buffers
  # until the receiver releases this token.
  ipcToken @11 :UInt64;
}
