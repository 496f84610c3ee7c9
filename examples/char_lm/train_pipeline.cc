// --mode pipeline (examples/char_lm/train.h).
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/tensor.h>
#include <torch/nn/module.h>

#include <cstdio>
#include <memory>
#include <vector>

#include "examples/char_lm/model.h"
#include "examples/char_lm/train.h"
#include "examples/progress.h"
#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/pipeline/pipe.h"

namespace char_lm {

namespace dist = tandem::autograd;
namespace optim = tandem::optim;

namespace {

// --mode pipeline, stage 0: the embedding and the LSTM (its output only).
struct FrontImpl : torch::nn::Module {
  explicit FrontImpl(int64_t vocab)
      : embedding(register_module("embedding", torch::nn::Embedding(vocab, kEmbed))),
        lstm(register_module(
            "lstm", torch::nn::LSTM(torch::nn::LSTMOptions(kEmbed, kHidden).batch_first(true)))) {}
  at::Tensor forward(at::Tensor x) { return std::get<0>(lstm->forward(embedding->forward(x))); }
  torch::nn::Embedding embedding;
  torch::nn::LSTM lstm;
};

// Registered on every process (each may hold a stage): the front, and the
// loss over every character of the micro-batch.
const bool kPipelineParts = [] {
  tandem::nn::register_module("char_lm_front",
                              [](int64_t vocab) { return std::make_shared<FrontImpl>(vocab); });
  tandem::pipeline::register_loss("char_lm", [](const at::Tensor& logits, const at::Tensor& y) {
    return char_loss(logits, y);
  });
  return true;
}();

}  // namespace

int train_pipeline(const Config& cfg, const Corpus& corpus, Clock::time_point started,
                   const Place& at) {
  (void)kPipelineParts;
  const int64_t V = static_cast<int64_t>(corpus.vocab.size());
  const Initial init = initial_parameters(cfg, V);
  std::vector<tandem::nn::RemoteModule> stages = {
      tandem::nn::RemoteModule("worker0/cpu", "char_lm_front", {V}),
      tandem::nn::RemoteModule(at.server() + "/cpu", "Linear", {kHidden, V})};
  Named front;
  for (const auto& [name, t] : named_parameters(*init.embedding)) front["embedding." + name] = t;
  for (const auto& [name, t] : named_parameters(*init.lstm)) front["lstm." + name] = t;
  stages[0].load_state_dict(front);
  stages[1].load_state_dict(named_parameters(*init.decoder));

  tandem::pipeline::PipeOptions po;
  po.chunks = 4;
  po.schedule = cfg.schedule;
  po.loss = "char_lm";
  tandem::pipeline::Pipe pipe(stages, po);
  optim::Options o;
  o.lr = cfg.lr;
  optim::DistributedOptimizer opt(optim::Kind::kAdam, pipe.parameters(), o);
  std::printf(
      "char_lm: %s, %zu bytes, vocabulary %lld; pipeline: Embedding + LSTM(%lld->%lld) "
      "on worker0, decoder on %s; %d micro-batches a step (%s); training steps 1..%lld\n",
      corpus.name.c_str(), corpus.text.size(), static_cast<long long>(V),
      static_cast<long long>(kEmbed), static_cast<long long>(kHidden), at.server().c_str(),
      po.chunks, po.schedule.c_str(), static_cast<long long>(cfg.steps));
  std::fflush(stdout);

  double loss_value = 0;
  examples::Progress progress{cfg.steps,  cfg.log_every, cfg.losses,
                              cfg.resume, started,       kBatch * kWindow};
  tandem::optim::NonFiniteGuard guard(tandem::optim::non_finite_from_string(cfg.on_nonfinite));
  for (int64_t step = 0; step < cfg.steps; ++step) {
    Batch b = batch_at(corpus, cfg.seed, step);
    poison_if_asked(cfg.nan_at, step, b);
    {
      dist::Context ctx;
      loss_value = pipe.step(ctx.id(), b.x, b.y);
      const double norm = opt.clip_grad_norm(ctx.id(), 1.0);
      if (guard.check(step + 1, loss_value, norm)) opt.step(ctx.id());
    }
    progress.add(step + 1, loss_value);
  }
  examples::report_skipped(guard);
  std::printf("final step %lld loss %.6f\n", static_cast<long long>(cfg.steps), loss_value);
  // Sampling feeds the last kWindow characters through both stages each time.
  std::vector<int64_t> seen;
  auto next = [&](const at::Tensor& ids) {
    for (int64_t i = 0; i < ids.numel(); ++i) seen.push_back(ids.view(-1)[i].item<int64_t>());
    const size_t from = seen.size() > static_cast<size_t>(kWindow) ? seen.size() - kWindow : 0;
    std::vector<int64_t> window(seen.begin() + static_cast<std::ptrdiff_t>(from), seen.end());
    return pipe.forward(at::tensor(window).view({1, -1}))[0][-1];
  };
  std::printf(
      "sample: %s\n",
      generate(next, corpus, "The ", 200, 0.8, static_cast<uint64_t>(cfg.seed) + 1).c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace char_lm
