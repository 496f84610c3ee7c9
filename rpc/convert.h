// Conversions between C++ values and c10::IValue for typed RPC signatures.
//
// to_ivalue(x) builds the IValue (typed lists and dicts, so a std::vector<int64_t>
// arrives as a List[int]). from_ivalue<T>(v, what) converts back and, on a
// mismatch, throws std::invalid_argument naming `what` and both types:
//   "argument 2 of 'scale': expected float, got Tensor".
// Supported: c10::IValue (passed through), at::Tensor (never None: use
// c10::optional<at::Tensor>), bool, integers, floating
// point, std::string, c10::Device, std::vector<T>, std::tuple<...>,
// std::unordered_map<K, V> / std::map<K, V>, c10::optional<T>, and nesting of these.
#pragma once

#include <ATen/core/ivalue.h>

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace tandem::rpc {

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T>
struct is_tuple : std::false_type {};
template <class... Ts>
struct is_tuple<std::tuple<Ts...>> : std::true_type {};
template <class T>
struct is_map : std::false_type {};
template <class K, class V>
struct is_map<std::unordered_map<K, V>> : std::true_type {};
template <class K, class V>
struct is_map<std::map<K, V>> : std::true_type {};
template <class T>
struct is_optional : std::false_type {};
// Specialised for RRef<T> in rpc/rref.h.
template <class T>
struct is_rref : std::false_type {};
template <class T>
struct is_optional<c10::optional<T>> : std::true_type {};

namespace detail {

[[noreturn]] inline void mismatch(const std::string& what, const char* expected,
                                  const c10::IValue& v) {
  throw std::invalid_argument(what + ": expected " + expected + ", got " + v.tagKind());
}

template <class Tuple, size_t... I>
Tuple tuple_from(const std::vector<c10::IValue>& items, const std::string& what,
                 std::index_sequence<I...>);

// std::vector<int>, std::vector<float>, ...: c10 lists hold int64_t and double only.
template <class T>
struct is_narrow_number_vector : std::false_type {};
template <class E, class A>
struct is_narrow_number_vector<std::vector<E, A>>
    : std::bool_constant<(std::is_integral_v<E> && !std::is_same_v<E, bool> &&
                          !std::is_same_v<E, int64_t>) ||
                         std::is_same_v<E, float>> {};
template <class T>
struct is_rref_vector : std::false_type {};
template <class E, class A>
struct is_rref_vector<std::vector<E, A>> : is_rref<E> {};

// The static type a container of T declares (RRefs go in as Any).
template <class T>
c10::TypePtr type_of() {
  if constexpr (is_rref<T>::value || is_rref_vector<T>::value) {
    return c10::AnyType::get();
  } else {
    return c10::getTypePtr<T>();
  }
}

}  // namespace detail

template <class T>
T from_ivalue(const c10::IValue& v, const std::string& what) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, c10::IValue>) {
    return v;
  } else if constexpr (std::is_same_v<D, at::Tensor>) {
    // None is not a tensor (a function that returns nothing, an argument
    // left out): say so rather than hand out an undefined tensor. Take
    // c10::optional<at::Tensor> where None is expected.
    if (!v.isTensor()) detail::mismatch(what, "Tensor", v);
    return v.toTensor();
  } else if constexpr (std::is_same_v<D, bool>) {
    if (!v.isBool()) detail::mismatch(what, "bool", v);
    return v.toBool();
  } else if constexpr (std::is_integral_v<D>) {
    if (!v.isInt()) detail::mismatch(what, "int", v);
    return static_cast<D>(v.toInt());
  } else if constexpr (std::is_floating_point_v<D>) {
    if (v.isDouble()) return static_cast<D>(v.toDouble());
    if (v.isInt()) return static_cast<D>(v.toInt());
    detail::mismatch(what, "float", v);
  } else if constexpr (std::is_same_v<D, std::string>) {
    if (!v.isString()) detail::mismatch(what, "str", v);
    return v.toStringRef();
  } else if constexpr (std::is_same_v<D, c10::Device>) {
    if (!v.isDevice()) detail::mismatch(what, "Device", v);
    return v.toDevice();
  } else if constexpr (is_rref<D>::value) {
    return D::from_ivalue_checked(v, what);
  } else if constexpr (is_optional<D>::value) {
    if (v.isNone()) return D();
    return D(from_ivalue<typename D::value_type>(v, what));
  } else if constexpr (is_vector<D>::value) {
    if (!v.isList()) detail::mismatch(what, "list", v);
    auto list = v.toList();
    D out;
    out.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      out.push_back(
          from_ivalue<typename D::value_type>(list.get(i), what + "[" + std::to_string(i) + "]"));
    }
    return out;
  } else if constexpr (is_tuple<D>::value) {
    if (!v.isTuple()) detail::mismatch(what, "tuple", v);
    const auto& items = v.toTupleRef().elements();
    constexpr size_t n = std::tuple_size_v<D>;
    if (items.size() != n) {
      throw std::invalid_argument(what + ": expected a tuple of " + std::to_string(n) +
                                  ", got one of " + std::to_string(items.size()));
    }
    return detail::tuple_from<D>(std::vector<c10::IValue>(items.begin(), items.end()), what,
                                 std::make_index_sequence<n>());
  } else if constexpr (is_map<D>::value) {
    if (!v.isGenericDict()) detail::mismatch(what, "dict", v);
    D out;
    for (const auto& kv : v.toGenericDict()) {
      out.emplace(from_ivalue<typename D::key_type>(kv.key(), what + " key"),
                  from_ivalue<typename D::mapped_type>(kv.value(), what + " value"));
    }
    return out;
  } else {
    static_assert(sizeof(D) == 0, "tandem::rpc: this type cannot travel over RPC");
  }
}

