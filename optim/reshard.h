// A DistributedOptimizer's checkpoint cut again for another placement of the
// same parameters, matched by their names: a job saved with its stages on
// two workers continues with them on one, or on three.
//
//   // The parameters each part's owner steps, in its optimizer's order (the
//   // order they were given to the DistributedOptimizer, that owner's only).
//   std::vector<optim::OwnerLayout> saved = ...;   // as the checkpoint was written
//   std::vector<optim::OwnerLayout> now = ...;     // as this job places them
//   optim::OptimizerState state = optim::reshard_state(checkpoint, saved, now, options);
//   opt.load_state_dict(state);
//
// What it promises: each parameter's state (Adam's moments and step, SGD's
// momentum, ...) is moved whole, as LibTorch keeps it, from the part that
// held it to the part that now holds its name; nothing is recomputed, so a
// resharded job steps exactly as the saved one would have. The learning
// rate and the kind travel unchanged; the other hyper-parameters are
// `options`' (as in load_state_dict). It refuses, with std::invalid_argument
// naming the parameter or part: a layout whose part count or parameter
// counts differ from the checkpoint's, a name given twice, a name one side
// has and the other not, a shape that differs, and a part that is not a
// LibTorch archive of that optimizer over the parameters the layout names.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/optim/optimizer_state.h"
#include "tandem/optim/options.h"

namespace tandem::optim {

struct OwnerLayout {
  int rank = -1;                             // the owner (a part's rank)
  std::string worker;                        // its name
  std::vector<std::string> names;            // its parameters, in its optimizer's order
  std::vector<std::vector<int64_t>> shapes;  // theirs, in the same order
};

OptimizerState reshard_state(const OptimizerState& state, const std::vector<OwnerLayout>& saved,
                             const std::vector<OwnerLayout>& now, const Options& options);

}  // namespace tandem::optim
