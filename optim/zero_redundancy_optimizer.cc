// ZeroRedundancyOptimizer (optim/zero_redundancy_optimizer.h): the
// partition, the step and the all-gather that follows it, clipping, and the
// two kinds of checkpoint.
#include "tandem/optim/zero_redundancy_optimizer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <unordered_map>

#include "tandem/optim/owner/local_optimizer.h"

namespace tandem::optim {
namespace {

constexpr int64_t kLocalStateVersion = 1;

void from_bytes(torch::serialize::InputArchive& archive, const std::string& bytes,
                const std::string& what) {
  try {
    archive.load_from(bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    throw std::invalid_argument("ZeroRedundancyOptimizer: " + what +
                                " is not a LibTorch archive: " + e.what_without_backtrace());
  }
}

}  // namespace

std::vector<int> zero_partition(const std::vector<int64_t>& numels, int world_size) {
  if (world_size < 1) throw std::invalid_argument("zero_partition: world_size < 1");
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> sizes(static_cast<size_t>(world_size), 0);
  std::vector<int> owner(numels.size(), 0);
  for (size_t i : order) {
    const auto r =
        static_cast<size_t>(std::min_element(sizes.begin(), sizes.end()) - sizes.begin());
    owner[i] = static_cast<int>(r);
    sizes[r] += numels[i];
  }
  return owner;
}

struct ZeroRedundancyOptimizer::Impl {
  std::shared_ptr<ddp::ProcessGroup> group;
  Kind kind;
  Options options;
  ZeroOptions zero;
  std::vector<at::Tensor> params;
  std::vector<int> owners;
  std::vector<std::vector<size_t>> shares;  // per rank, largest first (PyTorch's order)
  std::unique_ptr<torch::optim::Optimizer> local;
  std::string consolidated;
  int consolidated_on = -1;

  int rank() const { return group->rank(); }
  int size() const { return group->size(); }

  std::vector<at::Tensor> share_tensors(int r) const {
    std::vector<at::Tensor> out;
    for (size_t i : shares[static_cast<size_t>(r)]) out.push_back(params[i]);
    return out;
  }

  // A fresh LibTorch optimizer of our kind over rank r's share (null when empty).
  std::unique_ptr<torch::optim::Optimizer> make_local(int r) const {
    if (shares[static_cast<size_t>(r)].empty()) return nullptr;
    return owner::make_optimizer(kind, share_tensors(r), options);
  }

