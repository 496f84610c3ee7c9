// gpt --ft: pp x dp, and pp x tp x dp, under tandem::ft::Manager. A replica
// is a pipeline row (ranks id x pp x tp .. under tandem-run), each rank
// holding one stage, or with --tp its tensor-parallel rank's split of one
// (row rank r: stage r / tp, tp rank r % tp), built here from the layer
// specs (cut by parameter count, the same on every rank) with the whole
// model's initial values; the row's drivers (its first tp ranks) each run
// a Pipe over their tp rank's stages through an RPC agent of the row's
// own, made with each quorum (examples/pipeline_row.h). With --tp the
// pieces are held here for the whole run and the stage is made anew in
// each quorum over that quorum's tp group (Manager::replica_subgroup),
// its parameters sharing their storage. Each step, every rank's gradients
// are averaged over the quorum's rows, clipped to a global norm summed
// over the row (a parameter whole on every tp rank counted once), and
// stepped by the rank's own Adam at the schedule's rate for the committed
// step; a row that lost a rank sits out until the launcher's replacement
// is back, and then both are healed, rank by rank, from another row. In
// float64, so that --reference (the same training in one process, over
// the quorums a run printed) ends on the same parameters to 1e-5. The
// samples are the quorum's stream (ft::Manager::batch_indices: window
// starts), so none is skipped or trained twice whatever fails.
//
// With --checkpoint-every N the quorum's first row writes a checkpoint
// every N committed steps, which a restart of the whole job reads back
// (examples/ft_checkpoint.h).
//
// Every rank prints examples/ft_lines.h's lines, and "final step S loss L
// norm N" (L: the whole model's loss over the first 32 windows; N: its
// parameters' norm).
#include <ATen/ops/tensor.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "examples/ft_checkpoint.h"
#include "examples/ft_lines.h"
#include "examples/gpt/batches.h"
#include "examples/gpt/train.h"
#include "examples/pipeline_row.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/ft/manager.h"
#include "tandem/parallel/random.h"
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

// --checkpoint-every N (examples/ft_checkpoint.h): every rank's parameters
// (or pieces) and their Adam state under "rank<r>/", its layout "gpt --ft
// pp P tp T", read back only into the same.
examples::ReplicaCheckpoint checkpoint_of(const Config& cfg) {
  return {cfg.checkpoint, cfg.checkpoint_every,
          "gpt --ft pp " + std::to_string(cfg.pp) + " tp " + std::to_string(cfg.tp), true, "gpt"};
}

}  // namespace

