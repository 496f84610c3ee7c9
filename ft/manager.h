#pragma once
// Per-step fault tolerance across data-parallel replicas: the healthy
// replicas go on training through a failure, and a replacement is healed
// from a healthy replica's memory, not from disk.
//
//   ft::Manager manager(options, ft::module_state(model, optimizer));
//   for (;;) {
//     manager.start_step();                        // the quorum; heals a newcomer
//     auto batch = manager.batch_indices();        // this replica's samples
//     ... loss.backward();                         // grads: each parameter's .grad()
//     manager.allreduce_grads(grads);              // the mean over the quorum
//     if (manager.should_commit()) optimizer.step();
//   }
//
// A replica is one process (one rank under DDP), or a group of
// ManagerOptions::replica_size processes that hold one copy of the model
// between them (HSDP's replica group, a pipeline row): each of them runs a
// Manager with the replica's id and its own replica_rank. Such a replica is
// alive while all its processes are; one that lost a process sits out the
// quorums until the process is back (tandem-run --replace-failed), and
// rejoins whole. Its processes meet in replica_group(), made anew with each
// quorum; the rank-r processes of the quorum's replicas meet in group()
// (the gradients of shard r are averaged there, shard r is healed there).
// Its promises:
// 1. Quorum. Each replica's Manager meets the others at a store that no
//    replica hosts (tandem-run's, by default). start_step() joins a quorum
//    when the replica has none (its first step, after a failed step, or when
//    one waits to join): the replicas alive then (their heartbeat fresh)
//    agree on the members and make a process group among themselves. A
//    quorum needs ManagerOptions::min_replicas; when fewer than that come
//    within quorum_timeout, start_step() throws ft::QuorumError (under
//    tandem-run --max-restarts the job then restarts from its checkpoint).
// 2. Gradients. allreduce_grads() averages over the quorum's replicas: the
//    update means the same whatever its size (each replica's batch is the
//    same; the learning rate is left as it is, and the effective batch is
//    participants() x the batch: scale it yourself if you prefer). A
//    collective that fails (a member died) or waits for a member whose
//    heartbeat stopped (stopped, cut off) does not throw: it is recorded,
//    and the step will be committed by nobody. DistributedDataParallel's
//    buckets may average instead, overlapped with backward: made with
//    init_sync off over group() at the first quorum, moved by set_group()
//    at each next (ManagerOptions::on_quorum); a backward that throws (a
//    peer gone) is report_error()'s, and allreduce_grads is not called.
// 3. Commit. should_commit() is a vote at the store: the step commits only
//    when every member voted that its step went well, and the same answer
//    reaches every member (the first decision written wins, as two-phase
//    commit's coordinator's would). A member that died or fell silent
//    before it voted makes the step fail everywhere. After a failed step the
//    replicas apply no update and form a new quorum at the next
//    start_step(): no process restarts, nothing is reloaded.
// 4. Agreement. Each vote carries a fingerprint of the replica's parameters
//    and state before the update; members that differ make the step fail
//    and should_commit() throws ft::DivergenceError naming them, on every
//    member.
// 5. Healing. A member whose committed step count is behind the quorum's
//    (a replacement, a new replica, one that was stopped) receives the whole
//    state (the State's tensors, the step count, the sampler's position)
//    from one up-to-date member, each byte once, over the quorum's group,
//    before it trains; the others wait for it only in their next step's
//    collective. A newcomer whose state does not match the source's (other
//    names, shapes or dtypes: another model) is refused by name and the
//    quorum goes on without it.
// 6. Data. batch_indices() gives this replica's samples of the step: the
//    quorum consumes one stream of samples (an epoch's seeded permutation,
//    then the next epoch's) in order, participants() x batch_size of them a
//    committed step, member k taking the k-th batch. A failed step consumes
//    nothing: its samples are the next quorum's, so within the stream no
//    sample is skipped or trained twice, whatever fails.
// Replacements: a replica started again (tandem-run --replace-failed) or
// added with the same store joins at the next step boundary: the quorum's
// members learn of it when they commit and form the next quorum with it.
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace tandem::ddp {
class ProcessGroup;
}

