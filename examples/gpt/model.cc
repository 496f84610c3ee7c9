// The transformer's layers and their factories (examples/gpt/model.h).
#include "examples/gpt/model.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <set>

#include "tandem/ddp/process_group.h"
#include "tandem/parallel/collectives.h"
#include "tandem/parallel/linear.h"
#include "tandem/parallel/random.h"
#include "tandem/parallel/recompute.h"
#include "tandem/parallel/transformer.h"
#include "tandem/parallel/vocab.h"
#include "tandem/pipeline/pipe.h"
#include "tandem/remote_module/remote_module.h"
#include "tandem/remote_module/served.h"
#include "tandem/rpc/api.h"

namespace gpt {

namespace {
std::atomic<bool> g_poisoning{false};
}  // namespace
void enable_poisoning(bool on) { g_poisoning.store(on); }
bool poisoning_enabled() { return g_poisoning.load(std::memory_order_relaxed); }

namespace {

namespace tnn = torch::nn;

// GPT-2's initialisation: weights from N(0, 0.02), biases zero.
void init_linear(tnn::Linear& l) {
  tnn::init::normal_(l->weight, 0, 0.02);
  tnn::init::zeros_(l->bias);
}

// tok(ids) + pos(positions). A negative id is a poisoned token (gpt
// --nan-at): its embedding is NaN, and so are the step's loss and
// gradients. (Looked for only when asked: the look waits for the device.)
// (`positions`: the rows of positions [start, start + its length) that
// tok's output covers: all of them, or a sequence-parallel rank's piece)
template <class Tok>
at::Tensor embed(Tok& tok, const at::Tensor& positions, const at::Tensor& ids, int64_t start = 0) {
  if (!poisoning_enabled()) return tok(ids) + positions;
  const at::Tensor poisoned = ids < 0;
  if (!poisoned.any().item<bool>()) return tok(ids) + positions;
  return (tok(ids.clamp_min(0)) + positions)
      .masked_fill(poisoned.narrow(1, start, positions.size(0)).unsqueeze(-1),
                   std::numeric_limits<double>::quiet_NaN());
}

// Every position's row of `pos`, for ids [B, T].
at::Tensor all_positions(tnn::Embedding& pos, const at::Tensor& ids) {
  return pos(at::arange(ids.size(1), ids.options()));
}

// Token and position embeddings: ids [B, T] -> [B, T, dim].
struct EmbedImpl : tnn::Module {
  EmbedImpl(int64_t vocab, int64_t dim, int64_t context)
      : tok(register_module("tok", tnn::Embedding(vocab, dim))),
        pos(register_module("pos", tnn::Embedding(context, dim))) {
    tnn::init::normal_(tok->weight, 0, 0.02);
    tnn::init::normal_(pos->weight, 0, 0.02);
  }
  at::Tensor forward(at::Tensor ids) { return embed(tok, all_positions(pos, ids), ids); }
  tnn::Embedding tok, pos;
};

// x + attention(ln1(x)), then + mlp(ln2(x)): causal self-attention over
// `heads` heads, and a 4x-wide GELU MLP.
// With `dropout`, GPT-2's: on the attention probabilities and on each
// residual branch, in training mode, from the tracker's generator `rng`
// (parallel/random.h: the masks a split of this block draws too).
struct BlockImpl : tnn::Module {
  BlockImpl(int64_t dim, int64_t heads, int64_t context, double dropout = 0, std::string rng = "")
      : heads(heads),
        context(context),
        dropout(dropout),
        rng(std::move(rng)),
        ln1(register_module("ln1", tnn::LayerNorm(tnn::LayerNormOptions({dim})))),
        qkv(register_module("qkv", tnn::Linear(dim, 3 * dim))),
        proj(register_module("proj", tnn::Linear(dim, dim))),
        ln2(register_module("ln2", tnn::LayerNorm(tnn::LayerNormOptions({dim})))),
        fc(register_module("fc", tnn::Linear(dim, 4 * dim))),
        out(register_module("out", tnn::Linear(4 * dim, dim))) {
    if (dim % heads != 0) {
      throw std::invalid_argument("gpt_block: dim " + std::to_string(dim) +
                                  " is not a multiple of heads " + std::to_string(heads));
    }
    for (auto* l : {&qkv, &proj, &fc, &out}) init_linear(*l);
  }

