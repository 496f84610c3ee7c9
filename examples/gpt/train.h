// gpt's training, on each replica's driver (the rank at pp = 0): builds the
// replica's pipe from the layer specs (model.h), trains it with Adam, global
// clipping and a cosine schedule with warm-up, averages the loss over the
// replicas for the progress lines, writes the checkpoint (rank 0), and at
// the end prints the final loss and a line of generated text (rank 0).
#pragma once

#include <optional>
#include <utility>

#include "examples/gpt/checkpoint.h"
#include "examples/gpt/config.h"
#include "examples/gpt/model.h"
#include "examples/text.h"
#include "tandem/mesh/mesh.h"

namespace gpt {

struct Job {
  const Config& cfg;
  const examples::Corpus& corpus;
  const std::optional<Checkpoint>& resume;
  tandem::Mesh& mesh;
  Clock::time_point started;
};

// Returns the exit code.
int drive(const Job& job);
// --zero 2 or 3 (with --pp 1): every rank trains the whole model, under DDP
// with sharded gradients and a ZeroRedundancyOptimizer (2), or
// FullyShardedDataParallel with each block a unit (3) (data_parallel.cc).
int drive_data_parallel(const Job& job);

// --ft (fault_tolerant.cc): this rank's stage of its row, under
// ft::Manager; and --reference: the same training in one process.
int drive_fault_tolerant(const Config& cfg, const examples::Corpus& corpus);
int ft_reference(const Config& cfg, const examples::Corpus& corpus);

// The trained parameters in two numbers that every layout prints alike (to
// float rounding): the whole model's norm and its dot product with a fixed
// random vector (each parameter's part drawn from a generator seeded by
// its name's hash, examples::fnv1a). `mine`: the parameters this rank
// holds, named as the whole model's (with --tp its slices of the split
// ones, cut alike from the random vector, and its copies of the others,
// which tp rank 0 counts); `whole`: the whole model's (their shapes). The
// sums are added over the mesh's tp group: collective over it.
std::pair<double, double> fingerprint(const Named& mine, const Named& whole, tandem::Mesh& mesh);

// A checkpoint after `done` steps, holding what says which run it is of
// (seed, text, model shape); the caller adds the model and the optimizer.
Checkpoint checkpoint_at(const Job& job, int64_t done);

// The learning rate's factor at `step`: linear warm-up, then a cosine down
// to a tenth.
double lr_factor(const Config& cfg, int64_t step);

// The stages of the schedule: pp, or 2 x pp for interleaved (two a worker).
int64_t stage_count(const Config& cfg);

}  // namespace gpt
