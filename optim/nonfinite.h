#pragma once
// What a training step does when its loss or its gradients are not finite
// numbers (NaN, an infinity): skip it, as Megatron-LM and DeepSpeed skip an
// iteration whose gradients overflowed, or stop the job with an error that
// names the step. The user chooses; nothing steps on a NaN unasked.
//
//   optim::NonFiniteGuard guard(optim::NonFinite::kSkip);
//   for (int64_t step = start; step < steps; ++step) {
//     double loss = pipe.step(ctx, x, y);
//     double norm = opt.clip_grad_norm(ctx, 1.0);     // the global norm
//     if (guard.check(step + 1, loss, norm)) {        // false: skipped
//       opt.step(ctx);
//       sched.step();
//     }
//   }
//   guard.skipped();                                  // for the job's metrics
//
// 1. check() is true when `loss` and `grad_norm` are both finite. Pass the
//    values every rank of the job computed alike (the loss averaged over
//    the replicas, the norm of the averaged gradients) and every rank
//    decides alike; with `agree` set, the ranks of that group also agree
//    first (one all-reduce of a flag: any rank's non-finite value counts
//    for all), for values that differ between ranks.
// 2. A non-finite step under kSkip returns false and is counted; the caller
//    takes no optimizer step for it (its gradients are dropped with the
//    step: a distributed autograd context, or zero_grad before the next).
//    Under kStop it throws NonFiniteError naming the step and what was not
//    finite, on every rank alike.
// 3. Whether a learning-rate schedule advances on a skipped step is the
//    caller's: Megatron and DeepSpeed hold it, so the updates taken follow
//    the schedule as if the step had not been there; a schedule that is a
//    function of the step number (gpt's) moves on, so that a resumed run,
//    which restores it from the step, follows the same rates.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace tandem::ddp {
class ProcessGroup;
}

namespace tandem::optim {

enum class NonFinite { kSkip, kStop };

// "skip" or "stop"; std::invalid_argument naming the text otherwise.
NonFinite non_finite_from_string(const std::string& text);
const char* to_string(NonFinite policy);

// What check() throws under kStop.
class NonFiniteError : public std::runtime_error {
 public:
  NonFiniteError(int64_t step, const std::string& what)
      : std::runtime_error(what), step_(step) {}
  int64_t step() const { return step_; }

 private:
  int64_t step_;
};

class NonFiniteGuard {
 public:
  explicit NonFiniteGuard(NonFinite policy = NonFinite::kStop,
                          std::shared_ptr<ddp::ProcessGroup> agree = nullptr);

  // 1. and 2.: whether step `step` may update the parameters.
  bool check(int64_t step, double loss, double grad_norm);

  NonFinite policy() const { return policy_; }
  int64_t checked() const { return checked_; }
  int64_t skipped() const { return static_cast<int64_t>(skipped_steps_.size()); }
  const std::vector<int64_t>& skipped_steps() const { return skipped_steps_; }

 private:
  NonFinite policy_;
  std::shared_ptr<ddp::ProcessGroup> agree_;
  int64_t checked_ = 0;
  std::vector<int64_t> skipped_steps_;
};

}  // namespace tandem::optim
