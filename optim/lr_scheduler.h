// Learning-rate schedules for a DistributedOptimizer, after PyTorch's
// torch.optim.lr_scheduler: the schedule computes the rate of each epoch
// and sets it on every owner at once (DistributedOptimizer::set_lr).
//
//   optim::DistributedOptimizer opt(optim::Kind::kSGD, params, o);
//   optim::CosineAnnealingLR sched(opt, /*T_max=*/100);
//   for (int epoch = 0; epoch < 100; ++epoch) {
//     ... train an epoch with opt.step(ctx.id()) ...
//     sched.step();                       // the next epoch's rate, on every owner
//   }
//
// What it promises:
//  1. base_lr is the optimizer's lr() when the schedule is made, and
//     last_epoch starts at 0. As PyTorch's schedulers do, the constructor
//     sets the rate of epoch 0 (for StepLR and CosineAnnealingLR it is
//     base_lr: nothing is sent; for LambdaLR base_lr * factor(0)).
//  2. step() advances one epoch and sets get_lr(), the rate of last_epoch,
//     which is the closed form of the schedule (below) in base_lr and the
//     epoch, never a product of earlier rates, so a restored schedule goes
//     on with the very rates an uninterrupted one has.
//  3. One rate for all param groups (the DistributedOptimizer has one).
//  4. Checkpoints: state() is {last_epoch, base_lr}; load_state(s) takes
//     them and sets the rate of that epoch. Keep it beside the optimizer's
//     checkpoint (DistributedOptimizer::save), which holds the rate too.
//  5. The schedule holds a reference to the optimizer, which must outlive it.
//     Bad arguments are std::invalid_argument naming the value.
#pragma once

#include <cstdint>
#include <functional>

#include "tandem/optim/distributed_optimizer.h"

namespace tandem::optim {

class LRScheduler {
 public:
  struct State {
    int64_t last_epoch = 0;
    double base_lr = 0;
  };

  explicit LRScheduler(DistributedOptimizer& optimizer);
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances one epoch and sets its rate on every owner.
  void step();
  int64_t last_epoch() const { return last_epoch_; }
  double base_lr() const { return base_lr_; }
  // The rate of last_epoch.
  double get_lr() const { return lr_at(last_epoch_); }
  // The rate of any epoch (the schedule's closed form).
  virtual double lr_at(int64_t epoch) const = 0;

  State state() const { return {last_epoch_, base_lr_}; }
  // Takes a state() (last_epoch >= 0, base_lr a finite number >= 0) and sets
  // the rate of its epoch on every owner.
  void load_state(const State& state);

 protected:
  // Sets the rate of epoch 0 unless it is the optimizer's already: the
  // subclasses' constructors end with it (a base constructor cannot call lr_at).
  void start();

 private:
  DistributedOptimizer& optimizer_;
  int64_t last_epoch_ = 0;
  double base_lr_;
};

// base_lr * gamma^(epoch / step_size), the division an integer one:
// multiplied by gamma every step_size epochs. step_size > 0, gamma a
// finite number >= 0.
class StepLR final : public LRScheduler {
 public:
  StepLR(DistributedOptimizer& optimizer, int64_t step_size, double gamma = 0.1);
  double lr_at(int64_t epoch) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2: from
// base_lr at epoch 0 down to eta_min at T_max (and back up after it, as
// PyTorch's closed form does). T_max > 0, eta_min a finite number >= 0.
class CosineAnnealingLR final : public LRScheduler {
 public:
  CosineAnnealingLR(DistributedOptimizer& optimizer, int64_t T_max, double eta_min = 0);
  double lr_at(int64_t epoch) const override;

 private:
  int64_t t_max_;
  double eta_min_;
};

// base_lr * factor(epoch): the user's own schedule. factor must be set;
// a rate it makes negative or not finite is refused by set_lr.
class LambdaLR final : public LRScheduler {
 public:
  LambdaLR(DistributedOptimizer& optimizer, std::function<double(int64_t epoch)> factor);
  double lr_at(int64_t epoch) const override;

 private:
  std::function<double(int64_t)> factor_;
};

}  // namespace tandem::optim
