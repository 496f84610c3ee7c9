// The collectives the sharded layers need beyond DDP's (ddp/process_group.h):
// all-gather into given tensors, reduce-scatter (NCCL's own, or an
// all-to-all and a local sum where Gloo has none), gather, bytes of any
// length, and the check that every rank holds the same description.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#ifdef TANDEM_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tandem/ddp/process_group.h"

namespace tandem::ddp {

c10::Device ProcessGroup::bytes_device() const {
#ifdef TANDEM_WITH_NCCL
  if (backend_ == "nccl") return c10::Device(c10::kCUDA, c10::cuda::current_device());
#endif
  return c10::Device(c10::kCPU);
}

ProcessGroup::Pending ProcessGroup::all_gather_async(const at::Tensor& tensor,
                                                     std::vector<at::Tensor> out,
                                                     std::chrono::milliseconds timeout) {
  check_tensor(tensor, "all_gather");
  if (static_cast<int>(out.size()) != size_) {
    throw std::invalid_argument("all_gather: " + std::to_string(out.size()) +
                                " output tensors for a group of " + std::to_string(size_));
  }
  for (const auto& o : out) {
    check_tensor(o, "all_gather");
    if (o.sizes() != tensor.sizes() || o.scalar_type() != tensor.scalar_type()) {
      throw std::invalid_argument(
          "all_gather: an output tensor's shape or dtype is not the input's");
    }
  }
  std::vector<std::vector<at::Tensor>> outs{std::move(out)};
  std::vector<at::Tensor> in{tensor};
  c10d::AllgatherOptions opts;
  opts.timeout = resolve(timeout);
  return pending(pg_->allgather(outs, in, opts), "all_gather", timeout);
}

ProcessGroup::Pending ProcessGroup::reduce_scatter_async(const at::Tensor& input, at::Tensor output,
                                                         ReduceOp op, std::vector<int64_t> counts,
                                                         std::chrono::milliseconds timeout) {
  check_tensor(input, "reduce_scatter");
  check_tensor(output, "reduce_scatter");
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) {
    throw std::invalid_argument(std::string("reduce_scatter: sums or averages, not ") +
                                to_string(op));
  }
  if (op == ReduceOp::kAvg && !at::isFloatingType(input.scalar_type())) {
    throw std::invalid_argument("reduce_scatter: avg needs a floating-point tensor, not " +
                                std::string(c10::toString(input.scalar_type())));
  }
  if (input.scalar_type() != output.scalar_type() || input.dim() != 1 || output.dim() != 1) {
    throw std::invalid_argument("reduce_scatter: input and output are flat tensors of one dtype");
  }
  const bool equal = counts.empty();
  if (equal) {
    if (input.numel() % size_ != 0) {
      throw std::invalid_argument("reduce_scatter: " + std::to_string(input.numel()) +
                                  " elements do not split into " + std::to_string(size_) +
                                  " equal pieces");
    }
    counts.assign(static_cast<size_t>(size_), input.numel() / size_);
  }
  if (static_cast<int>(counts.size()) != size_ ||
      std::any_of(counts.begin(), counts.end(), [](int64_t c) { return c < 0; }) ||
      std::accumulate(counts.begin(), counts.end(), int64_t{0}) != input.numel() ||
      counts[static_cast<size_t>(rank_)] != output.numel()) {
    throw std::invalid_argument(
        "reduce_scatter: the pieces' counts do not add up to the input "
        "or this rank's count is not the output's size");
  }
  const double scale = op == ReduceOp::kAvg ? 1.0 / size_ : 1.0;
  std::string what = std::string("reduce_scatter(") + to_string(op) + ")";
  if (backend_ == "nccl" && equal) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = resolve(timeout);
    at::Tensor out = output;
    at::Tensor in = input;
    Pending p = pending(pg_->_reduce_scatter_base(out, in, opts), what, timeout);
    if (scale != 1.0) p.then_ = [out, scale]() mutable { out.mul_(scale); };
    return p;
  }
  // Every rank sends piece r to rank r and gets back everyone's piece of its
  // own. 16-bit floats are summed in float32; on Gloo, which has no
  // bfloat16, their words travel as float16's (an all-to-all only moves them).
  const int64_t mine = counts[static_cast<size_t>(rank_)];
  at::Tensor received = at::empty({mine * size_}, output.options());
  std::vector<int64_t> in_splits(counts.begin(), counts.end());
  std::vector<int64_t> out_splits(static_cast<size_t>(size_), mine);
  c10d::AllToAllOptions opts;
  opts.timeout = resolve(timeout);
  const bool half_words = input.scalar_type() == at::kBFloat16 && backend_ == "gloo";
  at::Tensor in = half_words ? input.view(at::kHalf) : input;
  at::Tensor into = half_words ? received.view(at::kHalf) : received;
  Pending p = pending(pg_->alltoall_base(into, in, out_splits, in_splits, opts), what, timeout);
  p.then_ = [received, output, mine, n = size_, scale]() mutable {
    if (mine == 0) return;
    at::Tensor parts = received.view({n, mine});
    if (output.scalar_type() == at::kHalf || output.scalar_type() == at::kBFloat16) {
      at::Tensor sum = parts.to(at::kFloat).sum(0);
      if (scale != 1.0) sum.mul_(scale);
      output.copy_(sum);
    } else {
      at::sum_out(output, parts, {0});
      if (scale != 1.0) output.mul_(scale);
    }
    parts = at::Tensor();
    release_buffer(received);  // (the all-to-all's work still holds it)
  };
  return p;
}

