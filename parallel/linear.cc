// Megatron-LM's tensor-parallel linear layers (parallel/linear.h).
#include "tandem/parallel/linear.h"

#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <stdexcept>
#include <utility>
#include <vector>

#include "tandem/checkpoint/placement.h"
#include "tandem/ddp/process_group.h"
#include "tandem/parallel/node.h"

namespace tandem::parallel {

namespace {

// 6.
void check_split(int64_t size, const Group& group, const char* who, const char* what) {
  if (size < 1 || size % group->size() != 0) {
    throw std::invalid_argument(std::string(who) + ": " + what + " " + std::to_string(size) +
                                " does not split into " + std::to_string(group->size()) +
                                " equal pieces (the tensor-parallel group's size)");
  }
}

void check_stride(int64_t out, const Group& group, const ColumnParallelOptions& o) {
  if (o.stride < 1) {
    throw std::invalid_argument("ColumnParallelLinear: stride " + std::to_string(o.stride) +
                                " is not a number of blocks");
  }
  if (o.stride == 1) return;
  if (o.gather_output) {
    throw std::invalid_argument("ColumnParallelLinear: a stride of " + std::to_string(o.stride) +
                                " cannot gather its output (the pieces would join in another "
                                "order)");
  }
  if (out % (o.stride * group->size()) != 0) {
    throw std::invalid_argument("ColumnParallelLinear: out_features " + std::to_string(out) +
                                " does not split into " + std::to_string(o.stride) +
                                " blocks of " + std::to_string(group->size()) +
                                " equal pieces (stride x the tensor-parallel group's size)");
  }
}

torch::nn::Linear whole_linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// Rank r's piece of `t` along `dim`, as a parameter of its own.
at::Tensor slice(const at::Tensor& t, int64_t dim, const Group& g) {
  return piece_of(t.detach(), dim, g->rank(), g->size()).clone();
}

}  // namespace

// ---- column-parallel ----

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, Group group,
                                                   ColumnParallelOptions o)
    : group_(std::move(group)), options_(o), in_(in), out_(out) {
  check_group(group_, "ColumnParallelLinear");
  check_stride(out, group_, o);
  if (o.gather_output) check_split(out, group_, "ColumnParallelLinear", "out_features");
  if (out < group_->size()) {
    throw std::invalid_argument("ColumnParallelLinear: out_features " + std::to_string(out) +
                                " is fewer than the tensor-parallel group's " +
                                std::to_string(group_->size()) + " ranks");
  }
  // 3.: the whole layer, drawn as one process would, then this rank's rows.
  take_slice(whole_linear(in, out, o.bias));
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::Linear& whole, Group group,
                                                   ColumnParallelOptions o)
    : group_(std::move(group)), options_(o) {
  check_group(group_, "ColumnParallelLinear");
  in_ = whole->weight.size(1);
  out_ = whole->weight.size(0);
  options_.bias = whole->bias.defined();
  check_stride(out_, group_, options_);
  if (options_.gather_output) check_split(out_, group_, "ColumnParallelLinear", "out_features");
  take_slice(whole);
}

std::shared_ptr<ColumnParallelLinearImpl> ColumnParallelLinearImpl::from_whole(
    const torch::nn::Linear& whole, Group group, ColumnParallelOptions o) {
  return std::make_shared<ColumnParallelLinearImpl>(whole, std::move(group), o);
}

