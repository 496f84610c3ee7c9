#include "tandem/pipeline/step/errors.h"

namespace tandem::pipeline::step {

std::string pass_name(const Action& pass, const std::string& worker) {
  return std::string(kind_name(pass.kind)) + " of micro-batch " + std::to_string(pass.chunk) +
         " through stage " + std::to_string(pass.stage) + " on " + worker;
}

StepAborted::StepAborted(const std::string& why) : std::runtime_error(kMarker + why), why_(why) {}

PassError::PassError(const Action& pass, const std::string& worker, const std::string& cause)
    : std::runtime_error(pass_name(pass, worker) + ": " + cause), pass_(pass) {}

PassTimeoutError::PassTimeoutError(const Action& pass, const std::string& worker,
                                   const std::string& cause)
    : rpc::TimeoutError(pass_name(pass, worker) + ": " + cause), pass_(pass) {}

bool is_step_aborted(const std::exception& error) {
  if (dynamic_cast<const StepAborted*>(&error)) return true;
  // Over the wire only the text came (errors.h): the marker stands for the type.
  const auto* remote = dynamic_cast<const rpc::RemoteError*>(&error);
  return remote && remote->remote_message().rfind(StepAborted::kMarker, 0) == 0;
}

}  // namespace tandem::pipeline::step
