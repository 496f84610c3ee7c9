// The untyped core of a remote reference: identity, and the handle object
// that travels inside c10::IValue (it implements c10::RRefInterface).
//
// Identity: every RRef has an id (the worker that created it, a counter) and
// every user handle of it a fork id of the same shape. A fork is one user's
// claim on the owner's value; the owner keeps the value while any fork, or
// any handle on the owner itself, is alive. See rpc/rref_context.h for the
// protocol that keeps those counts right.
#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/core/rref_interface.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/rpc/future.h"

namespace tandem::rpc {

struct GloballyUniqueId {
  int32_t worker = -1;
  uint64_t local = 0;
  bool operator==(const GloballyUniqueId& o) const {
    return worker == o.worker && local == o.local;
  }
  std::string str() const { return std::to_string(worker) + ":" + std::to_string(local); }
};

struct GloballyUniqueIdHash {
  size_t operator()(const GloballyUniqueId& g) const {
    return std::hash<uint64_t>()(g.local * 1000003u ^ static_cast<uint64_t>(g.worker));
  }
};

using RRefId = GloballyUniqueId;
using ForkId = GloballyUniqueId;

// What travels on the wire for one RRef: whose value, which fork this copy
// is, and who sent it (the parent that must hear when the fork is safe).
struct RRefDesc {
  int32_t owner = -1;
  RRefId id;
  ForkId fork;
  int32_t parent = -1;
};

class RRefContext;

class RRefImpl final : public c10::RRefInterface {
 public:
  enum class Kind {
    kFork,   // a user's fork: counted at the owner by its fork id
    kLocal,  // a handle on the owner itself: counted as a local handle
  };

  // Handles are made whole, by an RRefContext (RRefContext::new_handle),
  // which counts them; one made with no context (a codec test) counts nothing.
  RRefImpl(const RRefDesc& desc, Kind kind, std::string owner_name, RawFuture confirmed,
           std::weak_ptr<RRefContext> ctx, bool is_owner)
      : desc_(desc),
        kind_(kind),
        is_owner_(is_owner),
        owner_name_(std::move(owner_name)),
        ctx_(std::move(ctx)),
        confirmed_(std::move(confirmed)) {}
  ~RRefImpl() override;

  c10::worker_id_t owner() const override { return static_cast<c10::worker_id_t>(desc_.owner); }
  std::string ownerName() const override { return owner_name_; }
  bool isOwner() const override { return is_owner_; }
  bool confirmedByOwner() const override;
  const c10::TypePtr type() const override { return c10::AnyType::get(); }

  const RRefDesc& desc() const { return desc_; }
  Kind kind() const { return kind_; }
  // Completes when the owner knows this fork; carries the error if the
  // value's creation failed. Complete from the start for kLocal.
  const RawFuture& confirmed() const { return confirmed_; }
  // The context of the agent this handle belongs to; throws ShutdownError
  // when that agent is gone.
  std::shared_ptr<RRefContext> context() const;
  std::string str() const;

 private:
  const RRefDesc desc_;
  const Kind kind_;
  const bool is_owner_;
  const std::string owner_name_;
  const std::weak_ptr<RRefContext> ctx_;
  const RawFuture confirmed_;
};

using RRefPtr = c10::intrusive_ptr<RRefImpl>;

// The agent's side of RRefs as the codec sees them: called for each RRef in
// a message being encoded for worker `dest`, returns what to put on the wire.
class RRefHook {
 public:
  virtual ~RRefHook() = default;
  virtual RRefDesc fork_for_send(const RRefPtr& rref, int dest) = 0;
  // The message holding these forks was certainly not sent: undo them.
  virtual void abort_forks(const std::vector<RRefDesc>& forks) = 0;
};

}  // namespace tandem::rpc
