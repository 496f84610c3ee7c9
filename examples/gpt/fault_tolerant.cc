// gpt --ft: pp x dp under tandem::ft::Manager. A replica is a pipeline row
// (ranks id x pp .. id x pp + pp - 1 under tandem-run), each rank holding
// one stage, built here from the layer specs (cut by parameter count, the
// same on every rank) with the whole model's initial values; the row's
// driver runs a Pipe over them through an RPC agent of the row's own, made
// with each quorum (examples/pipeline_row.h). Each step, every stage's
// gradients are averaged over the quorum's rows, clipped to a global norm
// summed over the row, and stepped by the rank's own Adam at the schedule's
// rate for the committed step; a row that lost a rank sits out until the
// launcher's replacement is back, and then both are healed, stage by
// stage, from another row. In float64, so that --reference (the same
// training in one process, over the quorums a run printed) ends on the
// same parameters to 1e-5. The samples are the quorum's stream
// (ft::Manager::batch_indices: window starts), so none is skipped or
// trained twice whatever fails.
//
// Every rank prints examples/ft_lines.h's lines, and "final step S loss L
// norm N" (L: the whole model's loss over the first 32 windows; N: its
// parameters' norm).
#include <ATen/ops/tensor.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "examples/ft_lines.h"
#include "examples/gpt/batches.h"
#include "examples/gpt/train.h"
#include "examples/pipeline_row.h"
#include "tandem/ft/manager.h"
#include "tandem/pipeline/partition.h"
#include "tandem/remote_module/served.h"

