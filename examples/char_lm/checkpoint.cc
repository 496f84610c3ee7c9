// char_lm's checkpoints (examples/char_lm/checkpoint.h).
#include "examples/char_lm/checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <stdexcept>

#include "examples/char_lm/config.h"
#include "tandem/checkpoint/checkpoint.h"

namespace char_lm {

std::optional<Checkpoint> load_latest(const std::string& dir) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
    throw UsageError("--checkpoint '" + dir +
                     "' is a file (an older char_lm's checkpoint?): it names a directory");
  }
  const auto found = tandem::checkpoint::latest(dir);
  if (!found) return std::nullopt;
  for (const auto& s : found->skipped) std::fprintf(stderr, "char_lm: passed over %s\n", s.c_str());
  try {
    tandem::checkpoint::Reader r(found->path);
    const auto program = r.meta().find("program");
    if (program == r.meta().end() || program->second != "char_lm") {
      throw std::invalid_argument(
          "--checkpoint '" + dir + "' holds " +
          (program == r.meta().end() ? std::string("another program") : program->second) +
          "'s checkpoints, not char_lm's: pass another directory");
    }
    for (const char* key : {"seed", "corpus_fnv"}) {
      if (!r.meta().count(key)) {
        throw std::invalid_argument(found->path + " is not a char_lm checkpoint (no " + key + ")");
      }
    }
    Checkpoint ck;
    ck.step = r.step();
    ck.seed = std::stoll(r.meta().at("seed"));
    ck.corpus_fnv = std::stoull(r.meta().at("corpus_fnv"));
    ck.path = found->path;
    return ck;
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

}  // namespace char_lm
