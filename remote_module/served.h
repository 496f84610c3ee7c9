// What a RemoteModule's owner holds: a module, type-erased so that modules
// built by a factory (torch::nn) and modules loaded from TorchScript
// (torch::jit) are served alike. It lives inside the RRef the RemoteModule
// holds (a c10 capsule: it never crosses the wire) and goes when the last
// reference to it does.
//
// Registering a module of one's own is one line, on every worker that may
// own one (typically the same binary):
//
//   tandem::nn::register_module("mlp", [](int64_t d) { return std::make_shared<MlpImpl>(d); });
//
// The factory's arguments are converted like an RPC handler's (rpc/convert.h);
// the module's forward is its `forward` method, whose trailing arguments may
// be left out when their C++ type has an empty value (an undefined tensor, an
// empty optional), as LibTorch's own modules declare their defaults. A module
// whose forward is overloaded or a template names it explicitly:
//
//   tandem::nn::register_module("seq", make_seq,
//       [](torch::nn::SequentialImpl& m, at::Tensor x) { return m.forward(x); });
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/rpc/convert.h"
#include "tandem/rpc/registry.h"

namespace tandem::nn {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct Served {
  std::string what;  // "Linear", "TorchScript file model.pt": for error messages
  c10::Device device = c10::kCPU;
  std::shared_ptr<torch::nn::Module> module;  // null for TorchScript
  std::function<c10::IValue(std::vector<c10::IValue>&)> forward;
  std::function<NamedTensors()> parameters;
  std::function<NamedTensors()> buffers;
  std::function<void(bool)> train;
  std::function<bool()> is_training;
  std::function<void(c10::Device)> to;
};

// factory(args) builds a module on CPU; the owner moves it to its device.
using Factory = std::function<std::shared_ptr<Served>(std::vector<c10::IValue>& args)>;

// Makes `name` buildable by RemoteModule on this process. Throws
// std::invalid_argument if the name is taken (the built-ins included).
void register_factory(const std::string& name, Factory factory);
bool has_factory(const std::string& name);
// Builds the module `name` makes from `args`: std::invalid_argument naming an
// unknown name (and the known ones) or the factory's complaint.
std::shared_ptr<Served> make_module(const std::string& name, std::vector<c10::IValue>& args);
std::vector<std::string> factory_names();

// Serves a torch::nn module with `forward` as its forward.
template <class M>
std::shared_ptr<Served> serve_module(
    std::shared_ptr<M> module, std::string what,
    std::function<c10::IValue(std::vector<c10::IValue>&)> forward) {
  auto s = std::make_shared<Served>();
  s->what = std::move(what);
  std::shared_ptr<torch::nn::Module> base = module;
  s->module = base;
  s->forward = std::move(forward);
  s->parameters = [base] {
    NamedTensors out;
    for (const auto& item : base->named_parameters(true))
      out.emplace_back(item.key(), item.value());
    return out;
  };
  s->buffers = [base] {
    NamedTensors out;
    for (const auto& item : base->named_buffers(true)) out.emplace_back(item.key(), item.value());
    return out;
  };
  s->train = [base](bool on) { base->train(on); };
  s->is_training = [base] { return base->is_training(); };
  s->to = [base](c10::Device d) { base->to(d); };
  return s;
}

namespace detail {

template <class T>
struct module_of;
template <class T>
struct module_of<std::shared_ptr<T>> {
  using type = T;
  static std::shared_ptr<T> shared(std::shared_ptr<T> p) { return p; }
};
template <class T>
struct module_of<torch::nn::ModuleHolder<T>> {
  using type = T;
  static std::shared_ptr<T> shared(torch::nn::ModuleHolder<T> h) { return h.ptr(); }
};
// LibTorch's named holders (torch::nn::Linear) derive from ModuleHolder.
template <class H>
struct holder_of {
  using type = torch::nn::ModuleHolder<typename H::ContainedType>;
};
template <class T>
struct holder_of<std::shared_ptr<T>> {
  using type = std::shared_ptr<T>;
};

template <class T>
struct tail;
template <class H, class... Ts>
struct tail<std::tuple<H, Ts...>> {
  using type = std::tuple<Ts...>;
};

// The value of argument I for fn: converted, or, when the caller left it
// out, its type's empty value if it has one (LibTorch's modules default
// their trailing tensors and optionals so).
template <class Args, size_t I>
std::tuple_element_t<I, Args> arg_at(std::vector<c10::IValue>& args, const std::string& what) {
  using T = std::tuple_element_t<I, Args>;
  if (I < args.size()) {
    return rpc::from_ivalue<T>(args[I], "argument " + std::to_string(I + 1) + " of " + what);
  }
  if constexpr (std::is_same_v<T, at::Tensor> || rpc::is_optional<T>::value) {
    return T();
  } else {
    throw std::invalid_argument(what + ": argument " + std::to_string(I + 1) + " is missing");
  }
}

template <class Args, class F, size_t... I>
c10::IValue invoke(F& fn, std::vector<c10::IValue>& args, const std::string& what,
                   std::index_sequence<I...>) {
  constexpr size_t n = sizeof...(I);
  if (args.size() > n) {
    throw std::invalid_argument(what + " takes at most " + std::to_string(n) +
                                " argument(s), got " + std::to_string(args.size()));
  }
  using R = decltype(fn(arg_at<Args, I>(args, what)...));
  if constexpr (std::is_void_v<R>) {
    fn(arg_at<Args, I>(args, what)...);
    return c10::IValue();
  } else {
    return rpc::to_ivalue(fn(arg_at<Args, I>(args, what)...));
  }
}

// The forward of module `m`: a member function pointer (&M::forward) or a
// callable taking (M&, args...).
template <class M, class F>
std::function<c10::IValue(std::vector<c10::IValue>&)> bind_forward(std::shared_ptr<M> m, F f,
                                                                   std::string what) {
  if constexpr (std::is_member_function_pointer_v<F>) {
    using Args = typename rpc::fn_traits<F>::args;
    return [m, f, what](std::vector<c10::IValue>& a) {
      auto call = [&](auto&&... xs) { return ((*m).*f)(std::forward<decltype(xs)>(xs)...); };
      return invoke<Args>(call, a, what, std::make_index_sequence<std::tuple_size_v<Args>>());
    };
  } else {
    using Args = typename tail<typename rpc::fn_traits<F>::args>::type;
    return [m, f, what](std::vector<c10::IValue>& a) mutable {
      auto call = [&](auto&&... xs) { return f(*m, std::forward<decltype(xs)>(xs)...); };
      return invoke<Args>(call, a, what, std::make_index_sequence<std::tuple_size_v<Args>>());
    };
  }
}

}  // namespace detail

// make(args...) returns std::shared_ptr<M> or a module holder (torch::nn::Linear);
// forward is &M::forward or a callable (M&, args...) -> result.
template <class Make, class Forward>
void register_module(const std::string& name, Make make, Forward forward) {
  register_factory(name, [name, make, forward](std::vector<c10::IValue>& args) mutable {
    using Args = typename rpc::fn_traits<Make>::args;
    constexpr size_t n = std::tuple_size_v<Args>;
    if (args.size() != n) {
      throw std::invalid_argument("module '" + name + "' takes " + std::to_string(n) +
                                  " argument(s), got " + std::to_string(args.size()));
    }
    using Holder = typename detail::holder_of<typename rpc::fn_traits<Make>::result>::type;
    using M = typename detail::module_of<Holder>::type;
    std::shared_ptr<M> module;
    auto build = [&](auto&&... xs) {
      module = detail::module_of<Holder>::shared(make(std::forward<decltype(xs)>(xs)...));
    };
    detail::invoke<Args>(build, args, "module '" + name + "'", std::make_index_sequence<n>());
    return serve_module(module, name,
                        detail::bind_forward(module, forward, "forward of '" + name + "'"));
  });
}

template <class Make>
void register_module(const std::string& name, Make make) {
  using Holder = typename detail::holder_of<typename rpc::fn_traits<Make>::result>::type;
  using M = typename detail::module_of<Holder>::type;
  register_module(name, std::move(make), &M::forward);
}

// The module a RemoteModule's RRef holds, on its owner (a function the
// user registers may take get_module_rref()'s value): null when it is not
// a torch::nn module of type M.
std::shared_ptr<Served> served_of(const c10::IValue& value);
template <class M = torch::nn::Module>
std::shared_ptr<M> local_module(const c10::IValue& value) {
  auto s = served_of(value);
  return s ? std::dynamic_pointer_cast<M>(s->module) : nullptr;
}

}  // namespace tandem::nn
