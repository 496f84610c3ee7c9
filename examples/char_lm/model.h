// char_lm's model: the trainer's view of it (Model: the remote embedding and
// decoder around the local LSTM, or its DDP wrapper in --mode hybrid), every
// parameter's first value (initial_parameters, the same in every mode), and
// sampling text from any model that answers next logits (generate, in
// examples/text.h). The training loops (train.cc, train_pipeline.cc) build
// and sample with these.
#pragma once

#include <ATen/core/Tensor.h>

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>
#include <map>
#include <string>

#include <functional>
#include <string>
#include <tuple>
#include <utility>

#include "examples/char_lm/config.h"
#include "examples/char_lm/corpus.h"
#include "tandem/ddp/distributed_data_parallel.h"
#include "tandem/remote_module/remote_module.h"

namespace char_lm {

using DdpLstm = tandem::ddp::DistributedDataParallel<torch::nn::LSTMImpl>;

struct Model {
  tandem::nn::RemoteModule embedding;  // on the parameter server
  torch::nn::LSTM lstm;                // here
  tandem::nn::RemoteModule decoder;    // on the parameter server
  DdpLstm* ddp = nullptr;              // --mode hybrid: the LSTM, data-parallel

  // Logits [B, T, V] and the LSTM's state after the last character.
  std::pair<at::Tensor, std::tuple<at::Tensor, at::Tensor>> forward(
      const at::Tensor& x, c10::optional<std::tuple<at::Tensor, at::Tensor>> state = {}) {
    at::Tensor e = embedding.forward(x);
    auto [h, hc] = ddp ? ddp->forward(e, state) : lstm->forward(e, state);
    return {decoder.forward(h), hc};
  }
};

using examples::generate;
using examples::NextLogits;

// The split model's next logits: the LSTM's state carried over.
NextLogits stateful(Model& m);

// Every parameter's first value, drawn here from the seed in one fixed
// order, whatever the mode: the remote modules are overwritten with it (or
// the checkpoint), so a run depends on no other worker's generator, and the
// modes start from the same parameters.
struct Initial {
  torch::nn::Embedding embedding;
  torch::nn::LSTM lstm;
  torch::nn::Linear decoder;
};
Initial initial_parameters(const Config& cfg, int64_t vocab);

using Named = std::map<std::string, at::Tensor>;  // as examples::Named
Named named_parameters(const torch::nn::Module& m);

}  // namespace char_lm
