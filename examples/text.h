// Text for the character-level examples (char_lm, gpt): a corpus read from
// a file or from the licence texts every Debian machine has, its vocabulary
// of bytes, and sampling from any model that answers the next character's
// logits.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>

namespace examples {

// FNV-1a's steps over the bytes of `s` (from an offset basis of its own:
// corpus fingerprints in saved checkpoints depend on it).
uint64_t fnv1a(const std::string& s);

struct Corpus {
  std::string name;
  std::string text;
  std::string vocab;         // the distinct bytes, in order
  at::Tensor tokens;         // int64, each byte's index in vocab
  uint64_t fingerprint = 0;  // FNV-1a of the text
};

// The text `flag` names, or (empty) every regular file of
// /usr/share/common-licenses, sorted by name (the symbolic links there only
// repeat other files). A missing, empty or shorter than `min_bytes` text
// throws UsageError (examples/flags.h).
Corpus load_corpus(const std::string& flag, int64_t min_bytes);

// Feeds new characters [1, k] to a model and answers the logits [V] that
// follow the last of them (the model keeps what it needs of the earlier ones).
using NextLogits = std::function<at::Tensor(const at::Tensor& ids)>;

// `n` characters after `prompt`, sampled at `temperature` from a generator
// seeded with `seed`, as one terminal line (runs of white space as one
// blank, other control bytes as '?').
std::string generate(const NextLogits& model, const Corpus& c, std::string prompt, int n,
                     double temperature, uint64_t seed);

}  // namespace examples
