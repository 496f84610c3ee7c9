#pragma once
// DistributedDataParallel: one replica of a torch::nn::Module per rank, its
// gradients averaged over the process group while backward still runs.
//
//   ddp::init_process_group("gloo");
//   auto model = torch::nn::Sequential(...);
//   ddp::DistributedDataParallel net(model);
//   torch::optim::SGD opt(net.parameters(), 0.01);
//   auto loss = loss_fn(net(x), y);
//   loss.backward();          // buckets all-reduce as their gradients land
//   opt.step();               // every rank steps the same averaged gradients
//
// At construction the ranks compare their parameters' names, shapes and
// dtypes (a mismatch fails on every rank naming the first parameter that
// differs and the ranks involved) and take rank 0's parameters and buffers.
// Gradients live in flat buckets (`bucket_cap_mb`, the first one
// `first_bucket_mb`, each filled until it holds at least its cap, as
// PyTorch's are; parameters in reverse order at first, rebuilt after the
// first step in the order their gradients became ready, rank 0's order on
// every rank); each parameter's .grad aliases its slot, so the averaged
// gradient is written straight out of the bucket. A bucket is averaged with
// one all_reduce launched by the hook of its last gradient, in bucket order
// (the same on every rank); backward returns when all have finished.
//
// Differences from PyTorch worth knowing: a parameter that got no gradient
// while find_unused_parameters is off fails that backward on every rank,
// naming the parameter (PyTorch fails the next iteration naming none).
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/ddp/process_group.h"

namespace tandem::ddp {

// ---- communication hooks ----
// How a bucket is averaged. A hook gets the group and the bucket's flat
// gradient (this rank's, summed over any no_sync steps) and starts the
// reduction; once `pending` has finished, `finish` (if any) runs, and then
// the bucket must hold the average over the ranks. Hooks run on the thread
// that runs backward, in bucket order, the same on every rank.
struct BucketWork {
  ProcessGroup::Pending pending;
  std::function<void()> finish;
};
using CommHook = std::function<BucketWork(ProcessGroup& group, at::Tensor& bucket)>;

// The default: divide by the group's size, all_reduce in place.
CommHook allreduce_hook();
// Send half the bytes: the averaged bucket travels as float16 (or bfloat16)
// and is written back into the bucket; gradients lose precision accordingly
// (float16: 11 significant bits, bfloat16: 8). Floating-point buckets only.
// It pays where bytes are dear (a slow network, NCCL): Gloo sums float16
// element by element on the CPU, so over loopback it costs more than it
// saves (ddp_bench: 159 ms a step against 62). Gloo in LibTorch 1.x cannot
// sum bfloat16 at all; the bf16 hook says so.
CommHook fp16_compress_hook();
CommHook bf16_compress_hook();

// Which rank steps a parameter, for sharded gradients (DDPOptions::gradient_owner):
// optim::ZeroRedundancyOptimizer::gradient_owner() gives its partition's.
using GradientOwner = std::function<int(const at::Tensor& param)>;

struct DDPOptions {
  double bucket_cap_mb = 25;   // MiB per bucket
  double first_bucket_mb = 1;  // the first bucket is small so communication starts early
  // Parameters that may get no gradient in a step (a branch not taken): their
  // slot counts as zero, and one that no rank used keeps its .grad untouched.
  bool find_unused_parameters = false;
  // Rank 0's buffers (batch-norm statistics) copied to every rank before each forward.
  bool broadcast_buffers = true;
  // The one device this process's replica lives on, as PyTorch's
  // `device_ids=[local_rank]`: every parameter must be there, and forward()
  // moves its tensor arguments there. Empty: wherever the parameters are
  // (the CPU for gloo, one GPU for nccl).
  std::vector<int> device_ids;
  std::chrono::milliseconds timeout = kGroupTimeout;  // each bucket's all_reduce
  CommHook comm_hook;                                 // empty: allreduce_hook()
  // Sharded gradients (ZeRO stage 2). Each bucket is reduce-scattered
  // instead of all-reduced: after a synced backward a parameter's averaged
  // .grad is kept only by the rank gradient_owner names (a view of that
  // rank's piece of the bucket), the others' .grad is undefined, and the
  // bucket itself is freed until the next backward. A gradient the owner
  // still holds from the last step (no zero_grad between) is added to the
  // new average, as DDP's would be (it is set aside when backward reaches
  // the parameter, and added back at the end). No comm_hook, no join() and
  // no distributed autograd context with it.
  GradientOwner gradient_owner;
  // Construction compares the ranks' models and takes rank 0's parameters
  // and buffers (PyTorch's init_sync). False: it does not communicate; each
  // rank keeps its own values (the same seed made them alike, or a state
  // loaded later replaces them: tandem::ft heals a newcomer's), and a
  // model that differs is the caller's error.
  bool init_sync = true;
};

namespace detail {

// The gradient bookkeeping behind DistributedDataParallel<M> (one per model).
class Reducer {
 public:
  Reducer(std::shared_ptr<torch::nn::Module> module, DDPOptions options,
          std::shared_ptr<ProcessGroup> group);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Before each forward: buffers from rank 0, buckets rebuilt after the first step.
  void prepare_forward();
  void set_sync(bool sync);
  bool sync() const;
  // join(): open the scope (every forward then counts the ranks still
  // training), and close it (shadow the others until all are done, then
  // take the last trainer's state). Collective: every rank closes it.
  void begin_join();
  void end_join();

