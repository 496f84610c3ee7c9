// Collectives that autograd differentiates (parallel/collectives.h).
//
// Each function computes its result without recording, then, when autograd
// wants the input's gradient, hangs one node on the result whose backward is
// the adjoint collective. The node is an ordinary LibTorch Node, so the
// local engine and Tandem's distributed one run it alike.
#include "tandem/parallel/collectives.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tandem/ddp/process_group.h"
#include "tandem/parallel/node.h"

namespace tandem::parallel {

namespace {

using torch::autograd::variable_list;

// The backward of one mapping: `adjoint` of the incoming gradient. A
// gradient that does not come (an output the loss does not use, on this
// rank) is taken as zeros, so that every rank still joins the collective.
class MappingBackward final : public torch::autograd::Node {
 public:
  using Adjoint = std::function<at::Tensor(const at::Tensor&)>;
  MappingBackward(std::string name, Adjoint adjoint, std::vector<int64_t> sizes,
                  at::TensorOptions options, torch::autograd::edge_list&& next)
      : Node(std::move(next)),
        name_(std::move(name)),
        adjoint_(std::move(adjoint)),
        sizes_(std::move(sizes)),
        options_(options) {}

  variable_list apply(variable_list&& grads) override {
    at::Tensor g = grads.empty() ? at::Tensor() : grads[0];
    if (!g.defined()) g = at::zeros(sizes_, options_);
    return {adjoint_(g)};
  }
  std::string name() const override { return name_; }