namespace gpt {
namespace {

namespace ft = tandem::ft;

int64_t window_count(const examples::Corpus& corpus, const Config& cfg) {
  return corpus.tokens.size(0) - cfg.context;
}

// Scales `grads` to a global norm of at most cfg.clip, the sum of squares
// `squares` being over every stage's.
void clip(const Config& cfg, const std::vector<at::Tensor>& grads, double squares) {
  const double coef = cfg.clip / (std::sqrt(squares) + 1e-6);
  if (coef >= 1) return;
  for (const auto& g : grads) const_cast<at::Tensor&>(g).mul_(coef);
}

double sum_of_squares(const std::vector<at::Tensor>& grads) {
  double s = 0;
  for (const auto& g : grads) s += g.pow(2).sum().item<double>();
  return s;
}

void set_lr(const Config& cfg, torch::optim::Adam& opt, int64_t step) {
  for (auto& group : opt.param_groups()) {
    static_cast<torch::optim::AdamOptions&>(group.options()).lr(cfg.lr * lr_factor(cfg, step));
  }
}

// The final line: the whole model's loss over the first 32 windows, and its norm.
void print_final(const Config& cfg, const examples::Corpus& corpus, int64_t step,
                 const Named& values) {
  const int64_t V = static_cast<int64_t>(corpus.vocab.size());
  auto model = whole_model(cfg, V, values);
  model->to(at::kDouble);
  std::vector<int64_t> starts(32);
  for (int64_t i = 0; i < 32; ++i) starts[static_cast<size_t>(i)] = i;
  auto [x, y] = windows_at(corpus.tokens, starts, cfg.context);
  at::NoGradGuard no_grad;
  const double l = loss(model->forward(x), y).item<double>();
  double sq = 0;
  for (const auto& p : model->parameters()) sq += p.pow(2).sum().item<double>();
  std::printf("final step %lld loss %.9g norm %.9g\n", static_cast<long long>(step), l,
              std::sqrt(sq));
  std::fflush(stdout);
}

}  // namespace

int drive_fault_tolerant(const Config& cfg, const examples::Corpus& corpus) {
  examples::print_started();
  const int pp = static_cast<int>(cfg.pp);
  const int64_t V = static_cast<int64_t>(corpus.vocab.size());
  const auto specs = layer_specs(cfg, V);
  const auto counts = tandem::pipeline::balance_by_parameters(specs, pp);
  const char* rank_env = std::getenv("RANK");
  const int rank = (rank_env ? std::atoi(rank_env) : 0) % pp;
  int64_t first = 0;
  for (int s = 0; s < rank; ++s) first += counts[static_cast<size_t>(s)];
  const int64_t count = counts[static_cast<size_t>(rank)];
  // This rank's stage, built here with the whole model's initial values.
  std::vector<c10::IValue> mine(specs.begin() + first, specs.begin() + first + count);
  std::vector<c10::IValue> args{tandem::nn::list(std::move(mine))};
  auto stage = tandem::nn::make_module("Sequential", args);
  stage->module->to(at::kDouble);
  const Named whole = initial_parameters(cfg, V);
  {
    at::NoGradGuard no_grad;
    const Named part = stage_part(whole, first, count);
    for (auto& p : stage->module->named_parameters()) p.value().copy_(part.at(p.key()));
  }
  tandem::nn::register_factory("gpt.ft_stage",
                               [stage](std::vector<c10::IValue>&) { return stage; });
  const std::vector<at::Tensor> params = stage->module->parameters();
  torch::optim::Adam opt(params, torch::optim::AdamOptions(cfg.lr));

  ft::ManagerOptions o;
  o.replica_size = pp;
  o.dataset_size = window_count(corpus, cfg);
  o.batch_size = cfg.batch / cfg.dp;
  o.seed = static_cast<uint64_t>(cfg.seed);
  o.heartbeat_timeout = std::chrono::milliseconds(1500);
  o.join_timeout = std::chrono::milliseconds(2000);
  o.collective_timeout = std::chrono::seconds(20);
  tandem::pipeline::PipeOptions po;
  po.chunks = static_cast<int>(cfg.chunks);
  po.schedule = cfg.schedule;
  po.loss = kLoss;
  examples::PipelineRow row(params, "gpt.ft_stage", po, o.collective_timeout);
  o.on_quorum = [&](ft::Manager& m) { row.open(m); };
  ft::Manager manager(o, ft::module_state(*stage->module, opt));
  int64_t heals = 0;
  while (manager.step() < cfg.steps) {
    if (!examples::begin_step(manager, heals)) return 0;
    at::Tensor x, y;
    if (rank == 0) std::tie(x, y) = windows_at(corpus.tokens, manager.batch_indices(), cfg.context);
    const double l = row.step(manager, x, y);
    std::vector<at::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    manager.allreduce_grads(grads);
    // The global norm of the averaged gradients, over the row's stages.
    try {
      at::Tensor squares = at::tensor({sum_of_squares(grads)}, at::kDouble);
      manager.replica_group()->all_reduce(squares);
      clip(cfg, grads, squares.item<double>());
    } catch (const std::exception& e) {
      manager.report_error(e.what());
    }
    const int k = manager.participants();
    const int64_t step = manager.step();
    const bool commit = manager.should_commit();
    if (commit) {
      set_lr(cfg, opt, step);  // (the schedule's rate for the step committed)
      opt.step();
    }
    examples::print_step(manager, commit, k, l);
  }
  // The whole model on every rank of the row: each stage's values from its rank.
  Named values;
  {
    at::NoGradGuard no_grad;
    const auto held = stage->module->named_parameters();
    int64_t from = 0;
    for (int s = 0; s < pp; ++s) {
      const int64_t n = counts[static_cast<size_t>(s)];
      Named part = stage_part(whole, from, n);
      for (auto& [name, t] : part) {
        at::Tensor v = s == rank ? held[name].detach().clone()
                                 : t.to(at::kDouble).clone();
        manager.replica_group()->broadcast(v, s);
        t = v;
      }
      add_stage_part(values, part, from);
      from += n;
    }
  }
  row.close(true);
  print_final(cfg, corpus, manager.step(), values);
  return 0;
}

int ft_reference(const Config& cfg, const examples::Corpus& corpus) {
  const std::vector<int> ks = examples::quorum_sizes(cfg.reference);
  const int64_t V = static_cast<int64_t>(corpus.vocab.size());
  auto model = whole_model(cfg, V, initial_parameters(cfg, V));
  model->to(at::kDouble);
  const auto params = model->parameters();
  torch::optim::Adam opt(params, torch::optim::AdamOptions(cfg.lr));
  const int64_t b = cfg.batch / cfg.dp;
  int64_t cursor = 0, step = 0;
  for (int k : ks) {
    opt.zero_grad();
    // The mean over k rows' batches of their mean losses.
    for (int r = 0; r < k; ++r) {
      auto starts = ft::sample_stream(window_count(corpus, cfg), static_cast<uint64_t>(cfg.seed),
                                      true, cursor + r * b, b);
      auto [x, y] = windows_at(corpus.tokens, starts, cfg.context);
      (loss(model->forward(x), y) / k).backward();
    }
    std::vector<at::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad());
    clip(cfg, grads, sum_of_squares(grads));
    set_lr(cfg, opt, step);
    opt.step();
    cursor += k * b;
    ++step;
  }
  Named values;
  for (const auto& p : model->named_parameters()) values[p.key()] = p.value().detach();
  print_final(cfg, corpus, step, values);
  return 0;
}

}  // namespace gpt