namespace tandem::ft {

class Heartbeat;
class Manager;

// No quorum could be formed (fewer than min_replicas within the timeout, or
// the store is gone): the job cannot go on without a restart.
class QuorumError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The exit code for a replica that ends on QuorumError: tandem-run
// --replace-failed does not start it again alone (the job has lost its
// quorum; --max-restarts restarts it whole, from its checkpoint).
inline constexpr int kExitNotReplaceable = 78;

// The members' parameters differ at a commit; the text names the replicas.
class DivergenceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The job's replicas finished training (their Managers were destroyed at
// the end of their loops) before this replica could join them: there is
// nothing left to train, and nobody to heal it from. A replacement started
// as the job ended gets it from start_step(); exiting 0 is the right answer.
class JobFinished : public std::runtime_error {
 public:
  JobFinished(const std::string& what, int64_t step) : std::runtime_error(what), step_(step) {}
  // The step the job finished at.
  int64_t step() const { return step_; }

 private:
  int64_t step_;
};

// What a replica's state is, for healing and the fingerprint: its tensors
// by name (parameters, buffers, optimizer state), and how to load them.
// `save` returns the tensors themselves (not copies: they are sent before
// the step's update); `load` receives every tensor `save` gives on the
// source, with its name, and must make this replica's state equal it.
struct State {
  std::function<std::vector<std::pair<std::string, at::Tensor>>()> save;
  std::function<void(const std::vector<std::pair<std::string, at::Tensor>>&)> load;
  // The tensors that must be bit-equal on every replica and whose names,
  // dtypes and shapes a newcomer must match (the parameters and buffers).
  // Empty: all of save()'s.
  std::function<std::vector<std::pair<std::string, at::Tensor>>()> model;
};

// A module's parameters and buffers and `optimizer`'s state of each
// parameter (LibTorch's kinds: SGD, Adam, AdamW, Adagrad, RMSprop), and
// the default CPU generator's state, so that dropout goes on alike.
State module_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer);

struct ManagerOptions {
  // This replica's id, 0 <= id < max_replicas; -1: RANK / replica_size,
  // from the environment.
  int replica_id = -1;
  // How many replica ids there are; -1: WORLD_SIZE / replica_size.
  int max_replicas = -1;
  // The processes of one replica, and this process's place among them
  // (-1: RANK % replica_size). Under tandem-run, ranks id * replica_size ..
  // id * replica_size + replica_size - 1 make replica id.
  int replica_size = 1;
  int replica_rank = -1;
  // Called by start_step() in each quorum this process joins, once its
  // groups are made and before it is healed: set up what communicates over
  // group() or replica_group() there (a sharded model's group:
  // ddp::FullyShardedDataParallel::set_group), so that healing finds the
  // state where it lives. An exception from it leaves the quorum (the next
  // is tried); std::logic_error (std::invalid_argument too) propagates.
  std::function<void(Manager&)> on_quorum;
  // A quorum needs this many members.
  int min_replicas = 1;
  // Makes a new client of the store the replicas meet at (the manager keeps
  // one for its steps, one for its heartbeat thread, and one for each
  // quorum's group). Empty: an etcd cluster's (ft/etcd_store.h) when
  // TANDEM_ETCD names its members, else a TCPStore client of
  // MASTER_ADDR:MASTER_PORT, which must be hosted by the launcher
  // (tandem-run does), since a replica that hosted it would end the job by
  // dying.
  std::function<c10::intrusive_ptr<c10d::Store>()> connect;
  // The cluster token: joins, quorums and decisions carry its MAC, so that
  // nothing written to the store without it is believed. Empty: TANDEM_TOKEN.
  std::string token;
  // Keys go under "tandem/ft/<job>/<run_id>.<round>/", round being the
  // launcher's TANDEM_RESTART_COUNT (0 without one): a whole-job restart
  // starts from fresh keys. A store that outlives jobs (etcd) needs a run id
  // of each launch of a job, as torchrun's --rdzv-id: empty takes
  // TANDEM_RUN_ID, else "run" (enough for a store that lives with the job,
  // as tandem-run's does).
  std::string job = "job";
  std::string run_id;
  std::string backend = "gloo";
  // Heartbeats: one each interval; a replica silent for heartbeat_timeout
  // is gone (stopped, frozen, cut off).
  std::chrono::milliseconds heartbeat_interval{100};
  std::chrono::milliseconds heartbeat_timeout{2000};
  // How long a forming quorum waits for a replica that is alive but has not
  // joined (it may be finishing a failed step).
  std::chrono::milliseconds join_timeout{3000};
  // How long start_step() waits for min_replicas before QuorumError.
  std::chrono::milliseconds quorum_timeout{std::chrono::seconds(60)};
  // A collective's limit (the failure of a member that is still heartbeating).
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(30)};
  // The sample stream of batch_indices(): dataset_size samples an epoch,
  // batch_size a replica a step; seed for each epoch's permutation
  // (shuffle false: 0, 1, 2, ...).
  int64_t dataset_size = 0;
  int64_t batch_size = 0;
  uint64_t seed = 0;
  bool shuffle = true;
};

