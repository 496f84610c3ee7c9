#include "tandem/rpc/registry.h"

#include <mutex>

namespace tandem::rpc {

Registry& Registry::def_ivalue(const std::string& name,
                               std::function<c10::IValue(std::vector<c10::IValue>&)> fn) {
  if (!fn) throw std::invalid_argument("def_ivalue('" + name + "'): empty function");
  add(name, [fn = std::move(fn)](std::vector<c10::IValue>& args) -> HandlerResult {
    c10::IValue out = fn(args);
    if (out.isFuture()) return {c10::IValue(), out.toFuture()};
    return {std::move(out), RawFuture()};
  });
  return *this;
}

std::shared_ptr<const Handler> Registry::find(const std::string& name) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = functions_.find(name);
  return it == functions_.end() ? nullptr : it->second;
}

void Registry::add(const std::string& name, Handler handler) {
  if (name.empty()) throw std::invalid_argument("a registered function needs a name");
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto [it, inserted] =
      functions_.emplace(name, std::make_shared<const Handler>(std::move(handler)));
  if (!inserted) throw std::invalid_argument("function '" + name + "' is already registered");
}

}  // namespace tandem::rpc
