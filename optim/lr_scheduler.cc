#include "tandem/optim/lr_scheduler.h"

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>

namespace tandem::optim {
namespace {

std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

bool finite_non_negative(double v) { return v >= 0 && !std::isinf(v); }

}  // namespace

LRScheduler::LRScheduler(DistributedOptimizer& optimizer)
    : optimizer_(optimizer), base_lr_(optimizer.lr()) {}

void LRScheduler::start() {
  const double lr = get_lr();
  if (lr != optimizer_.lr()) optimizer_.set_lr(lr);
}

void LRScheduler::step() {
  const double lr = lr_at(last_epoch_ + 1);
  optimizer_.set_lr(lr);  // throws before the epoch advances: a refused rate changes nothing
  ++last_epoch_;
}

void LRScheduler::load_state(const State& state) {
  if (state.last_epoch < 0) {
    throw std::invalid_argument("LRScheduler::load_state: last_epoch must be >= 0, got " +
                                std::to_string(state.last_epoch));
  }
  if (!finite_non_negative(state.base_lr)) {
    throw std::invalid_argument(
        "LRScheduler::load_state: base_lr must be a finite number >= 0, got " +
        number(state.base_lr));
  }
  const State old = this->state();
  last_epoch_ = state.last_epoch;
  base_lr_ = state.base_lr;
  try {
    optimizer_.set_lr(get_lr());
  } catch (...) {
    last_epoch_ = old.last_epoch;
    base_lr_ = old.base_lr;
    throw;
  }
}

StepLR::StepLR(DistributedOptimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  if (step_size <= 0) {
    throw std::invalid_argument("StepLR: step_size must be > 0, got " + std::to_string(step_size));
  }
  if (!finite_non_negative(gamma)) {
    throw std::invalid_argument("StepLR: gamma must be a finite number >= 0, got " + number(gamma));
  }
  start();
}

double StepLR::lr_at(int64_t epoch) const {
  return base_lr() * std::pow(gamma_, static_cast<double>(epoch / step_size_));
}

CosineAnnealingLR::CosineAnnealingLR(DistributedOptimizer& optimizer, int64_t T_max, double eta_min)
    : LRScheduler(optimizer), t_max_(T_max), eta_min_(eta_min) {
  if (T_max <= 0) {
    throw std::invalid_argument("CosineAnnealingLR: T_max must be > 0, got " +
                                std::to_string(T_max));
  }
  if (!finite_non_negative(eta_min)) {
    throw std::invalid_argument("CosineAnnealingLR: eta_min must be a finite number >= 0, got " +
                                number(eta_min));
  }
  start();
}

double CosineAnnealingLR::lr_at(int64_t epoch) const {
  return eta_min_ +
         (base_lr() - eta_min_) *
             (1 + std::cos(M_PI * static_cast<double>(epoch) / static_cast<double>(t_max_))) / 2;
}

LambdaLR::LambdaLR(DistributedOptimizer& optimizer, std::function<double(int64_t)> factor)
    : LRScheduler(optimizer), factor_(std::move(factor)) {
  if (!factor_) throw std::invalid_argument("LambdaLR: no factor function");
  start();
}

double LambdaLR::lr_at(int64_t epoch) const { return base_lr() * factor_(epoch); }

}  // namespace tandem::optim