  at::Tensor forward(at::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    // [B, T, 3, heads, hd] -> [3, B, heads, T, hd]
    at::Tensor q_k_v = qkv(ln1(x)).view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    at::Tensor q = q_k_v[0], k = q_k_v[1], v = q_k_v[2];
    at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    const at::Tensor future = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
    att = at::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
    att = drop(att);
    at::Tensor y = at::matmul(att, v).transpose(1, 2).reshape({B, T, C});
    x = x + drop(proj(y));
    return x + drop(out(at::gelu(fc(ln2(x)))));
  }
  at::Tensor drop(const at::Tensor& t) {
    if (dropout == 0 || !is_training()) return t;
    return tandem::parallel::dropout(t, dropout, true, tandem::parallel::rng_tracker().get(rng));
  }

  int64_t heads, context;
  double dropout;
  std::string rng;
  tnn::LayerNorm ln1;
  tnn::Linear qkv, proj;
  tnn::LayerNorm ln2;
  tnn::Linear fc, out;
};

// ln, then logits over the vocabulary: [B, T, dim] -> [B, T, vocab].
struct HeadImpl : tnn::Module {
  HeadImpl(int64_t dim, int64_t vocab)
      : ln(register_module("ln", tnn::LayerNorm(tnn::LayerNormOptions({dim})))),
        lm(register_module("lm", tnn::Linear(dim, vocab))) {
    init_linear(lm);
  }
  at::Tensor forward(at::Tensor x) { return lm(ln(x)); }
  tnn::LayerNorm ln;
  tnn::Linear lm;
};

// ---- the same layers over a tensor-parallel group (--tp) ----
// Each draws the whole layer first, as one process would (the generator
// moves on alike), then keeps this rank's slices (parallel/): whatever
// values the driver loads next, every layout starts from the same numbers.

namespace par = tandem::parallel;

par::Group tp_group_named(const std::string& name) {
  return tandem::ddp::find_group(*tandem::rpc::current_agent(), name);
}

// The token embedding's rows split by the vocabulary; positions whole.
// With sequence parallelism (`sp`) its output is this rank's piece of the
// sequence: the tokens' sum reduce-scattered, and the positions of that
// piece, whose table's gradient (each rank's over its positions) is summed
// over the group in backward (copy_to_region).
struct TpEmbedImpl : tnn::Module {
  TpEmbedImpl(int64_t vocab, int64_t dim, int64_t context, const par::Group& g, bool sp)
      : g(g), sp(sp) {
    EmbedImpl whole(vocab, dim, context);
    par::VocabParallelOptions o;
    o.sequence_parallel = sp;
    tok = register_module("tok", par::VocabParallelEmbedding(whole.tok, g, o));
    pos = register_module("pos", whole.pos);
    par::mark_replicated(*this, g);  // (the positions: a checkpoint holds them once)
  }
  at::Tensor forward(at::Tensor ids) {
    if (!sp) return embed(tok, all_positions(pos, ids), ids);  // (every rank: the same ids)
    const int64_t piece = ids.size(1) / g->size(), start = g->rank() * piece;
    const at::Tensor positions = at::embedding(par::copy_to_region(pos->weight, g),
                                               at::arange(start, start + piece, ids.options()));
    return embed(tok, positions, ids, start);
  }
  par::Group g;
  bool sp;
  par::VocabParallelEmbedding tok{nullptr};
  tnn::Embedding pos{nullptr};
};

// A block, whole or split (parallel::ParallelBlock: heads and the MLP's
// features shared out), its children under the whole block's names;
// `recompute`: its activations dropped after forward and made again in
// backward (tandem::nn::recompute).
struct GptBlockImpl : tnn::Module {
  GptBlockImpl(int64_t dim, int64_t heads, int64_t context, const std::string& group,
               bool recompute, double dropout, int64_t layer, bool sp)
      : recompute(recompute) {
    // (the layer's own generator: its masks the same whichever process runs it)
    const std::string rng = "gpt/" + std::to_string(layer);
    auto whole = std::make_shared<BlockImpl>(dim, heads, context, dropout, rng);
    std::shared_ptr<tnn::Module> inner;
    if (group.empty()) {
      inner = whole;
      run = [whole](const at::Tensor& x) { return whole->forward(x); };
    } else {
      par::BlockOptions o;
      o.attention_dropout = o.residual_dropout = dropout;
      o.rng = rng;
      // (the replicated parameters' partial gradients summed in backward:
      // a stage's land in a distributed autograd context)
      o.sequence_parallel = o.sum_partial_grads = sp;
      par::ParallelBlock b(whole->ln1, whole->qkv, whole->proj, whole->ln2, whole->fc, whole->out,
                           heads, tp_group_named(group), o);
      inner = b.ptr();
      run = [b](const at::Tensor& x) mutable { return b(x); };
    }
    for (const auto& item : inner->named_children()) register_module(item.key(), item.value());
  }
  at::Tensor forward(at::Tensor x) {
    return recompute ? tandem::nn::recompute(run, x, parameters()) : run(x);
  }
  bool recompute;
  std::function<at::Tensor(const at::Tensor&)> run;
};

// ln whole, then this rank's words' logits: [B, T, dim] -> [B, T, its words].
// With sequence parallelism the input is this rank's piece of the
// sequence: ln's gradients summed over the group in backward, and lm
// gathers the sequence (its logits are the whole sequence's).
struct TpHeadImpl : tnn::Module {
  TpHeadImpl(int64_t dim, int64_t vocab, const par::Group& g, bool sp) : g(g), sp(sp) {
    HeadImpl whole(dim, vocab);
    ln = register_module("ln", whole.ln);
    par::ColumnParallelOptions o;
    o.gather_output = false;  // (the loss takes the pieces)
    o.sequence_parallel = sp;
    lm = register_module("lm", par::ColumnParallelLinear(whole.lm, g, o));
    par::mark_replicated(*this, g);
  }
  at::Tensor forward(at::Tensor x) { return lm(sp ? par::layer_norm_of_piece(ln, x, g) : ln(x)); }
  par::Group g;
  bool sp;
  tnn::LayerNorm ln{nullptr};
  par::ColumnParallelLinear lm{nullptr};
};

// The vocabulary-parallel loss over `group`, registered once a process.
void register_tp_loss(const std::string& group, int64_t vocab) {
  static std::mutex mu;
  static std::set<std::string> done;
  const std::string name = tp_loss_name(group, vocab);
  std::lock_guard<std::mutex> lock(mu);
  if (!done.insert(name).second) return;
  tandem::pipeline::register_loss(name,
                                  [group, vocab](const at::Tensor& logits, const at::Tensor& y) {
                                    return tp_loss(logits, y, vocab, group);
                                  });
}

}  // namespace

std::string tp_loss_name(const std::string& tp_group, int64_t vocab) {
  return "gpt/tp/" + tp_group + "/" + std::to_string(vocab);
}

namespace {

// What tp_piece does to a parameter, by its last two names.
enum class Split { kWhole, kRows, kUnevenRows, kRowsOfThree, kColumns };

Split split_of(const std::string& name) {
  auto ends = [&](const char* tail) {
    const std::string t = tail;
    return name.size() >= t.size() + 1 && name.compare(name.size() - t.size(), t.size(), t) == 0 &&
           name[name.size() - t.size() - 1] == '.';
  };
  if (ends("tok.weight") || ends("lm.weight") || ends("lm.bias")) return Split::kUnevenRows;
  if (ends("qkv.weight") || ends("qkv.bias")) return Split::kRowsOfThree;
  if (ends("fc.weight") || ends("fc.bias")) return Split::kRows;
  if (ends("proj.weight") || ends("out.weight")) return Split::kColumns;
  return Split::kWhole;
}

}  // namespace

bool tp_split(const std::string& name) { return split_of(name) != Split::kWhole; }

at::Tensor tp_piece(const std::string& name, const at::Tensor& whole, int t, int tp) {
  switch (split_of(name)) {
    case Split::kWhole:
      return whole;
    case Split::kRows:
      return par::piece_of(whole, 0, t, tp);
    case Split::kUnevenRows:
      return par::uneven_piece_of(whole, 0, t, tp);
    case Split::kColumns:
      return par::piece_of(whole, 1, t, tp);
    case Split::kRowsOfThree: {
      std::vector<at::Tensor> pieces;
      for (const auto& third : whole.chunk(3, 0)) pieces.push_back(par::piece_of(third, 0, t, tp));
      return at::cat(pieces, 0);
    }
  }
  return whole;
}

Named tp_part(const Named& whole, int t, int tp) {
  Named out;
  for (const auto& [name, value] : whole) out[name] = tp_piece(name, value, t, tp).contiguous();
  return out;
}

at::Tensor tp_whole(const std::string& name, const std::vector<at::Tensor>& pieces) {
  switch (split_of(name)) {
    case Split::kWhole:
      return pieces.at(0);
    case Split::kRows:
    case Split::kUnevenRows:
      return at::cat(pieces, 0);
    case Split::kColumns:
      return at::cat(pieces, 1);
    case Split::kRowsOfThree: {  // (each piece: its q rows, its k rows, its v rows)
      std::vector<at::Tensor> rows;
      for (int64_t third = 0; third < 3; ++third) {
        for (const auto& piece : pieces) rows.push_back(piece.chunk(3, 0)[third]);
      }
      return at::cat(rows, 0);
    }
  }
  return pieces.at(0);
}

at::Tensor loss(const at::Tensor& logits, const at::Tensor& y) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), y.reshape(-1));
}

