#pragma once
// Checkpoint parts written where the state lives: a RemoteModule's owner
// writes the module's parameters and buffers into a part of its own, and
// reads them back from the step, so a job's pieces spread over workers are
// saved by those workers, in parallel, and nothing crosses the wire but
// the part's index.
//
//   checkpoint::JobState state;                       // on the driver
//   state.remote_module("stage1", stage1)             // its owner writes it
//        .remote_module("stage2", stage2)
//        .record("step", &step_text);
//   checkpoint::save_job(dir, step, state);           // parts 0 (here), 1, 2 (owners)
//   ...
//   checkpoint::load_latest_job(dir, state);          // each owner reads its own
//
// What it promises:
//  1. The owner writes "<prefix>.<name>" for each of the module's parameters
//     and buffers (names as in state_dict()); the step's other parts and the
//     manifest are the caller's (checkpoint::save_parts / commit).
//  2. Loading reads "<prefix>.<name>" from whichever part holds it (so a
//     module saved by one owner loads on another, or from a part the driver
//     wrote), on the owner: each missing name or other shape is named in one
//     std::invalid_argument-like error, and nothing is loaded then.
//  3. A DistributedOptimizer's owners write and read the state of the
//     parameters they step, by the parameters' names (as JobState's
//     optimizers do), so it loads into another placement of them.
//  4. The owner copies a module's tensors without a lock of its own: no
//     step may run on the module while its copy is made (a save between
//     steps, as a training loop makes it, is; a module several trainers
//     step at once is not).
//  5. The owner reads the step's files itself: the checkpoint directory must
//     be on a file system every owner sees (as a job's shared storage is).
#include <cstdint>
#include <string>

#include "tandem/checkpoint/checkpoint.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/remote_module/remote_module.h"

namespace tandem::checkpoint {

// Asks `m`'s owner to copy the module's state into its host memory and to
// write it as part `part` of `dir`'s step on a thread of its own; the
// RemotePart waits for the copy, and for the part to be durable (its index,
// for commit()). `first_layer` >= 0: the module is a stage of a
// Sequential cut into stages (pipeline::partition), its tensors saved by
// the model's layer indices ("0.weight" of a stage that starts at the
// model's layer 3 as "<prefix>.3.weight"), so that the checkpoint loads
// into any other cut.
RemotePart save_module_part(const nn::RemoteModule& m, const std::string& dir, int64_t step,
                            int part, const std::string& prefix, int64_t first_layer = -1);
// The writer save_parts() calls for `m` (which must outlive it).
RemotePartWriter module_writer(const nn::RemoteModule& m, const std::string& prefix,
                               int64_t first_layer = -1);
// `m`'s owner loads its tensors from the committed step at `path`
// (Reader::path(), Found::path); `check_only`: checks every name and shape
// and loads nothing.
void load_module_part(const nn::RemoteModule& m, const std::string& path, const std::string& prefix,
                      int64_t first_layer = -1, bool check_only = false);

// A DistributedOptimizer's state, written by its owners: each owner writes
// "<prefix>/<name>" for the parameters its optimizer steps (optim/
// param_state.h's bytes; a sharded owner, its replica's share), `names`
// naming the optimizer's parameters in the constructor's order. One writer
// per owner.
std::vector<RemotePartWriter> optimizer_writers(const optim::DistributedOptimizer& opt,
                                                const std::vector<std::string>& names,
                                                const std::string& prefix);
// Each owner loads the state of the parameters it steps now by their names,
// from whichever part holds them (another placement's, a LibTorch
// optimizer's saved by JobState), and takes opt.lr() as its rate; a name
// the step lacks is refused, naming it, before any owner loads.
void load_optimizer_parts(const optim::DistributedOptimizer& opt,
                          const std::vector<std::string>& names, const std::string& path,
                          const std::string& prefix, bool check_only = false);

}  // namespace tandem::checkpoint
