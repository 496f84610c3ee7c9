#include "tandem/optim/nonfinite.h"

#include <ATen/ops/tensor.h>

#include <cmath>
#include <cstdio>

#include "tandem/ddp/process_group.h"

namespace tandem::optim {

NonFinite non_finite_from_string(const std::string& text) {
  if (text == "skip") return NonFinite::kSkip;
  if (text == "stop") return NonFinite::kStop;
  throw std::invalid_argument("'" + text + "' is neither skip nor stop (what a step whose loss " +
                              "or gradient norm is not finite does)");
}

const char* to_string(NonFinite policy) { return policy == NonFinite::kSkip ? "skip" : "stop"; }

NonFiniteGuard::NonFiniteGuard(NonFinite policy, std::shared_ptr<ddp::ProcessGroup> agree)
    : policy_(policy), agree_(std::move(agree)) {}

namespace {
std::string number(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}
}  // namespace

bool NonFiniteGuard::check(int64_t step, double loss, double grad_norm) {
  ++checked_;
  bool bad = !std::isfinite(loss) || !std::isfinite(grad_norm);
  bool elsewhere = false;
  if (agree_ && agree_->size() > 1) {
    at::Tensor flag = at::tensor({bad ? 1.0 : 0.0}, at::kDouble);
    agree_->all_reduce(flag, ddp::ReduceOp::kMax);
    elsewhere = !bad && flag.item<double>() > 0;
    bad = bad || elsewhere;
  }
  if (!bad) return true;
  std::string what = "step " + std::to_string(step) + ": ";
  if (elsewhere) {
    what += "the loss or the gradient norm is not finite on another rank";
  } else if (!std::isfinite(loss) && !std::isfinite(grad_norm)) {
    what += "the loss (" + number(loss) + ") and the gradient norm (" + number(grad_norm) +
            ") are not finite";
  } else if (!std::isfinite(loss)) {
    what += "the loss is " + number(loss);
  } else {
    what += "the gradient norm is " + number(grad_norm);
  }
  if (policy_ == NonFinite::kStop) {
    throw NonFiniteError(step, what + " (stopping: the non-finite policy is 'stop')");
  }
  skipped_steps_.push_back(step);
  return false;
}

}  // namespace tandem::optim
