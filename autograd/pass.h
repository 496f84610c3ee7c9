#pragma once
// What a hook running inside this worker's part of a distributed backward
// pass may do: read and replace the context's gradient of a leaf, and run
// something when the part ends. AccumulateGrad post-hooks run there with the
// gradient just accumulated (autograd/engine.h); DDP's hybrid mode fills its
// buckets from them and writes the averages back before the part reports
// done, so a DistributedOptimizer step after backward() sees them.
//
// Every function but active() throws std::logic_error on a thread that is
// not running a node (or a part-end callback) of a distributed pass.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace tandem::autograd::pass {

bool active();
uint64_t context_id();
// The context's gradient of `leaf` on this worker (undefined when none yet).
at::Tensor gradient(const at::Tensor& leaf);
// Replaces it (the tensor is kept as given: no copy).
void set_gradient(const at::Tensor& leaf, at::Tensor grad);
// Runs `fn` once this worker's part has run all its nodes, before the part
// reports done, on the same thread, in the order queued. An exception from
// `fn` fails the pass with it.
void on_part_done(std::function<void()> fn);

}  // namespace tandem::autograd::pass