  void gather_params();
  void broadcast_params();
  void check_state_shapes(const torch::optim::Optimizer& opt, const std::vector<size_t>& which,
                          const std::string& what) const;
};

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params, Kind kind,
                                                 Options options, ZeroOptions zero)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.group = zero.group ? zero.group : ddp::default_group_ptr();
  m.kind = kind;
  m.options = options;
  m.zero = zero;
  if (!(zero.bucket_cap_mb > 0)) {
    throw std::invalid_argument("ZeroRedundancyOptimizer: bucket_cap_mb must be > 0");
  }
  if (params.empty()) throw std::invalid_argument("ZeroRedundancyOptimizer: no parameters");
  const bool nccl = m.group->backend() == "nccl";
  std::vector<std::string> lines;
  std::vector<int64_t> numels;
  // A parameter refused here is refused on every rank: its error goes into
  // the lines the ranks compare.
  std::string refused;
  try {
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      const std::string name = "parameter #" + std::to_string(i);
      if (!p.defined())
        throw std::invalid_argument("ZeroRedundancyOptimizer: " + name + " is undefined");
      if (!p.is_contiguous()) {
        throw std::invalid_argument("ZeroRedundancyOptimizer: " + name + " is not contiguous");
      }
      if (nccl != p.device().is_cuda()) {
        throw std::invalid_argument("ZeroRedundancyOptimizer: " + name + " is on " +
                                    p.device().str() + "; a " + m.group->backend() +
                                    " group takes " + (nccl ? "CUDA" : "CPU") + " tensors");
      }
      for (size_t j = 0; j < i; ++j) {
        if (params[j].unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) {
          throw std::invalid_argument("ZeroRedundancyOptimizer: " + name + " is #" +
                                      std::to_string(j) + " again");
        }
      }
      lines.push_back(c10::str(p.sizes()) + " " + c10::toString(p.scalar_type()));
      numels.push_back(p.numel());
    }
  } catch (const std::invalid_argument& e) {
    refused = e.what();
    lines = {"an error: " + refused};
  }
  m.group->expect_same_lines(
      lines, "ZeroRedundancyOptimizer", "parameters", "parameter",
      "every rank must pass the same parameters in the same order", zero.timeout,
      params.front().defined() ? params.front().device() : c10::Device(c10::kCPU));
  if (!refused.empty()) throw std::invalid_argument(refused);
  m.params = std::move(params);
  m.owners = zero_partition(numels, m.size());
  // Each share in PyTorch's order: largest first, equal sizes as given.
  std::vector<size_t> order(m.params.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  m.shares.assign(static_cast<size_t>(m.size()), {});
  for (size_t i : order) m.shares[static_cast<size_t>(m.owners[i])].push_back(i);
  m.local = m.make_local(m.rank());
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::step() {
  Impl& m = *impl_;
  {
    c10::AutoGradMode no_grad(false);
    if (m.local) m.local->step();
  }
  m.consolidated.clear();
  m.consolidated_on = -1;
  if (m.size() > 1) {
    if (m.group->backend() == "gloo") {
      m.broadcast_params();
    } else {
      m.gather_params();
    }
  }
}

// Gloo: each parameter broadcast from the rank that stepped it, straight
// into every rank's tensor, all of them in flight at once (as PyTorch's
// ZeroRedundancyOptimizer does by default). Nothing is packed, allocated or
// unpacked; Gloo's all-gather, which LibTorch runs through flat copies of
// its own, took 4 to 6 times as long (bench/zero_bench, zero1 on 2 ranks:
// 560 to 780 ms against 90 to 135 ms for 50 M parameters).
void ZeroRedundancyOptimizer::Impl::broadcast_params() {
  c10::AutoGradMode no_grad(false);
  // (the parameters are contiguous: the constructor refuses others)
  std::vector<ddp::ProcessGroup::Pending> flights;
  try {
    for (int r = 0; r < size(); ++r) {
      for (size_t i : shares[static_cast<size_t>(r)]) {
        if (params[i].numel() == 0) continue;
        at::Tensor p = params[i].detach();
        // Gloo 1.x has no bfloat16: its 2-byte words travel as float16's.
        if (p.scalar_type() == at::kBFloat16) p = p.view(at::kHalf);
        flights.push_back(group->broadcast_async(p, r, zero.timeout));
      }
    }
  } catch (...) {
    // This rank cannot issue the rest: what it launched is let go, and the
    // group is broken for every later collective.
    for (auto& f : flights) f.abandon();
    throw;
  }
  std::exception_ptr failed;
  for (auto& f : flights) {
    if (failed) {
      f.abandon();
      continue;
    }
    try {
      f.wait();
    } catch (...) {
      failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
}

// NCCL: per dtype, every rank's share flattened (padded to the largest
// share) and all-gathered a bucket at a time, two buckets in flight; each
// rank copies the others' parameters out of what arrives.
void ZeroRedundancyOptimizer::Impl::gather_params() {
  c10::AutoGradMode no_grad(false);
  const int n = size();
  std::vector<at::ScalarType> dtypes;
  for (const auto& p : params) {
    if (std::find(dtypes.begin(), dtypes.end(), p.scalar_type()) == dtypes.end()) {
      dtypes.push_back(p.scalar_type());
    }
  }
  for (at::ScalarType dtype : dtypes) {
    // Each rank's parameters of this dtype, in its share's order, and their total.
    std::vector<std::vector<size_t>> of(static_cast<size_t>(n));
    std::vector<int64_t> total(static_cast<size_t>(n), 0);
    for (int r = 0; r < n; ++r) {
      for (size_t i : shares[static_cast<size_t>(r)]) {
        if (params[i].scalar_type() != dtype) continue;
        of[static_cast<size_t>(r)].push_back(i);
        total[static_cast<size_t>(r)] += params[i].numel();
      }
    }
    const int64_t longest = *std::max_element(total.begin(), total.end());
    if (longest == 0) continue;
    const at::Tensor& like =
        params[of[static_cast<size_t>(std::max_element(total.begin(), total.end()) - total.begin())]
                   .front()];
    at::Tensor mine = at::zeros({longest}, like.options());
    {
      int64_t pos = 0;
      for (size_t i : of[static_cast<size_t>(rank())]) {
        mine.narrow(0, pos, params[i].numel()).copy_(params[i].reshape({-1}));
        pos += params[i].numel();
      }
    }
    const int64_t chunk =
        std::max<int64_t>(1, static_cast<int64_t>(zero.bucket_cap_mb * 1024 * 1024) /
                                 static_cast<int64_t>(like.element_size()));
    const int64_t chunks = (longest + chunk - 1) / chunk;
    struct InFlight {
      ddp::ProcessGroup::Pending pending;
      at::Tensor out;  // [n, len]
      int64_t start = 0, len = 0;
    };
    auto launch = [&](int64_t k) {
      InFlight f;
      f.start = k * chunk;
      f.len = std::min(chunk, longest - f.start);
      f.out = at::empty({n, f.len}, like.options());
      // Gloo 1.x has no bfloat16: its 2-byte words travel as float16's.
      const bool as_half = dtype == at::kBFloat16 && group->backend() == "gloo";
      std::vector<at::Tensor> outs;
      for (int r = 0; r < n; ++r) outs.push_back(as_half ? f.out[r].view(at::kHalf) : f.out[r]);
      at::Tensor in = mine.narrow(0, f.start, f.len);
      f.pending = group->all_gather_async(as_half ? in.view(at::kHalf) : in, outs, zero.timeout);
      return f;
    };
    // What arrived for elements [start, start + len) of each rank's flat share.
    auto unpack = [&](const InFlight& f) {
      for (int r = 0; r < n; ++r) {
        if (r == rank()) continue;
        int64_t pos = 0;  // where parameter i starts in rank r's flat share
        for (size_t i : of[static_cast<size_t>(r)]) {
          const int64_t numel = params[i].numel();
          const int64_t lo = std::max(pos, f.start), hi = std::min(pos + numel, f.start + f.len);
          if (lo < hi) {
            params[i]
                .view({-1})
                .narrow(0, lo - pos, hi - lo)
                .copy_(f.out[r].narrow(0, lo - f.start, hi - lo));
          }
          pos += numel;
          if (pos >= f.start + f.len) break;
        }
      }
    };
    InFlight current = launch(0);
    for (int64_t k = 0; k < chunks; ++k) {
      InFlight next;
      if (k + 1 < chunks) next = launch(k + 1);
      try {
        current.pending.wait();
      } catch (...) {
        if (next.pending.valid()) next.pending.abandon();
        throw;
      }
      unpack(current);
      current = std::move(next);
    }
  }
}

void ZeroRedundancyOptimizer::zero_grad(bool set_to_none) {
  for (auto& p : impl_->params) {
    at::Tensor& g = p.mutable_grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      g = at::Tensor();
    } else {
      g = g.detach();
      g.zero_();
    }
  }
}

double ZeroRedundancyOptimizer::clip_grad_norm(double max_norm) {
  return clip_grad_norm(max_norm, ddp::ClipOptions{});
}

double ZeroRedundancyOptimizer::clip_grad_norm(double max_norm, const ddp::ClipOptions& options) {
  Impl& m = *impl_;
  std::vector<at::Tensor> mine, all;
  for (size_t i : m.shares[static_cast<size_t>(m.rank())]) {
    if (!options.counted || options.counted(m.params[i])) mine.push_back(m.params[i].grad());
  }
  for (const auto& p : m.params) all.push_back(p.grad());
  return m.group->clip_grad_norm(mine, all, max_norm, "ZeroRedundancyOptimizer::clip_grad_norm",
                                 m.zero.timeout, options.group.get());
}

double ZeroRedundancyOptimizer::lr() const { return impl_->options.lr; }

void ZeroRedundancyOptimizer::set_lr(double lr) {
  if (!(lr >= 0) || !std::isfinite(lr)) {
    throw std::invalid_argument("ZeroRedundancyOptimizer::set_lr: " + std::to_string(lr) +
                                " is not a finite number >= 0");
  }
  impl_->options.lr = lr;
  if (impl_->local) owner::set_lr(*impl_->local, lr);
  impl_->consolidated.clear();  // consolidate again to see the new rate
  impl_->consolidated_on = -1;
}

Kind ZeroRedundancyOptimizer::kind() const { return impl_->kind; }
int ZeroRedundancyOptimizer::rank() const { return impl_->rank(); }
int ZeroRedundancyOptimizer::world_size() const { return impl_->size(); }
const std::vector<at::Tensor>& ZeroRedundancyOptimizer::params() const { return impl_->params; }
const std::vector<int>& ZeroRedundancyOptimizer::owners() const { return impl_->owners; }

const std::vector<size_t>& ZeroRedundancyOptimizer::share(int r) const {
  if (r < 0 || r >= impl_->size()) {
    throw std::invalid_argument("ZeroRedundancyOptimizer::share: rank " + std::to_string(r) +
                                " is not in [0, " + std::to_string(impl_->size()) + ")");
  }
  return impl_->shares[static_cast<size_t>(r)];
}

int64_t ZeroRedundancyOptimizer::state_bytes() const {
  const Impl& m = *impl_;
  if (!m.local) return 0;
  int64_t bytes = 0;
  for (size_t i : m.shares[static_cast<size_t>(m.rank())]) {
    if (const auto* s = owner::find_state(*m.local, m.params[i])) {
      for (const auto& t : owner::state_tensors(*s)) {
        if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
      }
    }
  }
  return bytes;
}

torch::optim::Optimizer* ZeroRedundancyOptimizer::local_optimizer() { return impl_->local.get(); }

std::function<int(const at::Tensor&)> ZeroRedundancyOptimizer::gradient_owner() const {
  auto owner_of = std::make_shared<std::unordered_map<const c10::TensorImpl*, int>>();
  for (size_t i = 0; i < impl_->params.size(); ++i) {
    (*owner_of)[impl_->params[i].unsafeGetTensorImpl()] = impl_->owners[i];
  }
  return [owner_of](const at::Tensor& param) {
    auto it = owner_of->find(param.unsafeGetTensorImpl());
    return it == owner_of->end() ? -1 : it->second;
  };
}

// ---- checkpoints ----

void ZeroRedundancyOptimizer::Impl::check_state_shapes(const torch::optim::Optimizer& opt,
                                                       const std::vector<size_t>& which,
                                                       const std::string& what) const {
  for (size_t i : which) {
    const auto* s = owner::find_state(opt, params[i]);
    if (!s) continue;
    for (const auto& t : owner::state_tensors(*s)) {
      if (t.defined() && t.numel() > 1 && t.sizes() != params[i].sizes()) {
        throw std::invalid_argument("ZeroRedundancyOptimizer: " + what + " holds state of shape " +
                                    c10::str(t.sizes()) + " for parameter #" + std::to_string(i) +
                                    ", which has shape " + c10::str(params[i].sizes()));
      }
    }
  }
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  Impl& m = *impl_;
  if (to < 0 || to >= m.size()) {
    throw std::invalid_argument("ZeroRedundancyOptimizer::consolidate_state_dict: rank " +
                                std::to_string(to) + " is not in [0, " + std::to_string(m.size()) +
                                ")");
  }
  std::string mine;
  if (m.local) mine = owner::state_bytes(*m.local);
  auto parts = m.group->gather_bytes(mine, to, m.zero.timeout);
  m.consolidated.clear();
  m.consolidated_on = to;
  if (m.rank() != to) return;
  // LibTorch's optimizer over all the parameters, given each share's state:
  // every share's optimizer is over the same tensors, so the state moves by
  // its key.
  auto whole = owner::make_optimizer(m.kind, m.params, m.options);
  for (int r = 0; r < m.size(); ++r) {
    if (parts[static_cast<size_t>(r)].empty()) continue;
    auto part = m.make_local(r);
    torch::serialize::InputArchive a;
    from_bytes(a, parts[static_cast<size_t>(r)], "rank " + std::to_string(r) + "'s share");
    part->load(a);
    for (size_t i : m.shares[static_cast<size_t>(r)]) owner::move_state(*part, *whole, m.params[i]);
  }
  torch::serialize::OutputArchive out;
  whole->save(out);
  // LibTorch 1.x's load keeps its own options: the rate travels beside them
  // (LibTorch's load passes over the extra key).
  out.write("tandem_lr", c10::IValue(m.options.lr));
  m.consolidated = owner::archive_bytes(out);
}

std::string ZeroRedundancyOptimizer::state_dict() const {
  const Impl& m = *impl_;
  if (m.consolidated_on != m.rank()) {
    throw std::logic_error(
        m.consolidated_on < 0
            ? "ZeroRedundancyOptimizer::state_dict: call consolidate_state_dict(to) on every "
              "rank first (again after each step)"
            : "ZeroRedundancyOptimizer::state_dict: the state was consolidated on rank " +
                  std::to_string(m.consolidated_on) + ", this is rank " + std::to_string(m.rank()));
  }
  return m.consolidated;
}

void ZeroRedundancyOptimizer::load_state_dict(const std::string& archive) {
  Impl& m = *impl_;
  torch::serialize::InputArchive a;
  from_bytes(a, archive, "the state");
  auto whole = owner::make_optimizer(m.kind, m.params, m.options);
  try {
    whole->load(a);
  } catch (const c10::Error& e) {
    throw std::invalid_argument(
        "ZeroRedundancyOptimizer::load_state_dict: the state is not that of " + kind_name(m.kind) +
        " over these " + std::to_string(m.params.size()) +
        " parameters: " + e.what_without_backtrace());
  }
  std::vector<size_t> all(m.params.size());
  std::iota(all.begin(), all.end(), 0);
  m.check_state_shapes(*whole, all, "the state");
  auto fresh = m.make_local(m.rank());
  if (fresh) {
    for (size_t i : m.shares[static_cast<size_t>(m.rank())]) {
      owner::move_state(*whole, *fresh, m.params[i]);
    }
  }
  c10::IValue lr;
  if (a.try_read("tandem_lr", lr) && lr.isDouble() && lr.toDouble() >= 0) {
    m.options.lr = lr.toDouble();
  }
  if (fresh) owner::set_lr(*fresh, m.options.lr);
  m.local = std::move(fresh);
  m.consolidated.clear();
  m.consolidated_on = -1;
}

std::string ZeroRedundancyOptimizer::local_state_dict() const {
  const Impl& m = *impl_;
  torch::serialize::OutputArchive a;
  a.write("tandem_zero_version", c10::IValue(kLocalStateVersion));
  a.write("kind", c10::IValue(static_cast<int64_t>(m.kind)));
  a.write("rank", c10::IValue(static_cast<int64_t>(m.rank())));
  a.write("world_size", c10::IValue(static_cast<int64_t>(m.size())));
  a.write("lr", c10::IValue(m.options.lr));
  std::vector<int64_t> numels;
  for (const auto& p : m.params) numels.push_back(p.numel());
  a.write("numels", at::tensor(numels, at::kLong));
  a.write("owners", at::tensor(std::vector<int64_t>(m.owners.begin(), m.owners.end()), at::kLong));
  if (m.local) {
    torch::serialize::OutputArchive opt;
    m.local->save(opt);
    a.write("optimizer", opt);
  }
  return owner::archive_bytes(a);
}

void ZeroRedundancyOptimizer::load_local_state_dict(const std::string& archive) {
  Impl& m = *impl_;
  const std::string who = "ZeroRedundancyOptimizer::load_local_state_dict: ";
  torch::serialize::InputArchive a;
  from_bytes(a, archive, "the local state");
  auto read_int = [&](const char* key) {
    c10::IValue v;
    if (!a.try_read(key, v) || !v.isInt()) {
      throw std::invalid_argument(who + "the state has no '" + key +
                                  "' (it is not a ZeroRedundancyOptimizer's local state)");
    }
    return v.toInt();
  };
  if (int64_t v = read_int("tandem_zero_version"); v != kLocalStateVersion) {
    throw std::invalid_argument(who + "version " + std::to_string(v) + " (this build reads " +
                                std::to_string(kLocalStateVersion) + ")");
  }
  const int64_t kind = read_int("kind"), rank = read_int("rank"), world = read_int("world_size");
  if (kind != static_cast<int64_t>(m.kind)) {
    auto k = kind_from_number(kind);
    throw std::invalid_argument(who + "the state is of a " +
                                (k ? kind_name(*k) : "kind #" + std::to_string(kind)) +
                                ", this optimizer is a " + kind_name(m.kind));
  }
  if (rank != m.rank() || world != m.size()) {
    throw std::invalid_argument(who + "the state was saved by rank " + std::to_string(rank) +
                                " of " + std::to_string(world) + ", this is rank " +
                                std::to_string(m.rank()) + " of " + std::to_string(m.size()) +
                                " (a share loads only where its partition is the same; "
                                "consolidate_state_dict() for another layout)");
  }
  at::Tensor numels, owners;
  if (!a.try_read("numels", numels) || !a.try_read("owners", owners) ||
      numels.scalar_type() != at::kLong || owners.scalar_type() != at::kLong) {
    throw std::invalid_argument(who + "the state has no parameter sizes or owners");
  }
  if (numels.numel() != static_cast<int64_t>(m.params.size())) {
    throw std::invalid_argument(who + "the state is of " + std::to_string(numels.numel()) +
                                " parameters, this optimizer has " +
                                std::to_string(m.params.size()));
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    const int64_t saved = numels.data_ptr<int64_t>()[i];
    if (saved != m.params[i].numel()) {
      throw std::invalid_argument(who + "parameter #" + std::to_string(i) + " had " +
                                  std::to_string(saved) + " elements, it has " +
                                  std::to_string(m.params[i].numel()) + " here");
    }
    if (owners.numel() != numels.numel() || owners.data_ptr<int64_t>()[i] != m.owners[i]) {
      throw std::invalid_argument(who + "parameter #" + std::to_string(i) +
                                  " belonged to another rank when the state was saved");
    }
  }
  c10::IValue lr;
  if (!a.try_read("lr", lr) || !lr.isDouble() || !(lr.toDouble() >= 0)) {
    throw std::invalid_argument(who + "the state has no valid 'lr'");
  }
  // Loaded into a scratch optimizer, of which only the per-parameter state
  // is kept: a fresh one has this optimizer's options, whatever LibTorch's
  // load does with the saved ones.
  auto fresh = m.make_local(m.rank());
  torch::serialize::InputArchive opt;
  const bool has = a.try_read("optimizer", opt);
  if (fresh && has) {
    auto scratch = m.make_local(m.rank());
    try {
      scratch->load(opt);
    } catch (const c10::Error& e) {
      throw std::invalid_argument(
          who + "this rank's optimizer state does not load: " + e.what_without_backtrace());
    }
    m.check_state_shapes(*scratch, m.shares[static_cast<size_t>(m.rank())], "the local state");
    for (size_t i : m.shares[static_cast<size_t>(m.rank())]) {
      owner::move_state(*scratch, *fresh, m.params[i]);
    }
  } else if (fresh || has) {
    throw std::invalid_argument(who +
                                "the state and this rank disagree on whether it owns any "
                                "parameter");
  }
  m.options.lr = lr.toDouble();
  if (fresh) owner::set_lr(*fresh, m.options.lr);
  m.local = std::move(fresh);
  m.consolidated.clear();
  m.consolidated_on = -1;
}

}  // namespace tandem::optim