  // What tests and benchmarks read.
  struct Stats {
    size_t buckets = 0;
    std::vector<size_t> bucket_bytes;
    // Per bucket: its parameters' indices in module->parameters() order.
    std::vector<std::vector<size_t>> bucket_params;
    bool rebuilt = false;
    // The last synced backward: from its first gradient hook to the last
    // bucket's launch (backward_ms), the wait after backward's own work for
    // the buckets still running (tail_wait_ms), first hook to all done
    // (allreduce_ms).
    double backward_ms = 0, tail_wait_ms = 0, allreduce_ms = 0;
  };
  Stats stats() const;
  ProcessGroup& group() { return *group_; }
  void set_group(std::shared_ptr<ProcessGroup> group);
  // DDPOptions::device_ids[0] as a device (forward()'s arguments go there);
  // empty without device_ids.
  const std::optional<c10::Device>& input_device() const { return input_device_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<ProcessGroup> group_;
  std::optional<c10::Device> input_device_;
};

}  // namespace detail

template <class M>
class DistributedDataParallel {
 public:
  // `group` null: the default process group.
  explicit DistributedDataParallel(std::shared_ptr<M> module, DDPOptions options = {},
                                   std::shared_ptr<ProcessGroup> group = nullptr)
      : module_(std::move(module)),
        reducer_(std::make_unique<detail::Reducer>(
            module_, options, group ? std::move(group) : default_group_ptr())) {}
  explicit DistributedDataParallel(torch::nn::ModuleHolder<M> module, DDPOptions options = {},
                                   std::shared_ptr<ProcessGroup> group = nullptr)
      : DistributedDataParallel(module.ptr(), options, std::move(group)) {}

  template <class... Args>
  decltype(auto) forward(Args&&... args) {
    reducer_->prepare_forward();
    return module_->forward(to_device(std::forward<Args>(args))...);
  }
  template <class... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // Gradient accumulation: backwards inside a NoSync scope only add to the
  // local gradients; the first backward after it averages everything.
  class NoSync {
   public:
    explicit NoSync(detail::Reducer& r) : r_(&r), was_(r.sync()) { r.set_sync(false); }
    ~NoSync() {
      if (r_) r_->set_sync(was_);
    }
    NoSync(NoSync&& o) noexcept : r_(std::exchange(o.r_, nullptr)), was_(o.was_) {}
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    detail::Reducer* r_;
    bool was_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*reducer_); }

  // Uneven inputs: train inside a join scope and close it (end() or the
  // destructor) when this rank runs out of batches. Until every rank is
  // out, a rank that has closed it joins the others' gradient averages with
  // zeros (each average still divides by the whole group, as PyTorch's
  // default); then every rank takes the parameters and buffers of the rank
  // that trained longest. Each forward inside the scope costs one small
  // all_reduce more.
  //
  //   {
  //     auto join = net.join();
  //     for (auto& b : my_batches) { ... net(b.x) ... backward ... step ... }
  //     join.end();   // throws what went wrong; the destructor would swallow it
  //   }
  class Join {
   public:
    explicit Join(detail::Reducer& r) : r_(&r) { r.begin_join(); }
    ~Join() {
      try {
        end();
      } catch (...) {
      }
    }
    void end() {
      if (auto* r = std::exchange(r_, nullptr)) r->end_join();
    }
    Join(Join&& o) noexcept : r_(std::exchange(o.r_, nullptr)) {}
    Join(const Join&) = delete;
    Join& operator=(const Join&) = delete;
    Join& operator=(Join&&) = delete;

   private:
    detail::Reducer* r_;
  };
  [[nodiscard]] Join join() { return Join(*reducer_); }

  // Averages over `group` from now on: any size (each bucket is divided by
  // the group's size), the same backend; with gradient_owner the same size
  // and rank. Between steps, on every rank of the new group (each
  // tandem::ft quorum's: ft::ManagerOptions::on_quorum). What a failed
  // step left in flight is dropped, and the buckets start again from the
  // parameters' reverse order, rebuilt after the first step together.
  // std::invalid_argument for a null group or one that does not fit.
  void set_group(std::shared_ptr<ProcessGroup> group) { reducer_->set_group(std::move(group)); }

  std::shared_ptr<M> module() const { return module_; }
  M* operator->() const { return module_.get(); }
  std::vector<at::Tensor> parameters() const { return module_->parameters(); }
  detail::Reducer& reducer() { return *reducer_; }

 private:
  // A tensor argument goes to device_ids[0] (no copy where it is there).
  template <class T>
  decltype(auto) to_device(T&& arg) const {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      const auto& device = reducer_->input_device();
      return device ? arg.to(*device) : at::Tensor(arg);
    } else {
      return std::forward<T>(arg);
    }
  }

  std::shared_ptr<M> module_;
  std::unique_ptr<detail::Reducer> reducer_;
};

template <class M>
DistributedDataParallel(torch::nn::ModuleHolder<M>, DDPOptions = {},
                        std::shared_ptr<ProcessGroup> = nullptr) -> DistributedDataParallel<M>;

}  // namespace tandem::ddp