template <class Tuple, size_t... I>
Tuple detail::tuple_from(const std::vector<c10::IValue>& items, const std::string& what,
                         std::index_sequence<I...>) {
  return Tuple(from_ivalue<std::tuple_element_t<I, Tuple>>(
      items[I], what + "[" + std::to_string(I) + "]")...);
}

template <class T>
c10::IValue to_ivalue(T&& x) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, c10::IValue>) {
    return std::forward<T>(x);
  } else if constexpr (std::is_same_v<D, bool>) {
    return c10::IValue(x);
  } else if constexpr (std::is_integral_v<D>) {
    return c10::IValue(static_cast<int64_t>(x));
  } else if constexpr (std::is_floating_point_v<D>) {
    return c10::IValue(static_cast<double>(x));
  } else if constexpr (std::is_same_v<D, const char*> || std::is_same_v<D, char*>) {
    return c10::IValue(std::string(x));
  } else if constexpr (is_rref<D>::value) {
    return x.to_ivalue_checked();
  } else if constexpr (detail::is_rref_vector<D>::value) {
    c10::impl::GenericList list(c10::AnyType::get());
    list.reserve(x.size());
    for (const auto& item : x) list.push_back(to_ivalue(item));
    return c10::IValue(std::move(list));
  } else if constexpr (detail::is_narrow_number_vector<D>::value) {
    using E = typename D::value_type;
    using W = std::conditional_t<std::is_integral_v<E>, int64_t, double>;
    return c10::IValue(std::vector<W>(x.begin(), x.end()));
  } else if constexpr (is_tuple<D>::value) {
    // Element by element, so a tuple may hold what c10 cannot build an
    // IValue from by itself (RRefs, vectors of float).
    return std::apply(
        [](auto&&... items) {
          return c10::IValue(c10::ivalue::Tuple::create(
              std::vector<c10::IValue>{to_ivalue(std::forward<decltype(items)>(items))...}));
        },
        std::forward<T>(x));
  } else if constexpr (is_map<D>::value) {
    c10::impl::GenericDict d(detail::type_of<typename D::key_type>(),
                             detail::type_of<typename D::mapped_type>());
    d.reserve(x.size());
    for (const auto& [k, v] : x) d.insert_or_assign(to_ivalue(k), to_ivalue(v));
    return c10::IValue(std::move(d));
  } else {
    return c10::IValue(std::forward<T>(x));
  }
}

// Values of any types as one list value (List[Any]): how a call's
// arguments travel inside another call's (an RRef's method, a module's
// constructor arguments).
inline c10::IValue list_of(std::vector<c10::IValue> items) {
  c10::impl::GenericList list(c10::AnyType::get());
  list.reserve(items.size());
  for (auto& item : items) list.push_back(std::move(item));
  return c10::IValue(std::move(list));
}

// The argument list of a call: each value through to_ivalue.
template <class... A>
std::vector<c10::IValue> to_ivalues(A&&... args) {
  std::vector<c10::IValue> v;
  v.reserve(sizeof...(A));
  (v.push_back(to_ivalue(std::forward<A>(args))), ...);
  return v;
}

}  // namespace tandem::rpc
