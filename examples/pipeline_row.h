// A pipeline row as one replica of a tandem::ft::Manager job (pp x dp, and
// pp x tp x dp): the row's processes each hold one stage, or one
// tensor-parallel rank's split of one, built locally before the first
// quorum (so that the Manager has each rank's state to heal and compare).
// With tp ranks a stage, replica rank r holds stage r / tp as its tp rank
// r % tp; the row's first tp ranks each drive a tandem::pipeline::Pipe
// over the stages of their tp rank (so a stage's tp ranks run the same
// passes in the same order and meet in their collectives). The Pipes'
// stages talk over RPC; the row's agent, and each stage's tp group, are
// made anew with each quorum over keys of its own (Manager::replica_store,
// replica_subgroup), since the quorum's processes change.
// Shared by ft_mlp --pipeline and gpt --ft.
//
//   PipelineRow row(stage_params, "my.stage", pipe_options);   // the factory serves this
//   o.on_quorum = [&](ft::Manager& m) { row.open(m); };        // rank's stage
//   ...
//   while (...) {
//     manager.start_step();
//     const double loss = row.step(manager, x, y);  // every rank; x, y read on the drivers
//     ... manager.allreduce_grads(stage grads); manager.should_commit() ...
//   }
//   row.close(/*graceful=*/true);
#pragma once

#include <ATen/ops/ones.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/autograd.h"
#include "tandem/ddp/process_group.h"
#include "tandem/ft/manager.h"
#include "tandem/pipeline/pipe.h"
#include "tandem/remote_module/remote_module.h"
#include "tandem/rpc/agent.h"

namespace examples {

class PipelineRow {
 public:
  // `params`: this rank's stage's parameters, whose .grad a step fills.
  // `factory`: the name (nn::register_factory) under which this process
  // serves its stage. The agent's calls and the pipe's passes wait at most
  // `timeout`. With `tp` > 1, each stage's tp group is registered on the
  // row's agent as `tp_group` (ddp::find_group) before any driver asks for
  // a stage, and `live` answers the tensors the served stage computes
  // with, in the order of `params` (a stage made by the factory in each
  // quorum over the group, sharing its parameters' storage with `params`).
  PipelineRow(std::vector<at::Tensor> params, std::string factory,
              tandem::pipeline::PipeOptions options, std::chrono::milliseconds timeout, int tp = 1,
              std::string tp_group = "", std::function<std::vector<at::Tensor>()> live = {})
      : params_(std::move(params)),
        factory_(std::move(factory)),
        options_(std::move(options)),
        tp_(tp),
        tp_group_name_(std::move(tp_group)),
        live_(std::move(live)),
        registry_(std::make_shared<tandem::rpc::Registry>()) {
    options_.timeout = timeout;
    agent_options_.init_timeout = timeout;
    agent_options_.rpc_timeout = timeout;
    // A stopped partner is found within 2 s, not at the timeout.
    agent_options_.peer_timeout = std::chrono::seconds(2);
    registry_->def("pipeline_row.take_grads", [this](int64_t context) {
      take_grads(*tandem::rpc::handler_agent(), static_cast<uint64_t>(context));
      return true;
    });
  }
  ~PipelineRow() { close(false); }
  PipelineRow(const PipelineRow&) = delete;
  PipelineRow& operator=(const PipelineRow&) = delete;

  // In on_quorum: the last quorum's agent and pipe closed (at once: the row
  // may have lost a process), the quorum's made.
  void open(tandem::ft::Manager& m) {
    close(false);
    rank_ = m.replica_rank();
    size_ = m.replica_size();
    if (tp_ > 1) {
      const int stage = rank_ / tp_;
      std::vector<int> ranks;
      for (int t = 0; t < tp_; ++t) ranks.push_back(stage * tp_ + t);
      tp_group_ = m.replica_subgroup("tp" + std::to_string(stage), ranks);
    }
    agent_options_.name = "stage" + std::to_string(rank_);
    agent_options_.rank = rank_;
    agent_options_.world_size = size_;
    agent_ = tandem::rpc::Agent::create(agent_options_, registry_, m.replica_store("rpc"));
    if (tp_ > 1) {
      tandem::ddp::register_group(*agent_, tp_group_name_, tp_group_);
      m.replica_group()->barrier();  // (every rank's group there before a stage is asked for)
    }
    if (rank_ >= tp_) return;
    for (int s = 0; s < size_ / tp_; ++s) {
      stages_.emplace_back(*agent_, "stage" + std::to_string(s * tp_ + rank_) + "/cpu", factory_);
    }
    pipe_ = std::make_unique<tandem::pipeline::Pipe>(*agent_, stages_, options_);
  }

