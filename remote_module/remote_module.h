// RemoteModule: a module that lives on another worker, as
// torch.distributed.nn.RemoteModule does for Python.
//
//   nn::RemoteModule fc("worker1/cpu", "Linear", {1024, 10});   // built on worker1
//   autograd::Context ctx;
//   at::Tensor y = fc.forward(x);                  // runs there, differentiable
//   auto params = fc.remote_parameters();          // RRefs for DistributedOptimizer
//
//   auto lstm = nn::RemoteModule("rank:1/cpu", "LSTM", {32, 64});
//   auto [out, hc] = lstm.forward<std::tuple<at::Tensor, std::tuple<at::Tensor, at::Tensor>>>(x);
//
//   nn::RemoteModule mlp("worker1/cpu", "Sequential",
//       {nn::list({nn::spec("Linear", {8, 16}), nn::spec("ReLU"), nn::spec("Linear", {16, 2})})});
//
//   auto scripted = nn::RemoteModule::from_torchscript("worker1/cpu", "model.pt");
//
// The module is built on its owner by a registered factory (served.h; the
// built-ins are Linear, Embedding, EmbeddingBag, LSTM, GRU, Conv2d,
// LayerNorm, Dropout, ReLU, Tanh and Sequential of these) or loaded there
// from a TorchScript file, and stays there: the RemoteModule holds an RRef to
// it, and the owner frees it when the last reference goes. forward() sends
// the arguments, runs the module's forward on the owner and returns the
// result; inside an autograd context it is recorded like any RPC, so
// backward reaches the module's parameters on the owner.
//
// remote_device is "<worker>/<device>" or "rank:<r>/<device>" ("worker1/cpu",
// "rank:1/cuda:0"); "<worker>" alone means its CPU. On a CUDA device the
// owner moves tensor arguments there and results back to the CPU.
//
// Errors (an unknown factory, wrong arguments, a TorchScript file missing or
// corrupt, a device the owner does not have) reach the caller from the
// constructor, naming what was wrong; the owner keeps serving.
#pragma once

#include <ATen/core/ivalue.h>

#include <map>
#include <string>
#include <vector>

#include "tandem/remote_module/served.h"
#include "tandem/rpc/rref.h"

namespace tandem::nn {

struct RemoteDevice {
  std::string worker;  // empty when given by rank
  int rank = -1;       // -1 when given by name
  c10::Device device = c10::kCPU;
  // Throws std::invalid_argument naming the string and the form expected.
  static RemoteDevice parse(const std::string& s);
  std::string str() const;
};

// Sequential's argument: a list of modules, each a factory and its arguments.
//   RemoteModule("worker1/cpu", "Sequential",
//                {nn::list({nn::spec("Linear", {4, 8}), nn::spec("ReLU")})});
c10::IValue spec(const std::string& factory, std::vector<c10::IValue> args = {});
// A list of values as one argument (of any types).
c10::IValue list(std::vector<c10::IValue> items);

class RemoteModule {
 public:
  using StateDict = std::map<std::string, at::Tensor>;

  RemoteModule(const std::string& remote_device, const std::string& factory,
               std::vector<c10::IValue> args = {});
  RemoteModule(rpc::Agent& agent, const std::string& remote_device, const std::string& factory,
               std::vector<c10::IValue> args = {});
  // Serves an existing module reference (another RemoteModule's
  // get_module_rref(), say one received over RPC).
  explicit RemoteModule(rpc::RRef<c10::IValue> module_rref);

  // The owner loads `path` (on the owner's file system) with torch::jit::load
  // and serves the module's forward.
  static RemoteModule from_torchscript(const std::string& remote_device, const std::string& path);
  static RemoteModule from_torchscript(rpc::Agent& agent, const std::string& remote_device,
                                       const std::string& path);

  template <class R = at::Tensor, class... A>
  R forward(A&&... args) const {
    return module_.rpc_sync<R>("tandem.nn.forward", std::forward<A>(args)...);
  }
  template <class R = at::Tensor, class... A>
  rpc::Future<R> forward_async(A&&... args) const {
    return module_.rpc_async<R>("tandem.nn.forward", std::forward<A>(args)...);
  }

  // One RRef per parameter, on the owner (for DistributedOptimizer), in the
  // module's order.
  std::vector<rpc::RRef<at::Tensor>> remote_parameters() const;
  const rpc::RRef<c10::IValue>& get_module_rref() const { return module_; }
  void train(bool on = true) const;
  void eval() const { train(false); }
  bool is_training() const;
  // Copies of the parameters and buffers, by name ("0.weight" in a Sequential).
  StateDict state_dict() const;
  // strict: the names must match exactly (else std::invalid_argument-like
  // rpc::RemoteError naming the missing and unexpected ones); shapes always.
  void load_state_dict(const StateDict& state, bool strict = true) const;

  rpc::WorkerInfo owner() const { return module_.owner(); }

 private:
  rpc::RRef<c10::IValue> module_;
};

}  // namespace tandem::nn
