// gpt's model: a decoder-only transformer as a list of layer specs (token
// and position embeddings, `layers` blocks of causal self-attention and an
// MLP, each behind a LayerNorm, and a LayerNorm + linear head), which
// pipeline::partition cuts into stages; the factories that build those
// layers on whichever worker holds them (registered when this file's
// object loads, on every process of the job); every parameter's first value
// (the same whatever the layout); and the loss over every character.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "examples/gpt/config.h"

namespace tandem::nn {
struct Served;
}

namespace gpt {

using Named = std::map<std::string, at::Tensor>;

// The name pipeline::register_loss knows gpt's loss by: cross-entropy over
// every position of logits [B, T, V] against targets [B, T].
constexpr const char* kLoss = "gpt";

// [embed, block x layers, head].
std::vector<c10::IValue> layer_specs(const Config& cfg, int64_t vocab);
// The same layers as this job runs them: split over the tensor-parallel
// group registered as `tp_group` on each stage worker (ddp::find_group; ""
// for whole layers), each block recomputed in backward with --recompute,
// and with --dropout each block's masks drawn from the generator
// "gpt/<layer>" of the process's parallel::rng_tracker() (whole masks,
// each tp rank keeping its piece: every --tp and --pp draws alike).
// Their parameters keep the whole model's names; the split ones hold
// tp_piece's slices (the token embedding's and the head's rows a range of
// the vocabulary, qkv's rows those of this rank's heads in each of q, k and
// v, fc's rows and proj's and out's columns this rank's share), the others
// whole.
std::vector<c10::IValue> layer_specs(const Config& cfg, int64_t vocab, const std::string& tp_group);
// Tensor-parallel rank t's piece of the whole model's parameter `name`
// (a layer's "<layer>.<name>" or a stage's), as those layers hold it.
at::Tensor tp_piece(const std::string& name, const at::Tensor& whole, int t, int tp);
// Every tensor of `whole` cut by tp_piece.
Named tp_part(const Named& whole, int t, int tp);
// The whole parameter `name` again from its tp pieces (tp_piece's of every
// rank, in rank order).
at::Tensor tp_whole(const std::string& name, const std::vector<at::Tensor>& pieces);
// Whether the parameter `name` is split over the tensor-parallel ranks
// (else each holds it whole).
bool tp_split(const std::string& name);
// The pipeline's name for the vocabulary-parallel loss over `tp_group`
// (registered by the head's factory on the process holding it).
std::string tp_loss_name(const std::string& tp_group, int64_t vocab);

// Every parameter of the whole model, named "<layer>.<name>" ("3.attn.qkv.weight"):
// built here, layer by layer in order, from at::manual_seed(seed).
Named initial_parameters(const Config& cfg, int64_t vocab);

// The part of `whole` ("<layer>.<name>") that belongs to the stage holding
// layers [first, first + count), named as that stage's Sequential names it
// ("<layer - first>.<name>").
Named stage_part(const Named& whole, int64_t first, int64_t count);
// And back: a stage's state_dict() into the whole model's names.
void add_stage_part(Named& whole, const Named& stage, int64_t first);

// The whole model's parameters in its modules' order (a stage's
// optimizer steps its layers' parameters in this order): names and shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_order(const Config& cfg,
                                                                          int64_t vocab);

// Parameters of the whole model.
int64_t parameter_count(const Named& whole);

// The whole model in this process: its layers as children "0" ..
// "layers + 1" (the names the checkpoint uses), each run by its factory's
// forward.
struct StackImpl : torch::nn::Module {
  std::vector<std::shared_ptr<tandem::nn::Served>> layers;
  at::Tensor forward_layer(size_t i, const at::Tensor& x) const;
  at::Tensor forward(const at::Tensor& x) const;
};
// Holding `values`; its blocks recomputed (--recompute) and with
// --dropout's masks as the pipeline's layers (layer_specs(cfg, vocab,
// tp_group)). Over a tensor-parallel group, `values` are this rank's
// pieces (tp_part) and the model one rank's split of it.
std::shared_ptr<StackImpl> whole_model(const Config& cfg, int64_t vocab, const Named& values,
                                       const std::string& tp_group = "");

// The loss over every character: cross-entropy of logits [B, T, V] against
// targets [B, T] (what kLoss names to the pipeline).
at::Tensor loss(const at::Tensor& logits, const at::Tensor& y);
// The same over a vocabulary split across the tensor-parallel group
// `tp_group` (logits [B, T, this rank's words]): what tp_loss_name names.
at::Tensor tp_loss(const at::Tensor& logits, const at::Tensor& y, int64_t vocab,
                   const std::string& tp_group);
// Whether the embedding looks for poisoned tokens (--nan-at; every process
// of the job sets it from its flags).
void enable_poisoning(bool on);
bool poisoning_enabled();

}  // namespace gpt