  // Graceful: the row's processes meet to close (the job's end).
  void close(bool graceful) {
    pipe_.reset();
    stages_.clear();
    if (tp_group_) {
      if (!graceful) tp_group_->abandon();
      tp_group_.reset();
    }
    if (!agent_) return;
    try {
      agent_->shutdown(graceful);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pipeline row: closing its agent: %s\n", e.what());
    }
    agent_.reset();
  }

  // The step's forward and backward through the row; every rank calls it
  // after start_step(), and its stage's parameters then hold their
  // gradients in .grad (zeros where none came). Returns the replica's loss
  // (the driver's, told to every rank); a failure (a partner gone) is
  // reported to `m`, and the step will not commit.
  double step(tandem::ft::Manager& m, const at::Tensor& x, const at::Tensor& y) {
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
    // Every rank is through the last update (and any heal) before the
    // driver's micro-batches reach it: a forward that ran first would save
    // the old parameters for its backward.
    bool ready = true;
    try {
      at::Tensor one = at::ones({1});
      m.replica_group()->all_reduce(one);
    } catch (const std::exception& e) {
      ready = false;
      m.report_error(e.what());
    }
    // Summed over the row: the drivers that failed, and the loss (rank 0's).
    at::Tensor told = at::zeros({2}, at::kDouble);
    bool failed = !ready;
    if (failed) told[0].fill_(1.0);
    if (rank_ < tp_ && ready) {  // a driver
      try {
        tandem::autograd::Context ctx(*agent_);
        const double loss = pipe_->step(ctx.id(), x, y);
        for (int s = 1; s < size_ / tp_; ++s) {
          agent_->rpc_sync("stage" + std::to_string(s * tp_ + rank_), "pipeline_row.take_grads",
                           static_cast<int64_t>(ctx.id()));
        }
        take_grads(*agent_, ctx.id());
        if (rank_ == 0) told[1].fill_(loss);
      } catch (const std::exception& e) {
        failed = true;
        told[0].fill_(1.0);
        m.report_error(e.what());
      }
    }
    try {
      m.replica_group()->all_reduce(told);
      if (!failed && told[0].item<double>() != 0) m.report_error("the row's step failed");
    } catch (const std::exception& e) {
      m.report_error(e.what());
    }
    for (auto& p : params_) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    }
    return told[1].item<double>();
  }

 private:
  // This stage's gradients in the step's distributed autograd context, onto .grad.
  void take_grads(tandem::rpc::Agent& agent, uint64_t context) {
    const auto grads = tandem::autograd::get_gradients(agent, context);
    const std::vector<at::Tensor> live = live_ ? live_() : params_;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = live.at(i);
      params_[i].mutable_grad() = grads.contains(p) ? grads.at(p).clone() : at::zeros_like(p);
    }
  }

  std::vector<at::Tensor> params_;
  std::string factory_;
  tandem::pipeline::PipeOptions options_;
  int tp_;
  std::string tp_group_name_;
  std::function<std::vector<at::Tensor>()> live_;
  std::shared_ptr<tandem::ddp::ProcessGroup> tp_group_;  // this stage's, in this quorum
  tandem::rpc::AgentOptions agent_options_;
  std::shared_ptr<tandem::rpc::Registry> registry_;
  int rank_ = 0, size_ = 1;
  std::shared_ptr<tandem::rpc::Agent> agent_;
  std::vector<tandem::nn::RemoteModule> stages_;  // the driver's
  std::unique_ptr<tandem::pipeline::Pipe> pipe_;
};

}  // namespace examples
