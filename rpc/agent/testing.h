// Introspection of an agent for tests and tools: not part of the user's API.
#pragma once

#include "tandem/rpc/layer.h"

namespace tandem::rpc::testing {

// Calls in flight from this agent.
inline size_t pending_calls(const Agent& a) { return LayerAccess::pending_calls(a); }
// Connections open in the agent's transport.
inline size_t live_connections(const Agent& a) { return LayerAccess::live_connections(a); }
// Times this agent, the higher rank of a pair that dialed each other at
// once, took over the peer's connection from its own dial.
inline uint64_t crossed_connections(const Agent& a) { return LayerAccess::crossed_connections(a); }
// Closes the connection to `rank` as if the network dropped it.
inline void drop_connection(Agent& a, int rank) { LayerAccess::drop_connection(a, rank); }

// How many CUDA devices this process says it has (-1: the real number):
// agents started from now on publish it at their rendezvous, so that device
// maps can be checked on a machine without a GPU, and frames for those
// devices pass the decoder's check (placing their tensors then fails, as a
// CUDA error would). Nothing else about CUDA is faked.
void set_cuda_devices(int n);  // (defined in rpc/wire/device.cc)

}  // namespace tandem::rpc::testing
