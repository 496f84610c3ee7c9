// Loading a TorchScript file as a served module (the owner's side of
// RemoteModule::from_torchscript). Not installed.
#pragma once

#include <memory>
#include <string>

#include "tandem/remote_module/served.h"

namespace tandem::nn {

// Loads `path` with torch::jit::load; a missing or unreadable file, or one
// that is not TorchScript, throws std::invalid_argument naming the path and
// `worker`.
std::shared_ptr<Served> load_torchscript(const std::string& path, const std::string& worker);

}  // namespace tandem::nn
