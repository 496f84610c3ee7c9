// The model's pieces (examples/char_lm/model.h).
#include "examples/char_lm/model.h"

#include <memory>

namespace char_lm {

NextLogits stateful(Model& m) {
  auto state = std::make_shared<c10::optional<std::tuple<at::Tensor, at::Tensor>>>();
  return [&m, state](const at::Tensor& ids) {
    auto [logits, hc] = m.forward(ids, *state);
    *state = hc;
    return logits[0][-1];
  };
}

Initial initial_parameters(const Config& cfg, int64_t vocab) {
  at::manual_seed(static_cast<uint64_t>(cfg.seed));
  torch::nn::Embedding embedding(vocab, kEmbed);
  torch::nn::LSTM lstm(torch::nn::LSTMOptions(kEmbed, kHidden).batch_first(true));
  torch::nn::Linear decoder(kHidden, vocab);
  return {embedding, lstm, decoder};
}

Named named_parameters(const torch::nn::Module& m) {
  Named out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value();
  return out;
}

}  // namespace char_lm
