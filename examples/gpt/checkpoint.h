// gpt's checkpoints: a directory of steps written with tandem::checkpoint
// (checkpoint/checkpoint.h): every --checkpoint-every steps and at the end,
// rank 0 hands the step's state to an AsyncSaver (the step waits only for
// the copy) and a thread writes DIR/step-NNNNNNNNNN/ and commits it with its
// manifest; the last two are kept. A restarted job (tandem-run
// --max-restarts, torchrun) or --resume continues from checkpoint::latest.
//
// A step of the pipeline's path holds, each piece written where it lives
// (checkpoint::JobState, checkpoint/remote.h), all by the whole model's names:
//   entries  model.<name>   each stage's tensors, written by its stage worker
//                           by the model's layer indices ("3.attn.qkv.weight")
//            adam/<name>    Adam's state of each parameter, written by the
//                           worker whose optimizer steps it (with --zero 1,
//                           each replica's owner its share)
//            vocab          the text's vocabulary (rank 0)
//   meta     seed, corpus_fnv, shape (layers dim heads context),
//            counts (layers per pipeline stage, in stage order), mode
//            ("pipeline", "zero2", "zero3"), program ("gpt")
// --zero 2 saves the same names with checkpoint::JobState from every rank
// (model.<name> from rank 0, adam/<name> each rank its share), and --zero 3
// the same names in slices (model.<name>#<start>:<end>, adam/<name>#..:
// each rank the pieces of the parameters its FSDP shards hold), so each
// path resumes the others' steps. With --tp, each tp rank's stage workers
// and optimizer owners write their pieces of the split parameters as
// slices of the whole ones (<name>#<start>:<end> along rows,
// <name>#d1:<start>:<end> for a block of columns; checkpoint/placement.h),
// tp rank 0's the replicated ones, so any --tp resumes any other's.
// Every replica's parameters and optimizer state are the same (they average
// their gradients), so one copy is the job's; the LR schedule is a function
// of the step, and the batches of step s are a function of (seed, s), so a
// resumed run goes on exactly as an uninterrupted one would, with any --dp
// (the global batch stays --batch), and with any --pp or schedule: the
// stage workers of the new cut load their layers, and the owners of the
// new placement their parameters' state, by name. A checkpoint of another
// model is refused.
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
#include "tandem/checkpoint/job.h"

namespace gpt {

struct Checkpoint {
  int64_t step = 0;
  int64_t seed = 0;
  uint64_t corpus_fnv = 0;
  std::string vocab;
  std::vector<int64_t> shape;   // layers, dim, heads, context
  std::vector<int64_t> counts;  // layers per stage
  std::string mode = "pipeline";
  std::string path;  // the step's directory (load_latest)
};

// The meta every gpt step carries.
std::map<std::string, std::string> checkpoint_meta(const Checkpoint& ck);

// Rank 0's writer of a job's checkpoints, in the background (or, with
// `sync`, in the step), and how long saving held the steps up.
class Saver {
 public:
  Saver(const std::string& dir, bool sync);
  ~Saver();
  // The pipeline's: `state`'s part here and its remote parts by the stage
  // workers, each copied before this returns, written meanwhile; options:
  // the meta and, where several drivers save together, their group.
  void save(int64_t step, const tandem::checkpoint::JobState& state,
            const tandem::checkpoint::SaveOptions& options);
  // Waits for the last save to be committed (throws its error).
  void finish();
  // "N checkpoints ..., a save held its step X ms (median) ...": for the end.
  std::string summary() const;

 private:
  std::string dir_;
  bool sync_;
  std::unique_ptr<tandem::checkpoint::AsyncSaver> async_;
  std::vector<double> copy_ms_, stall_ms_;
};

// A UsageError when --checkpoint names a file (an older gpt's checkpoint?).
void check_directory(const std::string& dir);

// The newest checkpoint in `dir` whose every part is whole (nullopt: none);
// each newer one it passed over, incomplete or damaged (a part missing,
// truncated or failing its checksum), is printed to stderr with the file and
// what is wrong. With `strict`, a damaged newest step throws UsageError
// naming the file instead.
std::optional<Checkpoint> load_latest(const std::string& dir, bool strict = false);
// A UsageError when `dir`'s newest step is another program's (its meta's
// "program"): a fresh run must not clear what is not gpt's.
void refuse_foreign(const std::string& dir);

}  // namespace gpt
