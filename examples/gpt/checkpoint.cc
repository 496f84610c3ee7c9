// gpt's checkpoints (examples/gpt/checkpoint.h).
#include "examples/gpt/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <stdexcept>

#include "examples/flags.h"

namespace gpt {

namespace ck = tandem::checkpoint;
namespace fs = std::filesystem;

namespace {

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : " ") + std::to_string(x);
  return s;
}

std::vector<int64_t> split(const std::string& s) {
  std::vector<int64_t> v;
  std::istringstream in(s);
  for (long long x; in >> x;) v.push_back(x);
  return v;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

std::map<std::string, std::string> checkpoint_meta(const Checkpoint& c) {
  return {{"seed", std::to_string(c.seed)},
          {"corpus_fnv", std::to_string(c.corpus_fnv)},
          {"shape", join(c.shape)},
          {"counts", join(c.counts)},
          {"mode", c.mode},
          {"program", "gpt"}};
}

void check_directory(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    throw examples::UsageError("--checkpoint '" + dir +
                               "' is a file (an older gpt's checkpoint?): it names a directory");
  }
}

Saver::Saver(const std::string& dir, bool sync) : dir_(dir), sync_(sync) { check_directory(dir); }

Saver::~Saver() = default;  // (the AsyncSaver waits for the save in flight)

void Saver::save(int64_t step, const ck::JobState& state, const ck::SaveOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  if (sync_) {
    ck::Part part = state.part();
    copy_ms_.push_back(ms_since(t0));
    ck::save_parts(dir_, step, part, state.remote_writers(), options);
  } else {
    if (!async_) async_ = std::make_unique<ck::AsyncSaver>(dir_, options);
    // The step waits for the copies (here and on the stage workers) and,
    // when it is not done, for the save before.
    async_->save(step, state.part(), state.remote_writers());
    copy_ms_.push_back(ms_since(t0) - async_->last_wait_ms());
  }
  stall_ms_.push_back(ms_since(t0));
}

void Saver::finish() {
  if (async_) async_->wait();
}

std::string Saver::summary() const {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%zu checkpoint(s) %s to %s; a save held its step %.2f ms (median; copying "
                "the state to host memory %.2f ms)",
                stall_ms_.size(), sync_ ? "written in the step" : "written in the background",
                dir_.c_str(), median(stall_ms_), median(copy_ms_));
  return buf;
}

void refuse_foreign(const std::string& dir) {
  const std::optional<ck::Found> found = ck::latest(dir);
  if (!found) return;
  try {
    const ck::Reader r(found->path);
    const auto it = r.meta().find("program");
    if (it != r.meta().end() && it->second != "gpt") {
      throw examples::UsageError("--checkpoint '" + dir + "' holds " + it->second +
                                 "'s checkpoints, not gpt's: pass another directory");
    }
  } catch (const std::invalid_argument&) {
    // (a damaged newest step is gpt's to clear)
  }
}

std::optional<Checkpoint> load_latest(const std::string& dir, bool strict) {
  std::vector<std::string> passed_over;
  std::optional<ck::Found> found;
  try {
    ck::LatestOptions options = ck::LatestOptions::verified(strict);
    options.passed_over = &passed_over;
    found = ck::latest(dir, options);
  } catch (const std::invalid_argument& e) {
    throw examples::UsageError(std::string(e.what()) +
                               " (--strict-resume: without it, the newest whole step is taken)");
  }
  for (const auto& s : passed_over) {
    std::fprintf(stderr, "gpt: passed over a damaged checkpoint: %s\n", s.c_str());
  }
  if (!found) return std::nullopt;
  try {
    ck::Reader r(found->path);
    Checkpoint c;
    c.step = r.step();
    const auto& meta = r.meta();
    for (const char* key : {"seed", "corpus_fnv", "shape", "counts", "mode"}) {
      if (!meta.count(key)) {
        throw std::invalid_argument(found->path + " is not a gpt checkpoint (no " + key + ")");
      }
    }
    c.seed = std::stoll(meta.at("seed"));
    c.corpus_fnv = std::stoull(meta.at("corpus_fnv"));
    c.shape = split(meta.at("shape"));
    c.counts = split(meta.at("counts"));
    c.mode = meta.at("mode");
    if (meta.count("program") && meta.at("program") != "gpt") {
      throw std::invalid_argument(found->path + " is " + meta.at("program") +
                                  "'s checkpoint, not gpt's: pass another --checkpoint");
    }
    if (c.shape.size() != 4) throw std::invalid_argument(found->path + ": a bad shape");
    c.vocab = r.bytes("vocab");
    c.path = found->path;
    // (the model and Adam's state are loaded by name where they live)
    const auto names = r.names();
    if (std::none_of(names.begin(), names.end(),
                     [](const std::string& n) { return n.rfind("model.", 0) == 0; })) {
      throw std::invalid_argument(found->path + " holds no model (no model.<name>)");
    }
    if (std::none_of(names.begin(), names.end(),
                     [](const std::string& n) { return n.rfind("adam/", 0) == 0; })) {
      throw std::invalid_argument(found->path +
                                  " is an older gpt's checkpoint (no optimizer state by "
                                  "parameter): it does not resume; start afresh");
    }
    return c;
  } catch (const std::invalid_argument& e) {
    throw examples::UsageError(e.what());
  }
}

}  // namespace gpt
