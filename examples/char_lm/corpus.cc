// The text and the batches (examples/char_lm/corpus.h).
#include "examples/char_lm/corpus.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <vector>

namespace char_lm {
namespace {

namespace fs = std::filesystem;

constexpr const char* kDefaultCorpus = "/usr/share/common-licenses";

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw UsageError("cannot read '" + p.string() + "'");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

Corpus load_corpus(const std::string& flag) {
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
  if (static_cast<int64_t>(c.text.size()) < kWindow + 1) {
    throw UsageError("corpus '" + c.name + "' has " + std::to_string(c.text.size()) +
                     " bytes; at least " + std::to_string(kWindow + 1) + " are needed");
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

Batch batch_at(const Corpus& c, int64_t seed, int64_t step) {
  // splitmix64 of (seed, step): neighbouring steps get unrelated streams.
  uint64_t z = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step) +
               0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(z);
  const int64_t n = c.tokens.size(0);
  at::Tensor starts = at::randint(0, n - kWindow, {kBatch, 1}, gen, at::kLong);
  at::Tensor windows = c.tokens.index_select(0, (starts + at::arange(kWindow + 1)).reshape(-1))
                           .view({kBatch, kWindow + 1});
  return {windows.narrow(1, 0, kWindow), windows.narrow(1, 1, kWindow)};
}

}  // namespace char_lm
