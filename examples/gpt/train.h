// gpt's training, on each replica's driver (the rank at pp = 0): builds the
// replica's pipe from the layer specs (model.h), trains it with Adam, global
// clipping and a cosine schedule with warm-up, averages the loss over the
// replicas for the progress lines, writes the checkpoint (rank 0), and at
// the end prints the final loss and a line of generated text (rank 0).
#pragma once

#include <optional>

#include "examples/gpt/checkpoint.h"
#include "examples/gpt/config.h"
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

// The stages of the schedule: pp, or 2 x pp for interleaved (two a worker).
int64_t stage_count(const Config& cfg);

}  // namespace gpt
