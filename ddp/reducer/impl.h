// The Reducer's state (detail::Reducer::Impl, ddp/distributed_data_parallel.h),
// shared by the files that implement it:
//   ddp/reducer/setup.cc    construction: the options and devices checked,
//                           the ranks' models compared, rank 0's state taken,
//                           the first buckets and the gradient hooks;
//   ddp/reducer/buckets.cc  each backward: gradients into their buckets as
//                           their hooks fire, each bucket's reduction launched
//                           by its last gradient, unused parameters, the wait
//                           at the end; the order the buckets are rebuilt in;
//   ddp/reducer/join.cc     join(): the rounds a rank out of inputs shadows;
//   ddp/distributed_data_parallel.cc  the Reducer's other methods (forward's
//                           preparation, no_sync, stats).
// mark_ready() and finalize(), which autograd calls, take `mu` themselves;
// the Reducer's methods hold it while they call the rest. The hybrid mode
// (a backward inside a distributed autograd context, `hybrid`) takes
// gradients from and gives them back to the context (autograd/pass.h)
// instead of .grad.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/rpc/trace.h"

namespace tandem::ddp::detail {

using Clock = std::chrono::steady_clock;

// Rank 0's values of `tensors` on every rank, one broadcast per dtype.
void broadcast_coalesced(const std::vector<at::Tensor>& tensors, ProcessGroup& group,
                         std::chrono::milliseconds timeout, int src = 0);

struct Reducer::Impl {
  struct Param {
    std::string name;
    at::Tensor tensor;
    std::shared_ptr<torch::autograd::Node> accumulator;  // kept alive: it carries the hook
    uintptr_t hook_key = 0;
    size_t bucket = 0;
    int64_t offset = 0;  // elements into the bucket
    at::Tensor slot;     // the .grad it gets: an alias of its part of the bucket
    // Sharded gradients: the rank that keeps its average, where that lies
    // in the owner's piece of the bucket, the .grad it was given then, and
    // that gradient set aside at the next forward.
    int owner = -1;
    int64_t piece_offset = 0;
    at::Tensor reduced, carry;
    bool carried = false;  // the last synced backward added a carry to it
  };
  struct Bucket {
    at::Tensor buffer;  // sharded: only from its first gradient to the end of the backward
    std::vector<size_t> params;
    int64_t numel = 0;
    size_t element_size = 0;
    // Sharded: elements per owner (its params are grouped by owner), and
    // this rank's averaged piece.
    std::vector<int64_t> counts;
    at::Tensor piece;
    size_t pending = 0;
    BucketWork work;
    std::function<void()> trace;  // with tracing on, when on_completion could not take it
  };

  // Runs after a parameter's AccumulateGrad: its .grad is complete.
  struct ReadyHook final : torch::autograd::FunctionPostHook {
    ReadyHook(Impl* impl, size_t index) : impl(impl), index(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      impl->mark_ready(index);
      return outputs;
    }
    Impl* impl;
    size_t index;
  };

  // Sharded: runs before a parameter's AccumulateGrad, so that the average
  // its owner kept from the last sync is set aside before this backward's
  // gradient lands on it (LibTorch cannot remove a pre-hook: it reaches the
  // Impl through `alive`, cleared when the Reducer goes).
  struct SetAsideHook final : torch::autograd::FunctionPreHook {
    SetAsideHook(std::shared_ptr<std::atomic<Impl*>> alive, size_t index)
        : alive(std::move(alive)), index(index) {}
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list& grads) override {
      if (Impl* impl = alive->load()) {
        std::lock_guard<std::mutex> lock(impl->mu);
        impl->set_aside(index);
      }
      return grads;
    }
    std::shared_ptr<std::atomic<Impl*>> alive;
    size_t index;
  };

  Impl(std::shared_ptr<torch::nn::Module> m, DDPOptions o, ProcessGroup& g);
  std::shared_ptr<std::atomic<Impl*>> alive = std::make_shared<std::atomic<Impl*>>(this);

