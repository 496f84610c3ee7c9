// char_lm's checkpoints: a directory of steps (tandem::checkpoint), written
// every --checkpoint-every steps and at the end by a single-mode run, the
// last two kept; --resume, or a restart of the job (tandem-run
// --max-restarts), goes on from the newest complete one. main.cc finds it
// (and checks it against the corpus and the flags) before training; train.cc
// registers the job's pieces (checkpoint::JobState) and saves and loads
// them, each where it lives:
//   entries  lstm.<name>        the trainer's LSTM (worker0's part)
//            embedding.<name>,  the two RemoteModules, each written and read
//            decoder.<name>     by their owner, the parameter server
//            adam/<name>        Adam's state of each of those parameters, by
//                               the worker whose optimizer steps it
//            vocab              the text's vocabulary
//   meta     seed, corpus_fnv   the seed the steps were drawn with, and the
//                               FNV-1a hash of the text
//            program            "char_lm": a fresh run clears only its own steps
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace char_lm {

struct Checkpoint {
  int64_t step = 0;
  int64_t seed = 0;
  uint64_t corpus_fnv = 0;
  std::string path;  // the step's directory
};

// The newest complete checkpoint in `dir` (nullopt: none); a step that is
// another program's, or a `dir` that is a file (an older char_lm's
// checkpoint), is a UsageError.
std::optional<Checkpoint> load_latest(const std::string& dir);

}  // namespace char_lm
