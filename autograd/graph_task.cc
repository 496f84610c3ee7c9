#include "tandem/autograd/graph_task.h"

#include "tandem/rpc/errors.h"

namespace tandem::autograd {

void GraphTask::fail(std::exception_ptr error) {
  std::function<void(std::exception_ptr)> to_root;
  bool answered;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (final_locked()) return;
    answered = phase == Phase::kDone;
    if (answered) to_root = report;
    stop_locked(Phase::kFailed);
  }
  if (!answered) {
    done->setError(error);
  } else if (to_root) {
    to_root(error);  // `done` already said this part was fine
  }
}

void GraphTask::abort(const std::string& worker, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu);
    report = nullptr;
    if (final_locked()) return;
    const bool answered = phase == Phase::kDone;
    stop_locked(Phase::kAborted);
    if (answered) return;
  }
  done->setError(std::make_exception_ptr(rpc::ShutdownError(
      "distributed backward task " + std::to_string(id) + " on " + worker + ": " + why)));
}

void GraphTask::close() {
  std::lock_guard<std::mutex> lock(mu);
  report = nullptr;
  if (!final_locked()) stop_locked(Phase::kClosed);
}

}  // namespace tandem::autograd
