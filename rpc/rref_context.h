// RRefContext: one agent's remote references, as owner and as user.
//
// Protocol (all control messages are internal RPCs named "tandem.rref.*",
// idempotent, and retried on timeouts). The implementation is in three
// parts: the owner's side (rref/owner.cc), the user's side (rref/user.cc),
// and the control messages and handlers that join them (rref/control.cc):
//  1. remote(): the creator picks the RRef id (its fork id is the same id),
//     returns the handle at once, and sends `create` to the owner, which runs
//     the registered function and keeps the result (or its error). The reply
//     confirms the creator's fork; a failed creation is remembered in the
//     handle and raised at its first use.
//  2. Sending an RRef to worker X forks it. When the sender owns the value,
//     it records the new fork itself. When the sender is a user, it keeps its
//     own handle alive in pending_children_ until the owner confirms the child:
//     X asks the owner to add the fork (`fork`), then tells the sender
//     (`child_accept`), which only then lets go. So a parent never drops its
//     reference before the child's is known, and the value cannot vanish in
//     between. An RRef that reaches its owner becomes a local handle.
//  3. When the last handle of a fork dies, once the fork is confirmed, the
//     user sends `delete` (batched per owner, after a short delay, so a loop
//     of remote() calls does not cost a second message each); the owner
//     forgets the fork, and frees the value when no fork and no local handle
//     is left.
//  4. Value operations go to the owner: `fetch` (to_here) and `call` (method
//     proxies: a registered function runs with the value as first argument);
//     both wait there for a value still being created.
// Graceful shutdown waits for outstanding control messages and reports user
// handles still alive.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tandem/rpc/agent.h"
#include "tandem/rpc/rref_core.h"
#include "tandem/rpc/thread_pool.h"

namespace tandem::rpc {

class Agent;
class Registry;
struct Tombstones;  // rref/detail.h

class RRefContext final : public RRefHook, public std::enable_shared_from_this<RRefContext> {
 public:
  explicit RRefContext(Agent& agent);
  ~RRefContext() override;

  // Registers the "tandem.rref.*" handlers in the agent's internal registry.
  void register_handlers(Registry& internal);

  // Creates the value on `owner` with the registered function `fn`. With
  // `self`, the function's first argument is that RRef's value (on its owner).
  RRefPtr remote(int owner, const std::string& fn, std::vector<c10::IValue> args,
                 std::chrono::milliseconds timeout, const RRefPtr& self = RRefPtr());
  // A local owner reference to `value`.
  RRefPtr make_local(c10::IValue value);
  // to_here(): a future of the value, fetched from the owner.
  RawFuture fetch(const RRefPtr& rref, std::chrono::milliseconds timeout);
  // Runs `fn(value, args...)` on the owner.
  RawFuture call(const RRefPtr& rref, const std::string& fn, std::vector<c10::IValue> args,
                 std::chrono::milliseconds timeout);
  // The value on its owner; throws std::logic_error anywhere else.
  c10::IValue local_value(const RRefPtr& rref, std::chrono::milliseconds timeout);

  // Codec and agent hooks.
  RRefDesc fork_for_send(const RRefPtr& rref, int dest) override;
  void abort_forks(const std::vector<RRefDesc>& forks) override;
  // Throws ProtocolError for a descriptor received from `from` that cannot be
  // right; the agent checks every RRef of a message before adopting any.
  void validate(const RRefDesc& desc, int from) const;
  // The handle for a (validated) RRef received in a message, made before
  // anyone sees the message: counts it and starts the fork protocol (2. above).
  RRefPtr adopt_received(const RRefDesc& desc);
  // From ~RRefImpl.
  void on_dropped(RRefImpl& rref);

  // Waits until no control message is outstanding and every RRef this
  // worker passed on has been accepted (graceful shutdown). False when
  // `limit` passed first (a peer that died can leave one unanswered).
  bool wait_idle(std::chrono::milliseconds limit);
  // Stops issuing control messages (the agent is closing).
  void close();
  // "RRef 0:3 (owner worker1)" for every user handle still alive.
  std::vector<std::string> live_user_refs() const;
  size_t owned_values() const;
  const std::shared_ptr<ThreadPool>& pool() const;
  // A blocking wait for an RRef operation: spins briefly like rpc_sync.
  void spin_until_done(const RawFuture& f) const;
  std::string worker_name(int rank) const;
  WorkerInfo worker_info(int rank) const;
  int self_rank() const { return self_; }