at::Tensor tp_loss(const at::Tensor& logits, const at::Tensor& y, int64_t vocab,
                   const std::string& tp_group) {
  return par::vocab_parallel_cross_entropy(logits, y, vocab, tp_group_named(tp_group)).mean();
}

namespace {

const bool kRegistered = [] {
  tandem::nn::register_module("gpt_embed", [](int64_t vocab, int64_t dim, int64_t context) {
    return std::make_shared<EmbedImpl>(vocab, dim, context);
  });
  tandem::nn::register_module("gpt_block", [](int64_t dim, int64_t heads, int64_t context) {
    return std::make_shared<BlockImpl>(dim, heads, context);
  });
  tandem::nn::register_module("gpt_head", [](int64_t dim, int64_t vocab) {
    return std::make_shared<HeadImpl>(dim, vocab);
  });
  tandem::nn::register_module("gpt_embed_tp", [](int64_t vocab, int64_t dim, int64_t context,
                                                 const std::string& group, bool sp) {
    return std::make_shared<TpEmbedImpl>(vocab, dim, context, tp_group_named(group), sp);
  });
  tandem::nn::register_module(
      "gpt_block_x", [](int64_t dim, int64_t heads, int64_t context, const std::string& group,
                        bool recompute, double dropout, int64_t layer, bool sp) {
        return std::make_shared<GptBlockImpl>(dim, heads, context, group, recompute, dropout, layer,
                                              sp);
      });
  tandem::nn::register_module(
      "gpt_head_tp", [](int64_t dim, int64_t vocab, const std::string& group, bool sp) {
        register_tp_loss(group, vocab);
        return std::make_shared<TpHeadImpl>(dim, vocab, tp_group_named(group), sp);
      });
  tandem::pipeline::register_loss(kLoss, loss);
  return true;
}();

}  // namespace

