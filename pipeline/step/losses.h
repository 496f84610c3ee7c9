#pragma once
// The pipeline's losses by name, per process: the built-in ones and those
// pipeline::register_loss (pipe.h) added. The last stage's worker looks its
// step's loss up here (stage_service.cc) when the step starts.
#include <string>

#include "tandem/pipeline/pipe.h"

namespace tandem::pipeline::step {

// The loss `name`; std::invalid_argument naming `where` (the worker) and the
// known names when there is none.
LossFn loss_named(const std::string& name, const std::string& where);

}  // namespace tandem::pipeline::step