// What the manager measures, for benchmarks and the job's metrics.
struct Metrics {
  int64_t steps_committed = 0;
  int64_t steps_failed = 0;  // voted down (a member failed or diverged)
  int64_t quorums = 0;       // quorums this replica was a member of
  int64_t heals = 0;         // times this replica was healed
  int64_t heal_bytes_received = 0;
  int64_t heal_bytes_sent = 0;
  int64_t state_bytes = 0;    // the state's tensors' bytes, at the last heal
  double last_heal_ms = 0;    // the last heal received: from the quorum to loaded
  double last_quorum_ms = 0;  // the last quorum formed: from joining to the group made
};

// Samples [first, first + count) of the stream batch_indices() reads (6.):
// position p is sample perm_e[p % dataset_size] of epoch e = p / dataset_size,
// perm_e a permutation seeded by (seed, e) (the identity without shuffle).
// The same on every replica and build: a reference run reads it too.
std::vector<int64_t> sample_stream(int64_t dataset_size, uint64_t seed, bool shuffle, int64_t first,
                                   int64_t count);

class Manager {
 public:
  // Starts the heartbeat; joins nothing yet (start_step() does). Throws
  // std::invalid_argument naming a bad option.
  Manager(ManagerOptions options, State state);
  // Stops the heartbeat and leaves the quorum (its members see this replica
  // gone at their next vote). Destroyed with no exception in flight, after
  // a quorum, it also marks the job finished at its step: a replica that
  // joins once none of its last quorum's members is alive, and is behind
  // that step, gets JobFinished rather than waiting for a quorum.
  ~Manager();
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  // The step's quorum: forms one (and heals this replica when it is behind)
  // when there is none. Throws QuorumError (1.), and JobFinished.
  void start_step();
  // The mean of `grads` over the quorum, in place (undefined ones skipped).
  // False, and nothing throws, when it failed or this replica reported an
  // error: the step will not commit. Every member calls it each step, even
  // one that reported an error (its peers' collective waits for it), with
  // the same list: the same dtypes and sizes in the same order, the same
  // ones undefined (a quorum's first step compares them across the members,
  // and a step whose lists differ fails everywhere, named).
  bool allreduce_grads(const std::vector<at::Tensor>& grads);
  // This replica's step failed for a reason of its own (a non-finite loss,
  // an exception): the step commits nowhere.
  void report_error(const std::string& why);
  // The vote (3.). True: apply the update (optimizer.step()); the committed
  // step count and the sample stream advance. False: skip it. Throws
  // DivergenceError (4.) and QuorumError (the store gone).
  bool should_commit();

  // After a restart from a checkpoint, before the first start_step(): the
  // committed steps and the samples consumed that the loaded state is at
  // (the state itself is the caller's to load). The first quorum takes the
  // furthest replica's. Throws std::logic_error once a quorum was joined.
  void restore(int64_t step, int64_t samples_done);

