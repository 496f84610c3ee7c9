// The messages between a DistributedOptimizer (the caller) and the owners'
// service (the workers that own its parameters).
//
// Its neighbours: optim/distributed_optimizer.cc sends them, and
// optim/owner/service.cc registers the functions and reads them. Options
// travel as a flat list of numbers (pack, unpack); the kind as its number.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/optim/options.h"

namespace tandem::optim::owner {

// Options travel as a flat list of numbers, in this order.
std::vector<double> pack(const Options& o);
Options unpack(const std::vector<double>& v);

Kind kind_of(int64_t k);

}  // namespace tandem::optim::owner
