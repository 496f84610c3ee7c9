#include "tandem/rpc/scope.h"

namespace tandem::rpc {
namespace {
thread_local CallScope tls_scope;
}  // namespace

const CallScope& current_scope() { return tls_scope; }

ScopeGuard::ScopeGuard(const CallScope& scope) : saved_(tls_scope) { tls_scope = scope; }

ScopeGuard::~ScopeGuard() { tls_scope = saved_; }

}  // namespace tandem::rpc
