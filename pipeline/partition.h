#pragma once
// Stages from one sequential model: a list of layer specs (nn::spec) cut
// into consecutive runs, each run a Sequential RemoteModule on its device.
//
//   std::vector<c10::IValue> layers = {nn::spec("Linear", {512, 2048}), nn::spec("ReLU"), ...};
//   auto counts = pipeline::balance_by_parameters(layers, 2);   // {2, 3}, say
//   auto timed = pipeline::balance_by_time(layers, 2, one_micro_batch);
//   auto stages = pipeline::partition(layers, {"worker1/cpu", "worker2/cpu"}, counts);
//   pipeline::Pipe pipe(stages, options);
#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

#include "tandem/remote_module/remote_module.h"

namespace tandem::pipeline {

// counts[i] consecutive layers make stage i, a Sequential on devices[i]
// (one RemoteModule each, built there). Throws std::invalid_argument when
// the counts do not add up to the layers, one is below 1, or there are not
// as many devices as counts; a layer its owner cannot build fails as
// RemoteModule's construction does.
std::vector<nn::RemoteModule> partition(const std::vector<c10::IValue>& layers,
                                        const std::vector<std::string>& devices,
                                        const std::vector<int>& counts);
std::vector<nn::RemoteModule> partition(rpc::Agent& agent, const std::vector<c10::IValue>& layers,
                                        const std::vector<std::string>& devices,
                                        const std::vector<int>& counts);

// Layers per stage for `stages` consecutive runs whose largest parameter
// count is as small as it can be (each layer is built here once, with this
// process's factories, to count its parameters). Every stage gets a layer.
std::vector<int> balance_by_parameters(const std::vector<c10::IValue>& layers, int stages);

// The same for any per-layer cost.
std::vector<int> balance(const std::vector<double>& costs, int stages);

// Each layer's forward plus backward time in microseconds, measured here:
// the layers are built in this process (its factories) on `device`, and
// `sample` (typically one micro-batch) goes through them in order, each
// layer's forward and its backward (its parameters' gradients and, but for
// the first layer's, its input's, for an output gradient of ones) timed
// apart. The median of
// `repeats` runs after one warm-up. Throws std::invalid_argument naming the
// layer that is not a spec, whose forward fails, or whose output is not a
// tensor; a layer whose output is not floating point counts its forward only.
std::vector<double> layer_times(const std::vector<c10::IValue>& layers, const at::Tensor& sample,
                                int repeats = 5, c10::Device device = c10::kCPU);

// balance() of layer_times(): stages of even measured time.
std::vector<int> balance_by_time(const std::vector<c10::IValue>& layers, int stages,
                                 const at::Tensor& sample, int repeats = 5,
                                 c10::Device device = c10::kCPU);

}  // namespace tandem::pipeline
