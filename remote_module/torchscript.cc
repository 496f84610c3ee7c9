// TorchScript modules, served like any other: the jit module's own forward,
// parameters, buffers and training flag.
#include "tandem/remote_module/torchscript.h"

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>

#include <fstream>

namespace tandem::nn {
namespace {

template <class List>
NamedTensors named(const List& list) {
  NamedTensors out;
  for (const auto& item : list) out.emplace_back(item.name, item.value);
  return out;
}

// The first line of a LibTorch error (the rest is its C++ backtrace).
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

std::shared_ptr<Served> load_torchscript(const std::string& path, const std::string& worker) {
  if (!std::ifstream(path).good()) {
    throw std::invalid_argument("TorchScript file '" + path + "' cannot be read on " + worker);
  }
  torch::jit::Module module;
  try {
    module = torch::jit::load(path);
  } catch (const std::exception& e) {
    throw std::invalid_argument("TorchScript file '" + path + "' on " + worker +
                                " is not a TorchScript module: " + first_line(e.what()));
  }
  if (!module.find_method("forward")) {
    throw std::invalid_argument("TorchScript module '" + path + "' on " + worker +
                                " has no forward method");
  }
  auto s = std::make_shared<Served>();
  s->what = "TorchScript file " + path;
  auto m = std::make_shared<torch::jit::Module>(std::move(module));
  s->forward = [m, path](std::vector<c10::IValue>& args) {
    try {
      return m->forward(args);
    } catch (const c10::Error& e) {
      // The jit's argument checks name the schema; drop the backtrace.
      throw std::invalid_argument("forward of TorchScript module '" + path +
                                  "': " + std::string(e.what_without_backtrace()));
    }
  };
  s->parameters = [m] { return named(m->named_parameters(true)); };
  s->buffers = [m] { return named(m->named_buffers(true)); };
  s->train = [m](bool on) { m->train(on); };
  s->is_training = [m] { return m->is_training(); };
  s->to = [m](c10::Device d) { m->to(d); };
  return s;
}

}  // namespace tandem::nn
