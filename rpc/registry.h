// Registry: the functions an agent will run for its peers, by name.
//
// Nothing that arrives on the wire is executed as code: a request names a
// function, and only a function registered here under that name can run. Every
// worker of a job registers the same names (typically the same binary).
//
//   auto reg = std::make_shared<Registry>();
//   reg->def("add", [](at::Tensor a, double b) { return a + b; });          // typed
//   reg->def_ivalue("echo", [](std::vector<c10::IValue>& args) { ... });    // untyped
//
// A typed function's arguments are converted with from_ivalue (a mismatch is
// reported to the caller as a RemoteError naming the argument); its result
// with to_ivalue. A function that returns a Future<T> runs asynchronously: the
// pool thread is released and the reply is sent when the future completes.
#pragma once

#include <functional>
#include <memory>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "tandem/rpc/convert.h"
#include "tandem/rpc/future.h"

namespace tandem::rpc {

struct HandlerResult {
  c10::IValue value;
  RawFuture future;  // set instead of value when the function runs asynchronously
};
using Handler = std::function<HandlerResult(std::vector<c10::IValue>& args)>;

template <class F>
struct fn_traits : fn_traits<decltype(&std::decay_t<F>::operator())> {};
template <class R, class... A>
struct fn_traits<R (*)(A...)> {
  using result = R;
  using args = std::tuple<std::decay_t<A>...>;
};
template <class R, class... A>
struct fn_traits<R(A...)> : fn_traits<R (*)(A...)> {};
template <class C, class R, class... A>
struct fn_traits<R (C::*)(A...) const> : fn_traits<R (*)(A...)> {};
template <class C, class R, class... A>
struct fn_traits<R (C::*)(A...)> : fn_traits<R (*)(A...)> {};

namespace detail {
template <class Args, class F, size_t... I>
decltype(auto) invoke_typed(F& fn, std::vector<c10::IValue>& args, const std::string& name,
                            std::index_sequence<I...>) {
  return fn(from_ivalue<std::tuple_element_t<I, Args>>(
      args[I], "argument " + std::to_string(I + 1) + " of '" + name + "'")...);
}
}  // namespace detail

class Registry {
 public:
  template <class F>
  Registry& def(const std::string& name, F fn) {
    using Traits = fn_traits<F>;
    using Args = typename Traits::args;
    using R = typename Traits::result;
    add(name, [name, fn = std::move(fn)](std::vector<c10::IValue>& args) mutable -> HandlerResult {
      constexpr size_t n = std::tuple_size_v<Args>;
      if (args.size() != n) {
        throw std::invalid_argument("'" + name + "' takes " + std::to_string(n) +
                                    " argument(s), got " + std::to_string(args.size()));
      }
      if constexpr (std::is_void_v<R>) {
        detail::invoke_typed<Args>(fn, args, name, std::make_index_sequence<n>());
        return {};
      } else if constexpr (is_future<R>::value) {
        return {c10::IValue(),
                detail::invoke_typed<Args>(fn, args, name, std::make_index_sequence<n>()).raw()};
      } else {
        return {
            to_ivalue(detail::invoke_typed<Args>(fn, args, name, std::make_index_sequence<n>())),
            RawFuture()};
      }
    });
    return *this;
  }

  // The untyped form: the function sees the arguments as IValues and returns
  // one. Returning an IValue that holds a c10 future makes it asynchronous.
  Registry& def_ivalue(const std::string& name,
                       std::function<c10::IValue(std::vector<c10::IValue>&)> fn);

  std::shared_ptr<const Handler> find(const std::string& name) const;
  bool contains(const std::string& name) const { return find(name) != nullptr; }

 private:
  void add(const std::string& name, Handler handler);

  mutable std::shared_mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const Handler>> functions_;
};

}  // namespace tandem::rpc