  // Committed steps so far (the quorum's, once healed).
  int64_t step() const { return step_; }
  // The samples the quorum has consumed (6.).
  int64_t samples_done() const { return cursor_; }
  // This replica's samples for the step (6.): batch_size indices into the dataset.
  std::vector<int64_t> batch_indices() const;
  // The current quorum: its size and this replica's place in it.
  int participants() const;
  int participant_rank() const;
  // The members' replica ids, in their order.
  std::vector<int> members() const;
  int replica_id() const { return id_; }
  int64_t quorum_id() const { return epoch_; }
  // The quorum's process group (null between a failed step and the next
  // start_step()), for collectives of your own: one process of each member
  // replica, those of this process's replica_rank (the replica's place in
  // it is participant_rank()).
  std::shared_ptr<ddp::ProcessGroup> group() const { return group_; }
  // This replica's own processes (replica_size of them, ranked by
  // replica_rank), made anew with each quorum (quorum_id()): a model split
  // within the replica is set up on it again when it changes. Null with a
  // replica of one process, and between a failed step and the next
  // start_step(). Its collectives end early when a member of the quorum is
  // gone, as group()'s do.
  std::shared_ptr<ddp::ProcessGroup> replica_group() const { return replica_group_; }
  // A new client of the store the replicas meet at, its keys this quorum's
  // and this replica's own, under `name`: for a rendezvous of the
  // replica's processes made anew with each quorum besides replica_group()
  // (a pipeline row's RPC agent: rpc::Agent::create(options, registry,
  // m.replica_store("rpc")) in on_quorum). Its waits end early, as the
  // groups' collectives do, once a member of the quorum is gone. Throws
  // std::logic_error outside a quorum.
  c10::intrusive_ptr<c10d::Store> replica_store(const std::string& name) const;
  // A group of some of this replica's processes, `ranks` (replica_ranks,
  // this process's among them; ranked in that order), met over
  // replica_store(name): a tensor-parallel group inside a pipeline row,
  // made in on_quorum by each of its members. Its collectives end early as
  // replica_group()'s do; the caller keeps it for the quorum. Throws
  // std::logic_error outside a quorum, std::invalid_argument for ranks
  // that are not this replica's, repeat, or leave this process out.
  std::shared_ptr<ddp::ProcessGroup> replica_subgroup(const std::string& name,
                                                      const std::vector<int>& ranks) const;
  int replica_rank() const { return rank_; }
  int replica_size() const { return size_; }
  // The last step's error, empty when it went well.
  const std::string& last_error() const { return error_; }
  const Metrics& metrics() const { return metrics_; }

 private:
  struct Joined;
  // Forms the quorum of epoch `e` (or a later one, when this replica comes
  // too late for it); false when it is not a member yet.
  bool join_quorum();
  // Heals the members of group() (`mine`: the quorum's processes of this
  // one's replica_rank) that are behind the quorum's newest step (`all`'s).
  void heal(const std::vector<Joined>& mine, const std::vector<Joined>& all);
  // The cluster token's MAC of `what`, under this job's keys.
  std::string sign(const std::string& what) const;
  // A step mark of the store's ("committed": the job's newest committed
  // step; "finished": the step its replicas ended at), 0 when there is none.
  // Throws QuorumError when it lacks this replica's token's proof.
  int64_t mark(const std::string& key);
  std::string fingerprint();
  void drop_group();

  ManagerOptions options_;
  State state_;
  int id_ = 0;
  int max_ = 0;
  int size_ = 1;  // processes a replica
  int rank_ = 0;  // this process's place in its replica
  int proc_ = 0;  // this process's index: id_ * size_ + rank_
  // "replica 2", or "replica 2 rank 1" (process p's, with replicas of several)
  std::string name_of(int process) const;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;  // the keys' (ManagerOptions::job)
  std::shared_ptr<Heartbeat> heartbeat_;
  c10::intrusive_ptr<c10d::Store> group_store_;  // the quorum's group's own client
  std::shared_ptr<ddp::ProcessGroup> group_;
  // Why the quorum's groups cannot go on ("" while they can): a member gone,
  // or the quorum moved on. Their collectives, and a heal's transfers, end
  // when it says so.
  std::function<std::string()> stalled_;
  c10::intrusive_ptr<c10d::Store> replica_group_store_;
  std::shared_ptr<ddp::ProcessGroup> replica_group_;
  std::string replica_prefix_;  // the quorum's keys of this replica; "" outside one
  std::vector<int> members_;    // replica ids
  std::vector<int> procs_;      // the quorum's processes: each member's, by replica_rank
  int rank_in_quorum_ = -1;
  int64_t epoch_ = 0;    // the quorum's number; 0 before the first
  int64_t step_ = 0;     // committed steps
  int64_t cursor_ = 0;   // samples consumed by committed steps
  int64_t attempt_ = 0;  // steps tried in this quorum (the vote's key)
  bool reform_ = true;   // start_step() must form a quorum
  bool voted_ = false;
  bool group_failed_ = false;  // a collective of this step failed
  // The gradients' layout the quorum agreed on (allreduce_grads): its hash
  // and each dtype's buffer size.
  bool layout_agreed_ = false;
  uint64_t agreed_layout_ = 0;
  std::vector<std::pair<c10::ScalarType, int64_t>> agreed_sizes_;
  std::string error_;
  Metrics metrics_;
};

}  // namespace tandem::ft