void ColumnParallelLinearImpl::take_slice(const torch::nn::Linear& whole) {
  // This rank's rows: range_of's where out divides or not (6.); with a
  // stride, its piece of each block. They are also where its pieces lie in
  // the whole parameters, for checkpoints (4.).
  const int n = group_->size(), r = group_->rank();
  std::vector<std::pair<int64_t, int64_t>> ranges;
  if (options_.stride == 1) {
    const Range mine = range_of(out_, r, n);
    ranges.emplace_back(mine.start, mine.end());
  } else {
    const int64_t block = out_ / options_.stride, share = block / n;
    for (int64_t k = 0; k < options_.stride; ++k) {
      ranges.emplace_back(k * block + r * share, k * block + (r + 1) * share);
    }
  }
  auto rows = [&](const at::Tensor& t) {
    std::vector<at::Tensor> pieces;
    for (const auto& [a, b] : ranges) pieces.push_back(t.detach().narrow(0, a, b - a));
    return at::cat(pieces).clone();
  };
  weight = register_parameter("weight", rows(whole->weight));
  if (options_.bias) bias = register_parameter("bias", rows(whole->bias));
  if (n == 1) return;
  checkpoint::set_placement(weight, {whole->weight.sizes().vec(), 0, ranges});
  if (options_.bias) checkpoint::set_placement(bias, {{out_}, 0, ranges});
}

namespace {

// Sequence parallelism's column-parallel product, as Megatron computes it:
// y = gather(x) W^T + b, keeping only x (this rank's piece of the
// sequence) for backward, which gathers it again for W's gradient and
// reduce-scatters the input's (two collectives, every rank in that order).
class GatheredLinearBackward final : public torch::autograd::Node {
 public:
  GatheredLinearBackward(at::Tensor x, at::Tensor weight, bool bias, int64_t dim, Group group,
                         std::vector<int64_t> out_sizes, at::TensorOptions out_options,
                         torch::autograd::edge_list&& next)
      : Node(std::move(next)),
        x_(std::move(x)),
        weight_(std::move(weight)),
        bias_(bias),
        dim_(dim),
        group_(std::move(group)),
        out_sizes_(std::move(out_sizes)),
        out_options_(out_options) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor g = grads.empty() ? at::Tensor() : grads[0];
    if (!g.defined()) g = at::zeros(out_sizes_, out_options_);
    const at::Tensor full = gather_plain(x_, dim_, *group_);
    const at::Tensor grad_x = reduce_scatter_plain(at::matmul(g, weight_), dim_, *group_);
    const int64_t out = g.size(-1), in = full.size(-1);
    const at::Tensor g2 = g.reshape({-1, out});
    at::Tensor grad_w = at::matmul(g2.t(), full.reshape({-1, in}));
    at::Tensor grad_b = bias_ ? g2.sum(0) : at::Tensor();
    release_variables();
    return {grad_x, grad_w, grad_b};
  }
  std::string name() const override { return "tandem::parallel::GatheredLinearBackward"; }
  void release_variables() override {
    x_ = at::Tensor();
    weight_ = at::Tensor();
  }

 private:
  at::Tensor x_, weight_;
  bool bias_;
  int64_t dim_;
  Group group_;
  std::vector<int64_t> out_sizes_;
  at::TensorOptions out_options_;
};

// (dim: checked, not negative)
at::Tensor gathered_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           int64_t dim, const Group& group) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = at::linear(gather_plain(x.detach(), dim, *group), weight.detach(),
                   bias.defined() ? bias.detach() : at::Tensor());
  }
  const bool wants = at::GradMode::is_enabled() &&
                     (x.requires_grad() || weight.requires_grad() ||
                      (bias.defined() && bias.requires_grad()));
  if (!wants) return y;
  torch::autograd::edge_list next = torch::autograd::collect_next_edges(x, weight);
  next.push_back(bias.defined() && bias.requires_grad() ? torch::autograd::impl::gradient_edge(bias)
                                                        : torch::autograd::Edge());
  auto node = std::make_shared<GatheredLinearBackward>(x.detach(), weight.detach(),
                                                       bias.defined(), dim, group, y.sizes().vec(),
                                                       y.options(), std::move(next));
  torch::autograd::set_history(y, node);
  return y;
}

}  // namespace

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor y;
  if (options_.sequence_parallel && group_->size() > 1) {
    check_input(x, "ColumnParallelLinear");
    y = gathered_linear(x, weight, bias, checked_dim(x, options_.sequence_dim, "ColumnParallelLinear"),
                        group_);
  } else {
    const at::Tensor input = options_.sequence_parallel
                                 ? all_gather(x, options_.sequence_dim, group_)
                                 : copy_to_region(x, group_);
    y = at::linear(input, weight, bias);
  }
  return options_.gather_output ? gather_from_region(y, -1, group_) : y;
}

