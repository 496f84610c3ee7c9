// The corpus and sampling (examples/text.h).
#include "examples/text.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <vector>

#include "examples/flags.h"

namespace examples {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

namespace {

namespace fs = std::filesystem;

constexpr const char* kDefaultCorpus = "/usr/share/common-licenses";

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw UsageError("cannot read '" + p.string() + "'");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

Corpus load_corpus(const std::string& flag, int64_t min_bytes) {
  Corpus c;
  if (flag.empty()) {
    std::error_code ec;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(kDefaultCorpus, ec)) {
      if (e.is_regular_file() && !e.is_symlink()) files.push_back(e.path());
    }
    if (ec || files.empty()) {
      throw UsageError(std::string("no text in ") + kDefaultCorpus + "; pass --corpus FILE");
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) c.text += read_file(f);
    c.name = std::string(kDefaultCorpus) + "/* (" + std::to_string(files.size()) + " files)";
  } else {
    std::error_code ec;
    if (!fs::exists(flag, ec)) throw UsageError("corpus file '" + flag + "' does not exist");
    if (fs::is_directory(flag, ec)) throw UsageError("corpus '" + flag + "' is a directory");
    c.text = read_file(flag);
    c.name = flag;
  }
  if (c.text.empty()) throw UsageError("corpus '" + c.name + "' is empty");
  if (static_cast<int64_t>(c.text.size()) < min_bytes) {
    throw UsageError("corpus '" + c.name + "' has " + std::to_string(c.text.size()) +
                     " bytes; at least " + std::to_string(min_bytes) + " are needed");
  }
  std::set<unsigned char> bytes(c.text.begin(), c.text.end());
  c.vocab.assign(bytes.begin(), bytes.end());
  int64_t index[256] = {};
  for (size_t i = 0; i < c.vocab.size(); ++i) index[static_cast<unsigned char>(c.vocab[i])] = i;
  c.tokens = at::empty({static_cast<int64_t>(c.text.size())}, at::kLong);
  auto* t = c.tokens.data_ptr<int64_t>();
  for (size_t i = 0; i < c.text.size(); ++i) t[i] = index[static_cast<unsigned char>(c.text[i])];
  c.fingerprint = fnv1a(c.text);
  return c;
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

}  // namespace examples
