// What the layer's files share, not installed: a result computed without
// recording, given a backward node of its own.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace tandem::ddp {
class ProcessGroup;
}

namespace tandem::parallel {

// `out`, computed from `x` without recording, with a backward node named
// `name` whose gradient for x is `adjoint` of out's, when autograd wants
// x's gradient (else `out` as it is). A gradient that does not come is
// taken as zeros of out's shape, so that every rank still runs the
// adjoint (a collective, for most).
at::Tensor with_backward(const at::Tensor& x, at::Tensor out, const char* name,
                         std::function<at::Tensor(const at::Tensor&)> adjoint);

// The layer's argument checks (std::invalid_argument starting with `what`):
// a group that is null; a dimension outside x's (returned non-negative);
// an undefined tensor.
void check_group(const std::shared_ptr<ddp::ProcessGroup>& group, const char* what);
int64_t checked_dim(const at::Tensor& x, int64_t dim, const char* what);
void check_input(const at::Tensor& x, const char* what);

// The plain collectives on tensors without history: the pieces of x along
// `dim` gathered from every rank, and x summed over the ranks and split
// along `dim`.
at::Tensor gather_plain(const at::Tensor& x, int64_t dim, ddp::ProcessGroup& g);
at::Tensor reduce_scatter_plain(const at::Tensor& x, int64_t dim, ddp::ProcessGroup& g);

}  // namespace tandem::parallel