  std::shared_ptr<torch::nn::Module> module;
  DDPOptions opt;
  // Where the group's collectives take their tensors: the CPU for gloo, the
  // parameters' GPU for nccl (set by the constructor's checks).
  c10::Device comm_device{c10::kCPU};
  ProcessGroup* group;  // group_ of the Reducer
  std::vector<Param> params;
  std::vector<at::Tensor> buffers;
  std::vector<Bucket> buckets;
  std::shared_ptr<rpc::Tracer> tracer;  // null unless tracing
  uint64_t launches = 0;                // bucket allreduces started, for span ids

  mutable std::mutex mu;
  bool sync = true;       // the user's setting (no_sync turns it off)
  bool iter_sync = true;  // taken at forward: whether this backward averages
  bool in_backward = false;
  // This backward runs in the distributed engine (a context): gradients
  // come from and go back to the context, never .grad.
  bool hybrid = false;
  bool sharded = false;  // DDPOptions::gradient_owner is set
  std::vector<char> ready;
  size_t next_bucket = 0;
  bool record_order = true;  // until the buckets are rebuilt once
  bool rebuild_pending = false;
  bool rebuilt = false;
  std::vector<size_t> ready_order;
  // join(): whether a scope is open, the rounds counted so far (one per
  // forward of any rank still training), this rank's last real round.
  bool join_enabled = false;
  int64_t join_round = 0, last_real_round = -1;
  Clock::time_point first_hook, last_launch;
  double backward_ms = 0, tail_wait_ms = 0, allreduce_ms = 0;

  std::chrono::milliseconds timeout() const {
    return opt.timeout.count() < 0 ? group->timeout() : opt.timeout;
  }

  // ddp/reducer/setup.cc
  // The parameters then the buffers: what rank 0 (or the last trainer) hands out.
  std::vector<at::Tensor> state() const;

  // ddp/reducer/buckets.cc
  // Parameters in `order` into buckets of one dtype each, filled as
  // PyTorch fills them: a bucket takes parameters until it holds at least
  // its cap (first_bucket_mb for the first, bucket_cap_mb after), so the
  // parameter that crosses the cap is still in it. Each parameter's slot
  // aliases its part, and a gradient it already has is copied there.
  void build_buckets(const std::vector<size_t>& order);

  bool holds_slot(const Param& p) const;

  // Sharded: bucket b's buffer (zeros) and its parameters' slots, made at
  // its first gradient of a backward.
  void ensure_buffer(size_t b);
  // Sharded, after the buckets' reductions: each owned parameter's .grad
  // becomes its averaged piece (plus what was carried), the others' none,
  // and the buffers are freed.
  void keep_owned_grads();
  // Sharded: parameter i's gradient left from the last sync set aside (its
  // carry), when .grad still holds it.
  void set_aside(size_t i);

  // This rank's gradient of `p`: .grad, or in a distributed backward the
  // context's (undefined when there is none).
  at::Tensor local_grad(const Param& p) const;

  // The parameter's gradient in its slot (zeros when it has none), and .grad
  // pointing there; a context's gradient is only copied in.
  void gather_grad(Param& p);

  // find_unused_parameters: 1 for each parameter this rank has a gradient of
  // in this step (a joined rank: all 0), to be summed over the group after
  // the buckets, in the same order on every rank.
  at::Tensor used_map(bool joined) const;

  // After the first synced step: the buckets are rebuilt at the next forward.
  void first_sync_done();

  void launch_ready();

  void mark_ready(size_t i);

  // Ends an iteration that cannot complete: what was launched is waited for
  // (the group stays in step as far as this rank goes), errors dropped.
  void abandon_iteration();

  void reset_iteration();

  // Waits for every launched bucket, whatever happens; the first failure is rethrown.
  void wait_launched();

  void finalize();

  // The start of each forward (and of each round a joined rank shadows).
  void begin_iteration();

  // Rank 0's order of readiness (parameters it never saw come last, in
  // reverse order), on every rank.
  std::vector<size_t> agreed_order();

  // ddp/reducer/join.cc
  // One join round: this rank's {training?, averaging?} summed over the
  // group; returns the sums.
  std::pair<int, int> join_round_sums(bool training, bool averaging);

  // A rank out of inputs takes part in the others' steps with zero
  // gradients until every rank is out, then all take the parameters and
  // buffers of the rank that trained last (its optimizer stepped most).
  void finish_join();
};

}  // namespace tandem::ddp::detail