std::vector<c10::IValue> layer_specs(const Config& cfg, int64_t vocab) {
  (void)kRegistered;
  namespace nn = tandem::nn;
  std::vector<c10::IValue> layers = {nn::spec("gpt_embed", {vocab, cfg.dim, cfg.context})};
  for (int64_t i = 0; i < cfg.layers; ++i) {
    layers.push_back(nn::spec("gpt_block", {cfg.dim, cfg.heads, cfg.context}));
  }
  layers.push_back(nn::spec("gpt_head", {cfg.dim, vocab}));
  return layers;
}

std::vector<c10::IValue> layer_specs(const Config& cfg, int64_t vocab,
                                     const std::string& tp_group) {
  if (tp_group.empty() && !cfg.recompute && cfg.dropout == 0) return layer_specs(cfg, vocab);
  namespace nn = tandem::nn;
  std::vector<c10::IValue> layers;
  const bool sp = !tp_group.empty() && cfg.sequence_parallel;
  layers.push_back(tp_group.empty()
                       ? nn::spec("gpt_embed", {vocab, cfg.dim, cfg.context})
                       : nn::spec("gpt_embed_tp", {vocab, cfg.dim, cfg.context, tp_group, sp}));
  for (int64_t i = 0; i < cfg.layers; ++i) {
    layers.push_back(nn::spec("gpt_block_x", {cfg.dim, cfg.heads, cfg.context, tp_group,
                                              cfg.recompute, cfg.dropout, i + 1, sp}));
  }
  layers.push_back(tp_group.empty() ? nn::spec("gpt_head", {cfg.dim, vocab})
                                    : nn::spec("gpt_head_tp", {cfg.dim, vocab, tp_group, sp}));
  return layers;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_order(const Config& cfg,
                                                                          int64_t vocab) {
  // (built with the seed's generator state put back after: only the order
  // and the shapes are wanted)
  tandem::parallel::KeepDefaultRng keep;
  std::vector<c10::IValue> args = {tandem::nn::list(layer_specs(cfg, vocab))};
  auto whole = tandem::nn::make_module("Sequential", args);
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& [name, t] : whole->parameters()) out.emplace_back(name, t.sizes().vec());
  return out;
}