 private:
  struct OwnerRecord {
    RawFuture value;
    std::unordered_set<ForkId, GloballyUniqueIdHash> forks;
    int local_handles = 0;
  };

  ForkId new_id();
  // Both under mu_.
  OwnerRecord& record_locked(const RRefId& id);
  // Removes the record if nothing holds it; returns it for destruction
  // outside the lock (its value may hold RRefs whose destructors call back).
  std::unique_ptr<OwnerRecord> release_if_unused_locked(const RRefId& id);
  // Runs `fn` on the pool, counted as outstanding until `done` is called.
  // False (and `fn` not run) once the context is closed.
  bool control(std::function<void(std::function<void()> done)> fn);
  // Deletes are batched per owner: the first one waits kDeleteBatchDelay
  // for company, then one "delete" message carries all that queued up.
  void queue_delete(const RRefDesc& desc);
  void flush_deletes(int owner);
  // Sends an idempotent control message, again on a timeout (up to 3 tries);
  // `then` gets the final error, or null.
  void send_control(int to, const std::string& fn, std::vector<c10::IValue> msg,
                    std::function<void(std::exception_ptr)> then, int attempt = 1);
  RRefPtr new_handle(const RRefDesc& desc, RRefImpl::Kind kind, RawFuture confirmed);

  // Handlers (owner side unless noted).
  // Completes when the value exists (with None), or with why it does not.
  RawFuture on_create(const RRefId& id, const ForkId& fork, const std::string& fn,
                      c10::optional<RRefId> self, std::vector<c10::IValue> args);
  RawFuture on_fetch(const RRefId& id);
  RawFuture on_call(const RRefId& id, const std::string& fn, std::vector<c10::IValue> args);
  void on_fork(const RRefId& id, const ForkId& fork);
  void on_delete(const std::vector<std::pair<RRefId, ForkId>>& batch);
  void on_child_accept(const ForkId& fork);  // parent side
  // Runs the user's function `fn` on `value` and `args` when `value` is
  // ready; the result (or error) completes the returned future.
  RawFuture apply_when_ready(RawFuture value, const std::string& fn, std::vector<c10::IValue> args,
                             bool with_value);

  Agent& agent_;
  const int self_;
  std::atomic<uint64_t> next_local_{1};

  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  std::unordered_map<RRefId, OwnerRecord, GloballyUniqueIdHash> owners_;
  // Children this worker forked from its user handles, held until accepted.
  std::unordered_map<ForkId, RRefPtr, GloballyUniqueIdHash> pending_children_;
  // User forks alive in this process (for the leak report).
  std::unordered_map<ForkId, RRefDesc, GloballyUniqueIdHash> users_;
  struct QueuedDelete {
    RRefId id;
    ForkId fork;
  };
  std::unordered_map<int, std::vector<QueuedDelete>> delete_queue_;  // by owner
  // Owner side: forks deleted before their create/fork was processed (the
  // pool may run messages out of order). A late create or fork for one of
  // them must not bring it back. Bounded, oldest forgotten first.
  // Forks deleted before they arrived, remembered so that they are refused
  // when they do (a bounded set: rref/detail.h).
  std::unique_ptr<Tombstones> tombstones_;
  bool take_tombstone_locked(const ForkId& fork);
  // `n` outstanding items are finished; wakes wait_idle() at zero. The
  // _locked form is for callers already holding mu_.
  void finish_outstanding_locked(int n = 1);
  void finish_outstanding(int n = 1);
  // The value future of `id` for a fetch or call. A request may overtake
  // the create it depends on, so an unknown id gets a placeholder record;
  // one that nobody claims within the agent's rpc_timeout is dropped (its
  // waiters get an error) rather than kept forever.
  RawFuture value_for_request(const RRefId& id);
  void drop_placeholder(const RRefId& id);
  std::unordered_set<int> delete_scheduled_;  // owners with a flush scheduled or in flight
  int outstanding_ = 0;  // control messages in flight, deletes queued, children pending
  bool closed_ = false;
};

}  // namespace tandem::rpc
