// The kinds of optimizer a DistributedOptimizer can be, and their options.
//
// What it promises: one Options struct for every kind, with PyTorch's
// defaults; each owner makes the LibTorch optimizer of the kind from them
// (optim/owner/local_optimizer.h), and the caller sends them to the owners
// as a named message (optim/owner/protocol.h). A Kind's number (the value of
// its enumerator) is what checkpoints and messages carry: kind_from_number
// is the one check that such a number names a kind.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace tandem::optim {

enum class Kind { kSGD, kAdam, kAdamW, kAdagrad, kRMSprop };

// One options struct for every kind; each kind reads the fields PyTorch's
// optimizer of that name takes, with PyTorch's defaults. Where the default
// differs by kind, a negative value means "the kind's default": eps (1e-10
// for Adagrad, 1e-8 otherwise) and weight_decay (0.01 for AdamW, 0 otherwise).
struct Options {
  double lr = 0.01;
  double weight_decay = -1;
  // SGD
  double momentum = 0;
  double dampening = 0;
  bool nesterov = false;
  // Adam, AdamW
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = -1;
  bool amsgrad = false;
  // Adagrad
  double lr_decay = 0;
  double initial_accumulator_value = 0;
  // RMSprop (eps, momentum and weight_decay above)
  double alpha = 0.99;
  bool centered = false;
};

std::string kind_name(Kind kind);

// The Kind whose number is `number`, or nullopt when none is.
std::optional<Kind> kind_from_number(int64_t number);

}  // namespace tandem::optim