int64_t ColumnParallelLinearImpl::split_dim(const std::string& name) const {
  return name == "weight" || name == "bias" ? 0 : -1;
}

// ---- row-parallel ----

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, Group group,
                                             RowParallelOptions o)
    : group_(std::move(group)), options_(o), in_(in), out_(out) {
  check_group(group_, "RowParallelLinear");
  check_split(in, group_, "RowParallelLinear", "in_features");
  take_slice(whole_linear(in, out, o.bias));
}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::Linear& whole, Group group,
                                             RowParallelOptions o)
    : group_(std::move(group)), options_(o) {
  check_group(group_, "RowParallelLinear");
  in_ = whole->weight.size(1);
  out_ = whole->weight.size(0);
  options_.bias = whole->bias.defined();
  check_split(in_, group_, "RowParallelLinear", "in_features");
  take_slice(whole);
}

std::shared_ptr<RowParallelLinearImpl> RowParallelLinearImpl::from_whole(
    const torch::nn::Linear& whole, Group group, RowParallelOptions o) {
  return std::make_shared<RowParallelLinearImpl>(whole, std::move(group), o);
}

void RowParallelLinearImpl::take_slice(const torch::nn::Linear& whole) {
  weight = register_parameter("weight", slice(whole->weight, 1, group_));
  if (options_.bias) bias = register_parameter("bias", whole->bias.detach().clone());
  const int n = group_->size(), r = group_->rank();
  if (n > 1) {
    if (bias.defined()) checkpoint::set_replica(bias, r);
    const int64_t share = in_ / n;
    checkpoint::set_placement(weight,
                              {whole->weight.sizes().vec(), 1, {{r * share, (r + 1) * share}}});
  }
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor input =
      options_.input_is_parallel ? x : scatter_to_region(x, -1, group_);
  const at::Tensor partial = at::linear(input, weight);
  at::Tensor y = options_.sequence_parallel
                     ? reduce_scatter(partial, options_.sequence_dim, group_)
                     : reduce_from_region(partial, group_);
  if (!bias.defined()) return y;
  return y + (sums_in_backward() ? copy_to_region(bias, group_) : bias);
}

bool RowParallelLinearImpl::sums_in_backward() const {
  return options_.sequence_parallel && options_.sum_partial_grads;
}

int64_t RowParallelLinearImpl::split_dim(const std::string& name) const {
  return name == "weight" ? 1 : -1;
}

std::vector<at::Tensor> RowParallelLinearImpl::partial_grad_parameters() const {
  if (options_.sequence_parallel && !options_.sum_partial_grads && bias.defined()) return {bias};
  return {};
}

void mark_replicated(torch::nn::Module& root, const Group& group) {
  check_group(group, "mark_replicated");
  if (group->size() == 1) return;
  for (const auto& p : root.parameters()) {
    if (!checkpoint::placement_of(p)) checkpoint::set_replica(p, group->rank());
  }
  for (const auto& b : root.buffers()) {
    if (!checkpoint::placement_of(b)) checkpoint::set_replica(b, group->rank());
  }
}

// ---- partial gradients ----

void all_reduce_partial_grads(torch::nn::Module& root, const Group& group) {
  check_group(group, "all_reduce_partial_grads");
  if (group->size() == 1) return;
  at::NoGradGuard no_grad;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    const auto* tp = dynamic_cast<const TensorParallelModule*>(m.get());
    if (!tp) continue;
    for (at::Tensor p : tp->partial_grad_parameters()) {
      // (a rank whose part got no gradient adds zeros: every rank joins)
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      at::Tensor g = p.mutable_grad();
      group->all_reduce(g, ddp::ReduceOp::kSum);
    }
  }
}

}  // namespace tandem::parallel
