// RemoteModule's two sides: the owner's handlers ("tandem.nn.*", run on the
// module its RRef holds) and the caller's handle.
#include "tandem/remote_module/remote_module.h"

#include <ATen/core/grad_mode.h>
#include <torch/cuda.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "tandem/remote_module/torchscript.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/layer.h"

namespace tandem::nn {
namespace {

struct Factories {
  std::mutex mu;
  std::unordered_map<std::string, Factory> by_name;
};
Factories& factories() {
  static Factories* f = new Factories();  // never destroyed: used by static registrations
  return *f;
}

Factory find_factory(const std::string& name) {
  std::lock_guard<std::mutex> lock(factories().mu);
  auto it = factories().by_name.find(name);
  return it == factories().by_name.end() ? Factory() : it->second;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// `v` with each tensor inside it (nested in tuples and lists) replaced by `f(tensor)`.
c10::IValue mapped(const c10::IValue& v, const std::function<at::Tensor(const at::Tensor&)>& f) {
  if (v.isTensor()) return f(v.toTensor());
  if (v.isTuple()) {
    std::vector<c10::IValue> items;
    for (const auto& item : v.toTupleRef().elements()) items.push_back(mapped(item, f));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (v.isTensorList()) {
    std::vector<at::Tensor> items;
    for (const at::Tensor& t : v.toTensorVector()) items.push_back(f(t));
    return c10::IValue(std::move(items));
  }
  if (v.isList()) {
    auto list = v.toList();
    c10::impl::GenericList out(list.elementType());
    for (size_t i = 0; i < list.size(); ++i) out.push_back(mapped(list.get(i), f));
    return out;
  }
  return v;
}

// Tensors inside `v` moved to `device`.
c10::IValue moved(const c10::IValue& v, c10::Device device) {
  return mapped(v, [device](const at::Tensor& t) { return t.to(device); });
}

// A forward's answer to the worker whose request this handler serves: a
// CUDA tensor stays on its GPU where that worker's device map takes it (it
// lands on the mapped device there); any other goes by way of the CPU
// rather than be refused.
c10::IValue answered(const c10::IValue& v) {
  rpc::Agent* agent = rpc::handler_agent();
  const std::string caller = rpc::handler_caller();
  return mapped(v, [&](const at::Tensor& t) {
    if (t.is_cpu()) return t;
    if (t.is_cuda() && agent && !caller.empty() && agent->answer_device_to(caller, t.device())) {
      return t;
    }
    return t.to(c10::kCPU);
  });
}

// The device `d` on this worker, or an error naming what it lacks.
void check_device(const std::string& worker, c10::Device d) {
  if (d.is_cpu()) return;
  if (!d.is_cuda()) {
    throw std::invalid_argument("device " + d.str() + " is not supported (cpu or cuda:<n>)");
  }
  const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
  if (count == 0) {
    throw std::invalid_argument(worker + " has no device " + d.str() +
                                ": CUDA is not available there");
  }
  if (d.has_index() && d.index() >= count) {
    throw std::invalid_argument(worker + " has no device " + d.str() + ": it has " +
                                std::to_string(count) + " CUDA device(s)");
  }
}

std::shared_ptr<Served> placed(std::shared_ptr<Served> s, const std::string& worker,
                               const std::string& device) {
  c10::Device d = RemoteDevice::parse(worker + "/" + device).device;
  check_device(worker, d);
  if (d.is_cuda() && !d.has_index()) d = c10::Device(c10::kCUDA, 0);  // "cuda": the first
  if (!d.is_cpu()) s->to(d);
  s->device = d;
  return s;
}

// What the owner's RRef holds: a capsule (a value no codec will send) around
// the served module.
struct Held final : torch::CustomClassHolder {
  explicit Held(std::shared_ptr<Served> s) : served(std::move(s)) {}
  std::shared_ptr<Served> served;
};

c10::IValue held(std::shared_ptr<Served> s) {
  return c10::IValue::make_capsule(c10::make_intrusive<Held>(std::move(s)));
}

std::shared_ptr<Served> served_or_throw(const c10::IValue& v) {
  auto s = served_of(v);
  if (!s)
    throw std::invalid_argument("not a RemoteModule's module: a value of type " + v.tagKind());
  return s;
}

NamedTensors state_of(const Served& s) {
  NamedTensors all = s.parameters();
  for (auto& b : s.buffers()) all.push_back(std::move(b));
  return all;
}

// The owner's handlers.
class ModuleService final : public rpc::AgentExtension {
 public:
  explicit ModuleService(rpc::Agent& agent) : agent_(agent) {}

  void register_handlers(rpc::Registry& internal) override {
    rpc::Agent* agent = &agent_;
    internal.def("tandem.nn.create",
                 [agent](std::string name, c10::IValue args, std::string device) {
                   if (!args.isList())
                     throw std::invalid_argument("module arguments must be a list");
                   auto list = args.toList();
                   std::vector<c10::IValue> items(list.begin(), list.end());
                   std::shared_ptr<Served> s;
                   try {
                     s = make_module(name, items);
                   } catch (const std::exception& e) {
                     throw std::invalid_argument("building module '" + name + "' on " +
                                                 agent->name() + ": " + e.what());
                   }
                   return held(placed(std::move(s), agent->name(), device));
                 });
    internal.def("tandem.nn.load_script", [agent](std::string path, std::string device) {
      return held(placed(load_torchscript(path, agent->name()), agent->name(), device));
    });
    internal.def_ivalue("tandem.nn.forward", [](std::vector<c10::IValue>& args) {
      auto s = served_or_throw(args.at(0));
      std::vector<c10::IValue> rest;
      rest.reserve(args.size() - 1);
      for (size_t i = 1; i < args.size(); ++i) {
        rest.push_back(s->device.is_cpu() ? std::move(args[i]) : moved(args[i], s->device));
      }
      c10::IValue out = s->forward(rest);
      return s->device.is_cpu() ? out : answered(out);
    });
    internal.def("tandem.nn.parameters", [agent](c10::IValue m) {
      std::vector<rpc::RRef<at::Tensor>> out;
      for (auto& [name, p] : served_or_throw(m)->parameters()) {
        out.push_back(rpc::RRef<at::Tensor>::make_local(*agent, p));
      }
      return out;
    });
    internal.def("tandem.nn.train", [](c10::IValue m, bool on) { served_or_throw(m)->train(on); });
    internal.def("tandem.nn.is_training",
                 [](c10::IValue m) { return served_or_throw(m)->is_training(); });
    internal.def("tandem.nn.state_dict", [](c10::IValue m) {
      std::map<std::string, at::Tensor> out;
      for (auto& [name, t] : state_of(*served_or_throw(m))) {
        out[name] = t.detach().to(c10::kCPU, /*non_blocking=*/false, /*copy=*/true);
      }
      return out;
    });
    internal.def(
        "tandem.nn.load_state_dict",
        [agent](c10::IValue m, std::map<std::string, at::Tensor> state, bool strict) {
          auto s = served_or_throw(m);
          NamedTensors mine = state_of(*s);
          std::vector<std::string> missing, unexpected;
          std::map<std::string, at::Tensor*> targets;
          for (auto& [name, t] : mine) {
            targets[name] = &t;
            if (!state.count(name)) missing.push_back(name);
          }
          for (const auto& [name, _] : state) {
            if (!targets.count(name)) unexpected.push_back(name);
          }
          if (strict && (!missing.empty() || !unexpected.empty())) {
            std::string msg = "load_state_dict on " + agent->name() + " (" + s->what + "):";
            if (!missing.empty()) msg += " missing keys: " + joined(missing) + ";";
            if (!unexpected.empty()) msg += " unexpected keys: " + joined(unexpected) + ";";
            msg.pop_back();
            throw std::invalid_argument(msg);
          }
          // Every shape is checked before anything is copied: a refused load
          // leaves the module as it was.
          for (auto& [name, target] : targets) {
            auto it = state.find(name);
            if (it == state.end()) continue;
            if (it->second.sizes() != target->sizes()) {
              std::ostringstream msg;
              msg << "load_state_dict on " << agent->name() << ": size mismatch for " << name
                  << ": the module has " << target->sizes() << ", the state " << it->second.sizes();
              throw std::invalid_argument(msg.str());
            }
          }
          at::NoGradGuard no_grad;
          for (auto& [name, target] : targets) {
            auto it = state.find(name);
            if (it != state.end()) target->copy_(it->second);
          }
        });
  }

  void before_send(rpc::Message&, int) override {}
  void after_encode(const rpc::Message&, rpc::OutFrame&, int) override {}
  void after_receive(rpc::Message&, int) override {}

 private:
  rpc::Agent& agent_;
};

const bool kRegistered = [] {
  rpc::register_agent_extension(
      [](rpc::Agent& agent) { return std::make_shared<ModuleService>(agent); });
  return true;
}();

rpc::Agent& checked(rpc::Agent& agent) {
  (void)kRegistered;
  rpc::layer::require_extension<ModuleService>(agent, "RemoteModule", "remote_module");
  return agent;
}

std::string owner_name(rpc::Agent& agent, const RemoteDevice& d) {
  return d.rank >= 0 ? agent.get_worker_info(d.rank).name : agent.get_worker_info(d.worker).name;
}

rpc::RRef<c10::IValue> confirmed(rpc::RRef<c10::IValue> r) {
  r.wait_confirmed();  // a failed build throws here, from the constructor
  return r;
}

}  // namespace

void register_factory(const std::string& name, Factory factory) {
  if (name.empty() || !factory)
    throw std::invalid_argument("register_factory: empty name or factory");
  std::lock_guard<std::mutex> lock(factories().mu);
  if (!factories().by_name.emplace(name, std::move(factory)).second) {
    throw std::invalid_argument("module factory '" + name + "' is already registered");
  }
}

bool has_factory(const std::string& name) { return static_cast<bool>(find_factory(name)); }

std::shared_ptr<Served> make_module(const std::string& name, std::vector<c10::IValue>& args) {
  Factory make = find_factory(name);
  if (!make) {
    throw std::invalid_argument("no module factory '" + name +
                                "' (registered: " + joined(factory_names()) + ")");
  }
  auto s = make(args);
  if (!s || !s->forward || !s->parameters || !s->buffers || !s->train || !s->is_training ||
      !s->to) {
    throw std::logic_error("module factory '" + name + "' made an incomplete module");
  }
  return s;
}

std::vector<std::string> factory_names() {
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> lock(factories().mu);
    for (const auto& [name, _] : factories().by_name) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::shared_ptr<Served> served_of(const c10::IValue& value) {
  if (!value.isCapsule()) return nullptr;
  auto capsule = value.toCapsule();
  auto* h = dynamic_cast<Held*>(capsule.get());
  return h ? h->served : nullptr;
}

RemoteDevice RemoteDevice::parse(const std::string& s) {
  auto bad = [&](const std::string& why) {
    return std::invalid_argument("bad remote device '" + s + "': " + why +
                                 " (expected <worker>/<device> or rank:<r>/<device>, such as "
                                 "worker1/cpu or rank:1/cuda:0)");
  };
  RemoteDevice d;
  const auto slash = s.find('/');
  const std::string who = s.substr(0, slash);
  const std::string dev = slash == std::string::npos ? "cpu" : s.substr(slash + 1);
  if (who.empty()) throw bad("no worker");
  if (who.rfind("rank:", 0) == 0) {
    const std::string r = who.substr(5);
    if (r.empty() || r.find_first_not_of("0123456789") != std::string::npos || r.size() > 9) {
      throw bad("rank '" + r + "' is not a number");
    }
    d.rank = std::stoi(r);
  } else {
    d.worker = who;
  }
  try {
    d.device = c10::Device(dev);
  } catch (const std::exception&) {
    throw bad("'" + dev + "' is not a device");
  }
  return d;
}

std::string RemoteDevice::str() const {
  return (rank >= 0 ? "rank:" + std::to_string(rank) : worker) + "/" + device.str();
}

c10::IValue list(std::vector<c10::IValue> items) { return rpc::list_of(std::move(items)); }

c10::IValue spec(const std::string& factory, std::vector<c10::IValue> args) {
  return c10::ivalue::Tuple::create({c10::IValue(factory), list(std::move(args))});
}

RemoteModule::RemoteModule(const std::string& remote_device, const std::string& factory,
                           std::vector<c10::IValue> args)
    : RemoteModule(*rpc::current_agent(), remote_device, factory, std::move(args)) {}

RemoteModule::RemoteModule(rpc::Agent& agent, const std::string& remote_device,
                           const std::string& factory, std::vector<c10::IValue> args) {
  const RemoteDevice d = RemoteDevice::parse(remote_device);
  module_ =
      confirmed(rpc::remote<c10::IValue>(checked(agent), owner_name(agent, d), "tandem.nn.create",
                                         factory, list(std::move(args)), d.device.str()));
}

RemoteModule::RemoteModule(rpc::RRef<c10::IValue> module_rref) : module_(std::move(module_rref)) {
  if (!module_.valid()) throw std::invalid_argument("RemoteModule: empty module RRef");
}

RemoteModule RemoteModule::from_torchscript(const std::string& remote_device,
                                            const std::string& path) {
  return from_torchscript(*rpc::current_agent(), remote_device, path);
}

RemoteModule RemoteModule::from_torchscript(rpc::Agent& agent, const std::string& remote_device,
                                            const std::string& path) {
  const RemoteDevice d = RemoteDevice::parse(remote_device);
  return RemoteModule(confirmed(rpc::remote<c10::IValue>(
      checked(agent), owner_name(agent, d), "tandem.nn.load_script", path, d.device.str())));
}

std::vector<rpc::RRef<at::Tensor>> RemoteModule::remote_parameters() const {
  return module_.rpc_sync<std::vector<rpc::RRef<at::Tensor>>>("tandem.nn.parameters");
}

void RemoteModule::train(bool on) const { module_.rpc_sync<void>("tandem.nn.train", on); }

bool RemoteModule::is_training() const { return module_.rpc_sync<bool>("tandem.nn.is_training"); }

RemoteModule::StateDict RemoteModule::state_dict() const {
  return module_.rpc_sync<StateDict>("tandem.nn.state_dict");
}

void RemoteModule::load_state_dict(const StateDict& state, bool strict) const {
  module_.rpc_sync<void>("tandem.nn.load_state_dict", state, strict);
}

}  // namespace tandem::nn