 private:
  std::string name_;
  Adjoint adjoint_;
  std::vector<int64_t> sizes_;
  at::TensorOptions options_;
};

}  // namespace

void check_group(const Group& group, const char* what) {
  if (!group) throw std::invalid_argument(std::string(what) + ": no process group");
}

int64_t checked_dim(const at::Tensor& x, int64_t dim, const char* what) {
  const int64_t n = x.dim();
  if (dim < -n || dim >= n) {
    throw std::invalid_argument(std::string(what) + ": dimension " + std::to_string(dim) +
                                " is out of range for a tensor of " + std::to_string(n) +
                                " dimension(s)");
  }
  return dim < 0 ? dim + n : dim;
}

void check_input(const at::Tensor& x, const char* what) {
  if (!x.defined()) throw std::invalid_argument(std::string(what) + ": the tensor is undefined");
}

at::Tensor with_backward(const at::Tensor& x, at::Tensor out, const char* name,
                         std::function<at::Tensor(const at::Tensor&)> adjoint) {
  if (!(at::GradMode::is_enabled() && x.requires_grad())) return out;
  auto node = std::make_shared<MappingBackward>(name, std::move(adjoint), out.sizes().vec(),
                                                out.options(),
                                                torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(out, node);
  return out;
}

namespace {

// ---- the plain collectives, on tensors without history ----

at::Tensor summed(const at::Tensor& x, ddp::ProcessGroup& g) {
  at::Tensor y = x.contiguous().clone();
  g.all_reduce(y, ddp::ReduceOp::kSum);
  return y;
}

at::Tensor gathered(const at::Tensor& x, int64_t dim, ddp::ProcessGroup& g) {
  std::vector<at::Tensor> pieces = g.all_gather(x.contiguous());
  at::Tensor whole = at::cat(pieces, dim);
  // (the pieces' memory back now: Gloo's thread lets go of them only a
  // moment later, and under sequence parallelism they are the size of the
  // activation)
  for (const at::Tensor& piece : pieces) ddp::release_buffer(piece);
  return whole;
}

at::Tensor scattered_sum(const at::Tensor& x, int64_t dim, ddp::ProcessGroup& g) {
  // The pieces end to end: `dim` first, made contiguous.
  const at::Tensor moved = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] /= g.size();
  at::Tensor out = at::empty(shape, moved.options());
  at::Tensor flat = out.view(-1);
  g.reduce_scatter_async(moved.view(-1), flat, ddp::ReduceOp::kSum).wait();
  // (a copy of our own: its memory back now, as gathered()'s pieces)
  if (!moved.is_alias_of(x)) ddp::release_buffer(moved);
  return out.movedim(0, dim);
}

// A result without history that shares no version counter with `x` (an
// identity's output gets its own grad_fn).
at::Tensor fresh(const at::Tensor& x) { return x.variable_data(); }

}  // namespace

at::Tensor gather_plain(const at::Tensor& x, int64_t dim, ddp::ProcessGroup& g) {
  return gathered(x, dim, g);
}
at::Tensor reduce_scatter_plain(const at::Tensor& x, int64_t dim, ddp::ProcessGroup& g) {
  return scattered_sum(x, dim, g);
}

void check_divides(const at::Tensor& x, int64_t dim, int size, const char* what) {
  if (x.size(dim) % size != 0) {
    throw std::invalid_argument(std::string(what) + ": dimension " + std::to_string(dim) +
                                " of size " + std::to_string(x.size(dim)) +
                                " does not split into " + std::to_string(size) +
                                " equal pieces (the group's size)");
  }
}

at::Tensor piece_of(const at::Tensor& x, int64_t dim, int rank, int size) {
  const int64_t chunk = x.size(dim) / size;
  return x.narrow(dim, rank * chunk, chunk);
}

Range range_of(int64_t total, int rank, int size) {
  const int64_t base = total / size, extra = total % size;
  Range r;
  r.length = base + (rank < extra ? 1 : 0);
  r.start = rank * base + std::min<int64_t>(rank, extra);
  return r;
}

at::Tensor uneven_piece_of(const at::Tensor& x, int64_t dim, int rank, int size) {
  const Range r = range_of(x.size(dim), rank, size);
  return x.narrow(dim, r.start, r.length);
}

at::Tensor all_reduce(const at::Tensor& x, const Group& group) {
  check_input(x, "all_reduce");
  check_group(group, "all_reduce");
  if (group->size() == 1) return x;
  return with_backward(x, summed(x.detach(), *group), "tandem::parallel::AllReduceBackward",
                       [group](const at::Tensor& g) { return summed(g, *group); });
}

at::Tensor all_gather(const at::Tensor& x, int64_t dim, const Group& group) {
  check_input(x, "all_gather");
  check_group(group, "all_gather");
  dim = checked_dim(x, dim, "all_gather");
  if (group->size() == 1) return x;
  return with_backward(x, gathered(x.detach(), dim, *group), "tandem::parallel::AllGatherBackward",
                       [group, dim](const at::Tensor& g) { return scattered_sum(g, dim, *group); });
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim, const Group& group) {
  check_input(x, "reduce_scatter");
  check_group(group, "reduce_scatter");
  dim = checked_dim(x, dim, "reduce_scatter");
  check_divides(x, dim, group->size(), "reduce_scatter");
  if (group->size() == 1) return x;
  return with_backward(x, scattered_sum(x.detach(), dim, *group),
                       "tandem::parallel::ReduceScatterBackward",
                       [group, dim](const at::Tensor& g) { return gathered(g, dim, *group); });
}

at::Tensor copy_to_region(const at::Tensor& x, const Group& group) {
  check_input(x, "copy_to_region");
  check_group(group, "copy_to_region");
  if (group->size() == 1) return x;
  return with_backward(x, fresh(x.detach()), "tandem::parallel::CopyToRegionBackward",
                       [group](const at::Tensor& g) { return summed(g, *group); });
}

at::Tensor reduce_from_region(const at::Tensor& x, const Group& group) {
  check_input(x, "reduce_from_region");
  check_group(group, "reduce_from_region");
  if (group->size() == 1) return x;
  return with_backward(x, summed(x.detach(), *group), "tandem::parallel::ReduceFromRegionBackward",
                       [](const at::Tensor& g) { return g; });
}

at::Tensor gather_from_region(const at::Tensor& x, int64_t dim, const Group& group) {
  check_input(x, "gather_from_region");
  check_group(group, "gather_from_region");
  dim = checked_dim(x, dim, "gather_from_region");
  if (group->size() == 1) return x;
  const int rank = group->rank(), size = group->size();
  return with_backward(x, gathered(x.detach(), dim, *group),
                       "tandem::parallel::GatherFromRegionBackward",
                       [dim, rank, size](const at::Tensor& g) {
                         return piece_of(g, dim, rank, size).contiguous();
                       });
}

at::Tensor scatter_to_region(const at::Tensor& x, int64_t dim, const Group& group) {
  check_input(x, "scatter_to_region");
  check_group(group, "scatter_to_region");
  dim = checked_dim(x, dim, "scatter_to_region");
  check_divides(x, dim, group->size(), "scatter_to_region");
  if (group->size() == 1) return x;
  const at::Tensor mine = piece_of(x.detach(), dim, group->rank(), group->size()).contiguous();
  return with_backward(x, mine, "tandem::parallel::ScatterToRegionBackward",
                       [group, dim](const at::Tensor& g) { return gathered(g, dim, *group); });
}

}  // namespace tandem::parallel
