#pragma once
// Collectives that autograd differentiates: what tensor and sequence
// parallelism are built from (Megatron-LM's mappings between regions,
// PyTorch 2's functional collectives). Each runs over a process group (a
// mesh dimension, ddp/process_group.h) and is an autograd function, so
// LibTorch's engine and Tandem's distributed one (autograd/engine.h) both
// run its backward, which is a collective too.
//
//   auto tp = mesh.group("tp");
//   at::Tensor x = parallel::copy_to_region(input, tp);     // f: identity, then all-reduce
//   at::Tensor y = at::linear(x, w_shard);                   // a column-parallel product
//   at::Tensor z = parallel::reduce_from_region(y2, tp);     // g: all-reduce, then identity
//
// What each does, forward and backward (the backward is the forward's
// adjoint, so a distributed model's gradients are those of the whole one):
//
//  | function                          | forward                     | backward                   |
//  |-----------------------------------|-----------------------------|----------------------------|
//  | all_reduce                        | sum over the group          | sum over the group         |
//  | all_gather(dim)                   | the ranks' pieces, joined   | reduce-scatter along dim   |
//  | reduce_scatter(dim)               | sum, this rank's piece      | all-gather along dim       |
//  | copy_to_region                    | identity                    | sum over the group         |
//  | reduce_from_region                | sum over the group          | identity                   |
//  | gather_from_region(dim)           | the ranks' pieces, joined   | this rank's piece          |
//  | scatter_to_region(dim)            | this rank's piece           | the ranks' pieces, joined  |
//
// The last four are Megatron's conjugate pairs for a region whose values
// (and gradients) are the same on every rank: there the adjoint of a sum
// is a copy, and of a join this rank's piece. all_gather and
// reduce_scatter are sequence parallelism's (activations split along the
// sequence between the tensor-parallel regions).
//
// Promises:
//  1. Every rank of the group calls the same collectives in the same order
//     (forward as written; backward in the reverse order of the graph, as
//     both engines run it), as for any collective.
//  2. A piece is size(dim) / group size elements along `dim`, rank r's the
//     r-th; a size that does not divide is std::invalid_argument naming the
//     dimension, its size and the group's. Tensors of any floating dtype,
//     on the group's device (CPU for gloo).
//  3. A failed collective throws ddp::CollectiveError as the group's own
//     do, naming the rank that is gone or stalled; in backward, the
//     backward fails with it.
//  4. With a group of one, each is the identity (no communication).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

namespace tandem::ddp {
class ProcessGroup;
}

namespace tandem::parallel {

using Group = std::shared_ptr<ddp::ProcessGroup>;

at::Tensor all_reduce(const at::Tensor& x, const Group& group);
at::Tensor all_gather(const at::Tensor& x, int64_t dim, const Group& group);
at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const Group& group);

at::Tensor copy_to_region(const at::Tensor& x, const Group& group);
at::Tensor reduce_from_region(const at::Tensor& x, const Group& group);
at::Tensor gather_from_region(const at::Tensor& x, int64_t dim, const Group& group);
at::Tensor scatter_to_region(const at::Tensor& x, int64_t dim, const Group& group);

// The plain (not differentiated) pieces the functions above are made of,
// for layers that need them outside autograd: rank `rank`'s piece of `x`
// along `dim` (a view), and the check of 2.
at::Tensor piece_of(const at::Tensor& x, int64_t dim, int rank, int size);
void check_divides(const at::Tensor& x, int64_t dim, int size, const char* what);

// Where rank `rank` of `size` starts, and how many, when `total` items
// (a vocabulary's words, a layer's outputs) are cut into pieces that
// differ by at most one, the first total % size one longer: a total that
// divides gives the equal pieces of 2.
struct Range {
  int64_t start = 0, length = 0;
  int64_t end() const { return start + length; }
};
Range range_of(int64_t total, int rank, int size);
// Rank `rank`'s piece of `x` along `dim` by range_of (a view).
at::Tensor uneven_piece_of(const at::Tensor& x, int64_t dim, int rank, int size);

}  // namespace tandem::parallel