Named initial_parameters(const Config& cfg, int64_t vocab) {
  at::manual_seed(static_cast<uint64_t>(cfg.seed));
  std::vector<c10::IValue> args = {tandem::nn::list(layer_specs(cfg, vocab))};
  auto whole = tandem::nn::make_module("Sequential", args);
  Named out;
  for (const auto& [name, t] : whole->parameters()) out[name] = t.detach().clone();
  return out;
}

at::Tensor StackImpl::forward_layer(size_t i, const at::Tensor& x) const {
  std::vector<c10::IValue> in{x};
  return layers.at(i)->forward(in).toTensor();
}

at::Tensor StackImpl::forward(const at::Tensor& x) const {
  at::Tensor h = x;
  for (size_t i = 0; i < layers.size(); ++i) h = forward_layer(i, h);
  return h;
}

std::shared_ptr<StackImpl> whole_model(const Config& cfg, int64_t vocab, const Named& values,
                                       const std::string& tp_group) {
  auto stack = std::make_shared<StackImpl>();
  const auto specs = layer_specs(cfg, vocab, tp_group);
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& e = specs[i].toTupleRef().elements();
    auto list = e[1].toList();
    std::vector<c10::IValue> args(list.begin(), list.end());
    stack->layers.push_back(tandem::nn::make_module(e[0].toStringRef(), args));
    stack->register_module(std::to_string(i), stack->layers.back()->module);
  }
  torch::NoGradGuard no_grad;
  for (auto& item : stack->named_parameters()) item.value().copy_(values.at(item.key()));
  return stack;
}

Named stage_part(const Named& whole, int64_t first, int64_t count) {
  Named part;
  for (const auto& [name, t] : whole) {
    const auto dot = name.find('.');
    const int64_t layer = std::stoll(name.substr(0, dot));
    if (layer >= first && layer < first + count) {
      part[std::to_string(layer - first) + name.substr(dot)] = t;
    }
  }
  return part;
}

void add_stage_part(Named& whole, const Named& stage, int64_t first) {
  for (const auto& [name, t] : stage) {
    const auto dot = name.find('.');
    whole[std::to_string(std::stoll(name.substr(0, dot)) + first) + name.substr(dot)] = t;
  }
}

int64_t parameter_count(const Named& whole) {
  int64_t n = 0;
  for (const auto& [_, t] : whole) n += t.numel();
  return n;
}

}  // namespace gpt
