// FullyShardedDataParallel's state (ddp/fully_sharded.h), shared by:
//   ddp/fsdp/setup.cc   construction: units found and checked, the ranks'
//                       models compared, rank 0's state taken, the flat
//                       buffers, the shards and the gradient hooks;
//   ddp/fsdp/run.cc     each step: a unit gathered and freed around its
//                       forward and its backward, prefetching, each unit's
//                       gradients reduce-scattered in reverse forward
//                       order, the end of backward;
//   ddp/fsdp/state.cc   clipping, state dicts, stats.
//
// How a unit's parameters come and go: each module parameter is, for good,
// a view of its unit's flat buffer `full` (set_data at construction). To
// free the unit, full's storage gives its memory back (its data pointer
// becomes null, its size 0) and every parameter is set_data to an empty
// tensor, so that a stray use fails on shapes instead of reading freed
// memory; to gather it, the storage gets fresh memory, the all-gather
// fills it, and the parameters are set_data to their views again. Autograd
// saves views of parameters (a Linear's weight.t()): they share full's
// storage, so they give their memory back with it and see the gathered
// values again in backward. set_data keeps each parameter's version counter
// and its gradient accumulator (which holds the parameter's shape from
// construction), and the all-gather writes the memory without autograd.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <map>
#include <mutex>

#include "tandem/ddp/fully_sharded.h"

namespace tandem::ddp {

struct FullyShardedDataParallel::Impl {
  struct Param {
    std::string name;   // as the model names it
    at::Tensor tensor;  // the module's parameter
    std::vector<int64_t> shape;
    size_t unit = 0;
    int64_t offset = 0, numel = 0;                       // in the unit's flat buffer
    std::shared_ptr<torch::autograd::Node> accumulator;  // kept: it carries the hook
    uintptr_t hook_key = 0;
  };
  struct Unit {
    std::string name;  // "" for the root
    std::vector<size_t> params;
    int64_t numel = 0, padded = 0, shard_numel = 0;
    at::Tensor shard;  // this rank's piece, a leaf that requires grad
    at::Tensor full;   // [padded]; its storage holds memory only while gathered
    enum class State { kFree, kGathering, kGathered } state = State::kFree;
    ProcessGroup::Pending gathering;
    at::Tensor gather_input;
    // This step.
    bool ran = false;          // its forward ran (so its backward will)
    size_t grads_pending = 0;  // its parameters' gradients still to land
    bool reduced = false;      // its reduce-scatter started
    ProcessGroup::Pending reducing;
    at::Tensor reduce_output;
  };
  struct ReadyHook final : torch::autograd::FunctionPostHook {
    ReadyHook(Impl* impl, size_t index) : impl(impl), index(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      impl->grad_ready(index);
      return outputs;
    }
    Impl* impl;
    size_t index;
  };

  std::shared_ptr<torch::nn::Module> model;
  torch::nn::Sequential sequential{nullptr};  // set when the model is one
  FSDPOptions opt;
  std::shared_ptr<ProcessGroup> group;
  std::vector<Param> params;
  std::vector<Unit> units;  // units[0]: the root (parameters of no named unit)
  std::map<std::string, size_t> unit_of_name;
  std::vector<std::pair<std::string, at::Tensor>> buffers;

  std::mutex mu;  // backward's hooks and the caller's thread
  bool in_forward = false, in_backward = false;
  std::vector<size_t> order, last_order;  // units in forward order (this and the last step)
  size_t next_reduce = 0;                 // into reverse(order)
  int64_t gathers = 0, reduce_scatters = 0;

  // This rank's place in the layout (the group's, or given to wait for one).
  int layout_rank = 0, layout_size = 1;

  std::chrono::milliseconds timeout() const {
    return opt.timeout.count() < 0 ? (group ? group->timeout() : kDefaultCollectiveTimeout)
                                   : opt.timeout;
  }
  int rank() const { return layout_rank; }
  int size() const { return layout_size; }
  // The group, to communicate (std::logic_error before set_group() gave one).
  ProcessGroup& pg() const {
    if (!group) {
      throw std::logic_error(
          "FullyShardedDataParallel: no group yet (made for a rank without one: set_group() "
          "first)");
    }
    return *group;
  }

  // ddp/fsdp/setup.cc
  void setup(FSDPOptions options);
  // The constructor without a group: the layout given, nothing compared.
  void start_without_group(int rank, int size, FSDPOptions& options);

  // ddp/fsdp/run.cc
  void start_gather(size_t u);
  void finish_gather(size_t u);  // waits for it (starting it when free)
  void free_unit(size_t u);
  void begin_forward();
  void end_forward();
  at::Tensor run_unit(size_t u, const std::function<at::Tensor()>& fn);
  void pre_backward(size_t u);
  void grad_ready(size_t param);
  void launch_reduces();  // those due, in reverse forward order
  void launch_reduce(size_t u);
  void finish_backward();
  void abandon_step();  // what a failed step left behind, waited for and dropped
};

}  // namespace tandem::ddp
