// gpt's checkpoints: a directory of steps written with tandem::checkpoint
// (checkpoint/checkpoint.h): every --checkpoint-every steps and at the end,
// rank 0 hands the step's state to an AsyncSaver (the step waits only for
// the copy) and a thread writes DIR/step-NNNNNNNNNN/ and commits it with its
// manifest; the last two are kept. A restarted job (tandem-run
// --max-restarts, torchrun) or --resume continues from checkpoint::latest.
//
// A step of the pipeline's path holds (rank 0 writes it all):
//   entries  model.<name>   the whole model's tensors by their names ("3.attn.qkv.weight")
//            optim          replica 0's DistributedOptimizer state, each part's
//                           rank replaced by its owner's stage worker index
//                           (its pp coordinate), so any replica can take it
//                           (optim/optimizer_state.h's bytes, hash-checked)
//            vocab          the text's vocabulary
//   meta     seed, corpus_fnv, shape (layers dim heads context),
//            counts (layers per pipeline stage, in stage order), mode
//            ("pipeline", "zero2", "zero3")
// --zero 2 saves its step with checkpoint::JobState (checkpoint/job.h),
// every rank its own part: model.<name> (rank 0), adam/<name> (each rank
// its share of Adam's state), vocab; the same meta. --zero 3 saves the
// model alone (rank 0) and does not resume.
// Every replica's parameters and optimizer state are the same (they average
// their gradients), so one copy is the job's; the LR schedule is a function
// of the step, and the batches of step s are a function of (seed, s), so a
// resumed run goes on exactly as an uninterrupted one would, with any --dp
// (the global batch stays --batch), and with any --pp or schedule: the
// model is saved by its layers' names, and the optimizer state is cut again
// by parameter names for the stages and workers this job places the layers
// on (optim/reshard.h). A checkpoint of another model is refused.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "examples/gpt/model.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/optim/optimizer_state.h"

namespace gpt {

struct Checkpoint {
  int64_t step = 0;
  int64_t seed = 0;
  uint64_t corpus_fnv = 0;
  std::string vocab;
  std::vector<int64_t> shape;   // layers, dim, heads, context
  std::vector<int64_t> counts;  // layers per stage
  std::string mode = "pipeline";
  Named model;
  tandem::optim::OptimizerState optim;  // (the pipeline's; none for --zero 2)
};

// The meta every gpt step carries.
std::map<std::string, std::string> checkpoint_meta(const Checkpoint& ck);

// Rank 0's writer of a job's checkpoints, in the background (or, with
// `sync`, in the step), and how long saving held the steps up.
class Saver {
 public:
  Saver(const std::string& dir, bool sync);
  ~Saver();
  // Marks the start of a save: gathering the state from its workers counts
  // as copying it (optional; else save() starts the clock).
  void begin();
  // `ck`'s state is copied here; the write goes on after return.
  void save(const Checkpoint& ck);
  // Waits for the last save to be committed (throws its error).
  void finish();
  // "N checkpoints ..., a save held its step X ms (median) ...": for the end.
  std::string summary() const;

 private:
  std::string dir_;
  bool sync_;
  std::unique_ptr<tandem::checkpoint::AsyncSaver> async_;
  std::vector<double> copy_ms_, stall_ms_;
  std::optional<std::chrono::steady_clock::time_point> begun_;
};

// The newest complete checkpoint in `dir` (nullopt: none); each newer,
// incomplete one it passed over is printed to stderr. A damaged step (a
// part that fails its checksum) throws UsageError naming the file.
std::optional<Checkpoint> load_latest(const std::string& dir);

// Removes the step directories in `dir` (a fresh run must not continue an
// older one's steps); returns how many.
int clear_checkpoints(const std::string& dir);

}  // namespace gpt
