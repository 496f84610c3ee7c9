// The model's pieces (examples/char_lm/model.h).
#include "examples/char_lm/model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>

#include <memory>
#include <vector>

namespace char_lm {

NextLogits stateful(Model& m) {
  auto state = std::make_shared<c10::optional<std::tuple<at::Tensor, at::Tensor>>>();
  return [&m, state](const at::Tensor& ids) {
    auto [logits, hc] = m.forward(ids, *state);
    *state = hc;
    return logits[0][-1];
  };
}

std::string generate(const NextLogits& model, const Corpus& c, std::string prompt, int n,
                     double temperature, uint64_t seed) {
  c10::NoGradGuard no_grad;
  std::vector<int64_t> ids;
  std::string kept;
  for (char ch : prompt) {
    auto pos = c.vocab.find(ch);
    if (pos != std::string::npos) {
      ids.push_back(static_cast<int64_t>(pos));
      kept += ch;
    }
  }
  if (ids.empty()) {  // a corpus without those letters: start from its first byte
    ids.push_back(c.tokens[0].item<int64_t>());
    kept = c.vocab.substr(ids[0], 1);
  }
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor logits = model(at::tensor(ids).view({1, -1}));
  std::string out = kept;
  for (int i = 0; i < n; ++i) {
    at::Tensor next = at::multinomial(at::softmax(logits / temperature, 0), 1, false, gen);
    out += c.vocab[next.item<int64_t>()];
    logits = model(next.view({1, 1}));
  }
  // One line on the terminal: each run of white space as one blank (the
  // licences are full of indentation), other control bytes as '?'.
  std::string line;
  for (char ch : out) {
    const auto u = static_cast<unsigned char>(ch);
    if (ch == ' ' || ch == '\n' || ch == '\t' || ch == '\r') {
      if (line.empty() || line.back() != ' ') line += ' ';
    } else {
      line += (u < 0x20 || u == 0x7f) ? '?' : ch;
    }
  }
  return line;
}

Initial initial_parameters(const Config& cfg, int64_t vocab) {
  at::manual_seed(static_cast<uint64_t>(cfg.seed));
  torch::nn::Embedding embedding(vocab, kEmbed);
  torch::nn::LSTM lstm(torch::nn::LSTMOptions(kEmbed, kHidden).batch_first(true));
  torch::nn::Linear decoder(kHidden, vocab);
  return {embedding, lstm, decoder};
}

}  // namespace char_lm
