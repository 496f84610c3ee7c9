#include "tandem/optim/owner/protocol.h"

#include <stdexcept>
#include <string>

namespace tandem::optim::owner {

std::vector<double> pack(const Options& o) {
  return {o.lr,       o.weight_decay, o.momentum, o.dampening, o.nesterov ? 1.0 : 0.0,
          o.beta1,    o.beta2,        o.eps,      o.amsgrad ? 1.0 : 0.0, o.lr_decay,
          o.initial_accumulator_value, o.alpha, o.centered ? 1.0 : 0.0};
}

Options unpack(const std::vector<double>& v) {
  if (v.size() != 13) {
    throw std::invalid_argument("optimizer options: expected 13 numbers, got " +
                                std::to_string(v.size()));
  }
  Options o;
  o.lr = v[0];
  o.weight_decay = v[1];
  o.momentum = v[2];
  o.dampening = v[3];
  o.nesterov = v[4] != 0;
  o.beta1 = v[5];
  o.beta2 = v[6];
  o.eps = v[7];
  o.amsgrad = v[8] != 0;
  o.lr_decay = v[9];
  o.initial_accumulator_value = v[10];
  o.alpha = v[11];
  o.centered = v[12] != 0;
  return o;
}

Kind kind_of(int64_t k) {
  auto kind = kind_from_number(k);
  if (!kind) throw std::invalid_argument("unknown optimizer kind " + std::to_string(k));
  return *kind;
}

}  // namespace tandem::optim::owner