std::vector<at::Tensor> ProcessGroup::gather(const at::Tensor& tensor, int dst,
                                             std::chrono::milliseconds timeout) {
  check_tensor(tensor, "gather");
  if (dst < 0 || dst >= size_) {
    throw std::invalid_argument("gather: destination rank " + std::to_string(dst) +
                                " is not in [0, " + std::to_string(size_) + ")");
  }
  std::vector<std::vector<at::Tensor>> out(1);
  if (rank_ == dst) {
    for (int r = 0; r < size_; ++r) out[0].push_back(at::empty_like(tensor));
  } else {
    out.clear();
  }
  std::vector<at::Tensor> in{tensor};
  c10d::GatherOptions opts;
  opts.rootRank = dst;
  opts.timeout = resolve(timeout);
  pending(pg_->gather(out, in, opts), "gather to rank " + std::to_string(dst), timeout).wait();
  return rank_ == dst ? out[0] : std::vector<at::Tensor>{};
}

void release_buffer(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !t.is_cpu()) return;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(0);
}

namespace {

at::Tensor bytes_tensor(const std::string& s, int64_t size) {
  at::Tensor t = at::zeros({std::max<int64_t>(size, 1)}, at::kByte);
  std::copy(s.begin(), s.end(), t.data_ptr<uint8_t>());
  return t;
}

std::string string_of(at::Tensor t, int64_t size) {
  t = t.cpu();
  return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()),
                     static_cast<size_t>(size));
}

}  // namespace

std::vector<std::string> ProcessGroup::all_gather_bytes(const std::string& mine,
                                                        std::chrono::milliseconds timeout,
                                                        std::optional<c10::Device> where) {
  const c10::Device device = where ? *where : bytes_device();
  auto lens =
      all_gather(at::full({1}, static_cast<int64_t>(mine.size()), at::kLong).to(device), timeout);
  std::vector<int64_t> n;
  for (auto& l : lens) n.push_back(l.item<int64_t>());
  const int64_t longest = *std::max_element(n.begin(), n.end());
  auto all = all_gather(bytes_tensor(mine, longest).to(device), timeout);
  std::vector<std::string> out;
  for (size_t r = 0; r < all.size(); ++r) out.push_back(string_of(all[r], n[r]));
  return out;
}

std::vector<std::string> ProcessGroup::gather_bytes(const std::string& mine, int dst,
                                                    std::chrono::milliseconds timeout) {
  const c10::Device device = bytes_device();
  auto lens =
      all_gather(at::full({1}, static_cast<int64_t>(mine.size()), at::kLong).to(device), timeout);
  std::vector<int64_t> n;
  for (auto& l : lens) n.push_back(l.item<int64_t>());
  const int64_t longest = *std::max_element(n.begin(), n.end());
  auto all = gather(bytes_tensor(mine, longest).to(device), dst, timeout);
  std::vector<std::string> out;
  for (size_t r = 0; r < all.size(); ++r) out.push_back(string_of(all[r], n[r]));
  return out;
}

double ProcessGroup::clip_grad_norm(const std::vector<at::Tensor>& mine,
                                    const std::vector<at::Tensor>& scaled, double max_norm,
                                    const std::string& who, std::chrono::milliseconds timeout,
                                    ProcessGroup* also) {
  if (!(max_norm > 0) || !std::isfinite(max_norm)) {
    throw std::invalid_argument(who + ": max_norm must be a finite number > 0, not " +
                                std::to_string(max_norm));
  }
  c10::AutoGradMode no_grad(false);
  double squares = 0;
  for (const auto& g : mine) {
    if (g.defined()) squares += g.to(at::kDouble).pow(2).sum().item<double>();
  }
  // Summed where the gradients are (the CPU for gloo, their GPU for nccl).
  c10::Device device = bytes_device();
  for (const auto& g : scaled) {
    if (g.defined()) {
      device = g.device();
      break;
    }
  }
  at::Tensor sum = at::tensor({squares}, at::kDouble).to(device);
  if (size_ > 1) all_reduce(sum, ReduceOp::kSum, timeout);
  if (also && also->size() > 1) also->all_reduce(sum, ReduceOp::kSum, timeout);
  const double total = std::sqrt(sum.cpu().item<double>());
  const double coef = max_norm / (total + 1e-6);  // as LibTorch's clip_grad_norm_
  if (coef < 1) {
    for (auto g : scaled) {
      if (g.defined()) g.mul_(coef);
    }
  }
  return total;
}

void ProcessGroup::expect_same_lines(const std::vector<std::string>& lines, const std::string& who,
                                     const std::string& what, const std::string& item,
                                     const std::string& hint, std::chrono::milliseconds timeout,
                                     std::optional<c10::Device> device) {
  std::string mine;
  for (const auto& l : lines) mine += l + "\n";
  auto all = all_gather_bytes(mine, timeout, device);
  auto split = [](const std::string& text) {
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t nl; (nl = text.find('\n', start)) != std::string::npos; start = nl + 1) {
      out.push_back(text.substr(start, nl - start));
    }
    return out;
  };
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    auto a = split(all[0]), b = split(all[r]);
    size_t k = 0;
    while (k < a.size() && k < b.size() && a[k] == b[k]) ++k;
    auto has = [&](const std::vector<std::string>& l, size_t rank) {
      return "rank " + std::to_string(rank) + " has " +
             (k < l.size() ? l[k]
                           : "no entry #" + std::to_string(k) + " (" + std::to_string(l.size()) +
                                 " in all)");
    };
    throw std::invalid_argument(who + ": the ranks' " + what + " differ at " + item + " #" +
                                std::to_string(k) + ": " + has(a, 0) + ", " + has(b, r) + " (" +
                                hint + ")");
  }
}

}  // namespace tandem::ddp