int drive_fault_tolerant(const Config& cfg, const examples::Corpus& corpus) {
  examples::print_started();
  const int pp = static_cast<int>(cfg.pp), tp = static_cast<int>(cfg.tp);
  const int64_t V = static_cast<int64_t>(corpus.vocab.size());
  const auto counts = tandem::pipeline::balance_by_parameters(layer_specs(cfg, V), pp);
  const char* rank_env = std::getenv("RANK");
  const int rank = (rank_env ? std::atoi(rank_env) : 0) % (pp * tp);
  const int stage = rank / tp, tp_rank = rank % tp;
  int64_t first = 0;
  for (int s = 0; s < stage; ++s) first += counts[static_cast<size_t>(s)];
  const int64_t count = counts[static_cast<size_t>(stage)];
  const std::string tp_group = tp > 1 ? "gpt.ft.tp" : "";
  // This rank's stage as a module (its layers over tp_group, registered on
  // the process's worker when there is one).
  auto make_stage = [&cfg, V, first, count, tp_group] {
    const auto specs = layer_specs(cfg, V, tp_group);
    std::vector<c10::IValue> mine(specs.begin() + first, specs.begin() + first + count);
    std::vector<c10::IValue> args{tandem::nn::list(std::move(mine))};
    auto made = tandem::nn::make_module("Sequential", args);
    made->module->to(at::kDouble);
    return made;
  };
  // What this rank trains, with the whole model's initial values: its
  // stage's parameters, or with --tp its pieces of them (tp_part).
  const Named whole = initial_parameters(cfg, V);
  const Named part = tp > 1 ? tp_part(stage_part(whole, first, count), tp_rank, tp)
                            : stage_part(whole, first, count);
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::shared_ptr<torch::nn::Module> holder;  // what the Manager heals and compares
  std::mutex live_mu;
  std::vector<at::Tensor> live;  // with --tp: the tensors this quorum's stage computes with
  if (tp == 1) {
    // One stage for the whole run, served in every quorum.
    auto served = make_stage();
    at::NoGradGuard no_grad;
    for (auto& p : served->module->named_parameters()) {
      p.value().copy_(part.at(p.key()));
      names.push_back(p.key());
      params.push_back(p.value());
    }
    holder = served->module;
    tandem::nn::register_factory("gpt.ft_stage",
                                 [served](std::vector<c10::IValue>&) { return served; });
  } else {
    // The pieces held here for the whole run (under names without dots);
    // the stage is made anew in each quorum over its tp group, its
    // parameters sharing their storage.
    holder = std::make_shared<torch::nn::Module>();
    for (const auto& [name, value] : part) {
      std::string flat = name;
      std::replace(flat.begin(), flat.end(), '.', '_');
      names.push_back(name);
      params.push_back(holder->register_parameter(flat, value.to(at::kDouble).clone()));
    }
    tandem::nn::register_factory("gpt.ft_stage", [&](std::vector<c10::IValue>&) {
      std::shared_ptr<tandem::nn::Served> made;
      {
        // (its initial values are replaced at once: the draws leave no trace)
        tandem::parallel::KeepDefaultRng keep;
        made = make_stage();
      }
      at::NoGradGuard no_grad;
      auto mine = made->module->named_parameters();
      if (mine.size() != names.size()) {
        throw std::logic_error("gpt --ft: the stage made has " + std::to_string(mine.size()) +
                               " parameters, its pieces " + std::to_string(names.size()));
      }
      std::vector<at::Tensor> now;
      for (size_t i = 0; i < names.size(); ++i) {
        at::Tensor p = mine[names[i]];
        p.set_(params[i]);
        now.push_back(p);
      }
      std::lock_guard<std::mutex> lock(live_mu);
      live = std::move(now);
      return made;
    });
  }
  torch::optim::Adam opt(params, torch::optim::AdamOptions(cfg.lr));

  ft::ManagerOptions o;
  o.replica_size = pp * tp;
  o.dataset_size = window_count(corpus, cfg);
  o.batch_size = cfg.batch / cfg.dp;
  o.seed = static_cast<uint64_t>(cfg.seed);
  o.heartbeat_timeout = std::chrono::milliseconds(1500);
  o.join_timeout = std::chrono::milliseconds(2000);
  o.collective_timeout = std::chrono::seconds(20);
  tandem::pipeline::PipeOptions po;
  po.chunks = static_cast<int>(cfg.chunks);
  po.schedule = cfg.schedule;
  po.loss = tp > 1 ? tp_loss_name(tp_group, V) : kLoss;
  examples::PipelineRow row(params, "gpt.ft_stage", po, o.collective_timeout, tp, tp_group,
                            tp > 1 ? std::function<std::vector<at::Tensor>()>([&] {
                              std::lock_guard<std::mutex> lock(live_mu);
                              return live;
                            })
                                   : nullptr);
  o.on_quorum = [&](ft::Manager& m) { row.open(m); };
  o.min_replicas = static_cast<int>(cfg.min_replicas);
  ft::Manager manager(o, ft::module_state(*holder, opt));
  const examples::ReplicaCheckpoint checkpoint = checkpoint_of(cfg);
  const examples::RankState state{names, params, &opt};
  // (only a restart reads it: a fresh job's first rank cleared the old steps)
  if (tandem::checkpoint::restart_count() > 0) examples::resume_newest(checkpoint, manager, state);
  if (manager.step() >= cfg.steps) {  // (a restart after the last step was saved)
    std::printf("the checkpoint is at step %lld, the last: done\n",
                static_cast<long long>(manager.step()));
    return 0;
  }
  // The global norm counts a replicated parameter (whole on every tp rank) once.
  std::vector<bool> counted;
  for (const auto& name : names) counted.push_back(tp_rank == 0 || tp_split(name));
  int64_t heals = 0;
  while (manager.step() < cfg.steps) {
    if (!examples::begin_step(manager, heals)) return 0;
    at::Tensor x, y;
    if (stage == 0) {  // (the drivers)
      std::tie(x, y) = windows_at(corpus.tokens, manager.batch_indices(), cfg.context);
    }
    const double l = row.step(manager, x, y);
    std::vector<at::Tensor> grads, mine;
    for (size_t i = 0; i < params.size(); ++i) {
      grads.push_back(params[i].grad());
      if (counted[i]) mine.push_back(params[i].grad());
    }
    manager.allreduce_grads(grads);
    // The global norm of the averaged gradients, over the row's stages.
    try {
      at::Tensor squares = at::tensor({sum_of_squares(mine)}, at::kDouble);
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
    if (commit) examples::save_every(checkpoint, manager, state);
  }
  // The whole model on every rank of the row: each piece from its rank.
  Named values;
  {
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> held;
    for (size_t i = 0; i < names.size(); ++i) held[names[i]] = params[i];
    int64_t from = 0;
    for (int s = 0; s < pp; ++s) {
      const int64_t n = counts[static_cast<size_t>(s)];
      Named whole_part = stage_part(whole, from, n);
      for (auto& [name, value] : whole_part) {
        std::vector<at::Tensor> pieces;
        for (int t = 0; t < tp; ++t) {
          at::Tensor v = s == stage && t == tp_rank
                             ? held.at(name).detach().clone()
                             : tp_piece(name, value, t, tp).to(at::kDouble).contiguous().clone();
          manager.replica_group()->broadcast(v, s * tp + t);
          pieces.push_back(v);
        }
        value = tp_whole(name, pieces);
      }
      add_stage_part(values, whole_part, from);
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
