#pragma once
// Process groups and collectives for data parallelism.
//
// A ProcessGroup is c10d's engine (ProcessGroupGloo on CPU, ProcessGroupNCCL
// on CUDA where LibTorch has it) behind a small front that speaks
// milliseconds and names what went wrong: no collective here is our own.
// Every collective is called by every rank of the group in the same order,
// as in PyTorch.
//
//   ddp::init_process_group("gloo");              // env://, as tandem-run sets
//   ddp::all_reduce(t);                            // sum over the default group
//   ddp::destroy_process_group();
//
// A collective that does not finish within its timeout throws
// ddp::CollectiveError naming the collective, the group's rank and the time;
// so does one whose peer died (Gloo reports the broken connection). Either
// error also names the peers that are gone: at creation every rank publishes
// who it is (its worker's name, host and process), and on a failure the
// survivors check in at the group's store: a peer on this host whose process
// has exited is named as gone at once, one that does not check in within
// two seconds as not answering. After either, the group is unusable, as in
// PyTorch: destroy it and make a new one.
// A member found stalled by this process's RPC agent (rpc::Agent::watch:
// its connection silent past AgentOptions::peer_timeout, as a stopped or
// frozen process is) fails a gloo collective waiting for it at once with
// CollectiveError naming it, instead of after the group's timeout; such a
// group's destructor then does not wait for gloo's operation (which waits
// for the stalled member until the group's timeout) but lets the engine go.
// A call's own timeout only bounds the caller's wait: Gloo's operation itself
// ends at the group's timeout, and destroying the group waits for that.
// Making a group sets SIGPIPE to ignored when it has its default action (as
// Python does at startup): Gloo's sockets would otherwise kill the process
// when a peer dies, instead of failing the collective.
// Destroying a healthy group first waits (10 s at most) until every rank is
// destroying it too, so that no rank closes its connections while a peer
// still reads its last collective's data from them; a broken or abandoned
// group, or one destroyed while an exception unwinds the stack, waits for
// nobody.
#include <ATen/core/Tensor.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Backend;
}  // namespace c10d

namespace tandem::rpc {
class Agent;
}

namespace tandem::ddp {

// What a collective raises when it fails or times out.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class ReduceOp { kSum, kAvg, kProduct, kMin, kMax };

// The c10d class Gloo's and NCCL's groups derive from: ProcessGroup in
// LibTorch 1.x, Backend from 2.0 on.
#if TORCH_VERSION_MAJOR >= 2
using C10dEngine = c10d::Backend;
#else
using C10dEngine = c10d::ProcessGroup;
#endif

// PyTorch's default: 30 minutes. Each call may give its own.
constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{30 * 60 * 1000};
// "Use the group's timeout" for a call's timeout argument.
constexpr std::chrono::milliseconds kGroupTimeout{-1};

// Whether this build has the nccl backend (LibTorch built with CUDA and NCCL).
bool nccl_available();
// Whether this build has the gloo backend (LibTorch's or the system's Gloo
// headers were found; PyTorch's wheels ship none).
bool gloo_available();

struct ProcessGroupOptions {
  std::string backend = "gloo";        // "gloo" (CPU tensors) or "nccl" (CUDA tensors)
  std::string init_method = "env://";  // or "tcp://host:port"; ignored when store is given
  int world_size = -1;                 // -1: from the environment (WORLD_SIZE, ...)
  int rank = -1;                       // -1: from the environment (RANK, ...)
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  // Meet at this store instead of init_method's (keys go under a prefix of
  // the group's own, so an RPC agent may share it).
  c10::intrusive_ptr<c10d::Store> store;
  std::string group_name;  // empty: "default" for the default group
  // How the other ranks' errors name this one: its worker's name. Empty:
  // the current RPC agent's (rpc::init), else none (the rank alone).
  std::string member_name;
  // A second watcher beside the RPC agent's: a member it names (a non-empty
  // text, which the collective's error then carries) counts as stalled, as
  // one the agent found (tandem::ft's heartbeats). Asked every 200 ms at
  // most while a collective waits; called on that thread. With it, a failed
  // collective names the members whose process exited and what this
  // function says, without the check-in round at the store.
  std::function<std::string()> stalled;
};

class ProcessGroup {
  struct Peers;  // who the ranks are, and who is gone after a failure

 public:
  // Meets the other ranks and builds the backend's group. Throws
  // std::invalid_argument for a bad backend, rank, size or init_method, and
  // CollectiveError when the others do not come within the timeout.
  static std::shared_ptr<ProcessGroup> create(ProcessGroupOptions options);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // This rank gives up on the group (its job failed elsewhere): it is
  // marked broken, as after a failed collective, so that destroying it
  // waits for no peer.
  void abandon() { broken_->store(true); }
  const std::string& backend() const { return backend_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // In place on every rank. kAvg divides the sum by size() (floating point only).
  void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum,
                  std::chrono::milliseconds timeout = kGroupTimeout);
  // In place: every rank ends with src's values (same shape and dtype everywhere).
  void broadcast(at::Tensor& tensor, int src, std::chrono::milliseconds timeout = kGroupTimeout);
  // Every rank's tensor, in rank order (same shape and dtype everywhere).
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor,
                                     std::chrono::milliseconds timeout = kGroupTimeout);
  void barrier(std::chrono::milliseconds timeout = kGroupTimeout);

  // The asynchronous forms DDP's buckets use: start now, wait() later.
  class Pending {
   public:
    Pending() = default;
    // Throws CollectiveError on failure or after `timeout` (the group's
    // when kGroupTimeout). Once only.
    void wait(std::chrono::milliseconds timeout = kGroupTimeout);
    bool valid() const { return work_ != nullptr; }
    // Whether the collective has ended (worked or failed), or a member it
    // waits for is found stalled: wait() then returns or throws at once.
    bool done() const;
    // Gives up on it: the caller will never wait() (its step failed
    // elsewhere). The group is marked broken, as after a failure: closing
    // it waits for no peer.
    void abandon();
    // Runs `fn` once the collective has ended (on the backend's thread, or
    // here if it has already), whether it worked or not. False, and `fn`
    // dropped, when the backend cannot say (then only wait() knows).
    bool on_completion(std::function<void()> fn);

   private:
    friend class ProcessGroup;
    c10::intrusive_ptr<c10d::Work> work_;
    std::string what_;  // "all_reduce(sum) on rank 1 of 2"
    std::chrono::milliseconds timeout_{};
    std::shared_ptr<std::atomic<bool>> broken_;  // the group's: set when this fails
    std::shared_ptr<Peers> peers_;               // the group's: who is gone, on a failure
    std::function<void()> then_;                 // after the collective, in wait()
  };
  // In place, finished by wait(). kAvg sums only: callers scale first (DDP
  // divides its buckets before they go).
  Pending all_reduce_async(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum,
                           std::chrono::milliseconds timeout = kGroupTimeout);
  Pending broadcast_async(at::Tensor& tensor, int src,
                          std::chrono::milliseconds timeout = kGroupTimeout);

  // ---- the sharded layers' collectives (ddp/collectives.cc) ----
  // Every rank's `tensor` into `out`: size() tensors of its shape and dtype
  // (views of one buffer are fine), in rank order.
  Pending all_gather_async(const at::Tensor& tensor, std::vector<at::Tensor> out,
                           std::chrono::milliseconds timeout = kGroupTimeout);
  // Reduce-scatter: `input` holds size() pieces end to end, piece r of
  // counts[r] elements (all equal when `counts` is empty); `output`, of
  // this rank's count, gets the sum (kSum) or the mean (kAvg) over the ranks
  // of their piece rank(). Finished by wait(). NCCL does it with its own
  // reduce-scatter where the pieces are equal. Gloo in LibTorch 1.x has no
  // reduce-scatter: there it is an all-to-all of the pieces (each rank
  // sends (N-1)/N of its input, as a ring reduce-scatter does) and a local
  // sum in wait(), which needs room for size() pieces of this rank's count
  // while it runs; float16 and bfloat16 pieces are summed in float32 there
  // (bfloat16's words travel as float16's: Gloo 1.x has no bfloat16).
  // `output` holds the result only after wait() (done() and on_completion()
  // tell of the transfer, before that local sum).
  Pending reduce_scatter_async(const at::Tensor& input, at::Tensor output,
                               ReduceOp op = ReduceOp::kSum, std::vector<int64_t> counts = {},
                               std::chrono::milliseconds timeout = kGroupTimeout);
  // Rank dst gets every rank's tensor (the same shape and dtype everywhere),
  // in rank order; the others get an empty vector.
  std::vector<at::Tensor> gather(const at::Tensor& tensor, int dst,
                                 std::chrono::milliseconds timeout = kGroupTimeout);
  // Bytes of any length, as PyTorch's all_gather_object / gather_object
  // move pickles (the lengths first, then the bytes padded to the longest).
  // `device`: where the bytes travel (default: the CPU for gloo, the
  // current GPU for nccl).
  std::vector<std::string> all_gather_bytes(const std::string& mine,
                                            std::chrono::milliseconds timeout = kGroupTimeout,
                                            std::optional<c10::Device> device = std::nullopt);
  std::vector<std::string> gather_bytes(const std::string& mine, int dst,
                                        std::chrono::milliseconds timeout = kGroupTimeout);
  // Throws std::invalid_argument on every rank when the ranks' `lines`
  // differ, naming the first that does: "<who>: the ranks' <what> differ at
  // <item> #k: rank 0 has <line>, rank r has <line> (<hint>)".
  void expect_same_lines(const std::vector<std::string>& lines, const std::string& who,
                         const std::string& what, const std::string& item, const std::string& hint,
                         std::chrono::milliseconds timeout = kGroupTimeout,
                         std::optional<c10::Device> device = std::nullopt);

  // LibTorch's clip_grad_norm_ over a model whose gradients are shared out
  // over the group: `mine` are the gradients this rank counts (each of the
  // model's counted by exactly one rank; undefined ones skipped), their
  // squares are summed over the group, and when max_norm / (total + 1e-6)
  // is below 1 every defined gradient of `scaled` is multiplied by it.
  // Returns the total norm. Collective. `who` begins the error for a
  // max_norm that is not a finite number > 0.
  // With `also`, the sums are then added over that group too (the
  // model's tensor-parallel ranks: ClipOptions).
  double clip_grad_norm(const std::vector<at::Tensor>& mine, const std::vector<at::Tensor>& scaled,
                        double max_norm, const std::string& who,
                        std::chrono::milliseconds timeout = kGroupTimeout,
                        ProcessGroup* also = nullptr);

  // The c10d group itself, for what this front does not cover.
  C10dEngine& c10d() { return *pg_; }

  // Who a rank of the group is, as it said at creation.
  struct Member {
    std::string name;  // its worker's name; empty when it had none
    std::string host;
    int64_t pid = 0;
  };
  const std::vector<Member>& members() const;
  // "rank 2 (worker \"trainer1\", pid 4242 on host-a)": how errors name rank r.
  std::string describe(int r) const;

 private:
  ProcessGroup() = default;
  void wait_for_peers_to_close();
  // Asks this process's agent, if any, to watch the members (gloo only),
  // so that a stalled one fails the collectives waiting for it.
  void watch_peers();
  // Publishes who this rank is and reads who the others are.
  static std::shared_ptr<Peers> meet_peers(c10d::Store& store, int rank, int size,
                                           std::string name);
  void check_tensor(const at::Tensor& t, const char* what) const;
  // Where collectives on bytes put them: the CPU for gloo, the current GPU for nccl.
  c10::Device bytes_device() const;
  Pending pending(c10::intrusive_ptr<c10d::Work> work, const std::string& what,
                  std::chrono::milliseconds timeout) const;
  std::chrono::milliseconds resolve(std::chrono::milliseconds timeout) const {
    return timeout.count() < 0 ? timeout_ : timeout;
  }

  c10::intrusive_ptr<C10dEngine> pg_;
  c10::intrusive_ptr<c10d::Store> store_;  // the group's own keys (prefixed)
  // A collective failed: the peers may be gone, so closing waits for nobody.
  std::shared_ptr<std::atomic<bool>> broken_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<Peers> peers_;
  int rank_ = -1, size_ = 0;
  std::string backend_;
  std::chrono::milliseconds timeout_{};
};

// Global-norm clipping of a model that data parallelism shards (ZeRO,
// FSDP) and tensor parallelism also splits (parallel/): every rank holds
// slices of the split parameters and a copy of the replicated ones.
struct ClipOptions {
  // The tensor-parallel group: the squares are summed over it too. Null:
  // the model is not split.
  std::shared_ptr<ProcessGroup> group;
  // Whether this rank counts a parameter (given as the model holds it):
  // its slices, yes; its copy of a replicated one, on one rank of `group`
  // only (checkpoint::replica_of(p) == 0 says so for parallel/'s layers).
  // Empty: every parameter.
  std::function<bool(const at::Tensor&)> counted;
};

// Gives the memory of `t`'s storage back now, whatever else still refers to
// it (the storage is left empty): for a finished collective's private
// buffers, which Gloo's worker thread holds until a moment after the
// collective has returned. Nothing may read `t`, or a view of its storage,
// afterwards. CPU tensors only (a GPU tensor is left as it is: the caching
// allocator orders its reuse behind the streams that used it).
void release_buffer(const at::Tensor& t);

// The default group, as torch.distributed has one.
void init_process_group(ProcessGroupOptions options = {});
void init_process_group(const std::string& backend, const std::string& init_method = "env://",
                        int world_size = -1, int rank = -1,
                        std::chrono::milliseconds timeout = kDefaultCollectiveTimeout);
void destroy_process_group();
bool is_initialized();
// Throws std::logic_error when init_process_group has not been called.
ProcessGroup& default_group();
std::shared_ptr<ProcessGroup> default_group_ptr();
int get_rank();
int get_world_size();

void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum,
                std::chrono::milliseconds timeout = kGroupTimeout);
void broadcast(at::Tensor& tensor, int src, std::chrono::milliseconds timeout = kGroupTimeout);
std::vector<at::Tensor> all_gather(const at::Tensor& tensor,
                                   std::chrono::milliseconds timeout = kGroupTimeout);
void barrier(std::chrono::milliseconds timeout = kGroupTimeout);

const char* to_string(ReduceOp op);

// ---- groups by name, per worker ----
// How a layer running on a worker finds the group its caller names: the
// pipeline's stage service finds PipeOptions::data_parallel_group here. A
// Mesh registers its groups under Mesh::group_name(dim). Per agent, so that
// the workers of one test process keep theirs apart; an entry lasts as long
// as its group (the registry holds it weakly). Registering a name again
// replaces the entry.
void register_group(const rpc::Agent& agent, const std::string& name,
                    const std::shared_ptr<ProcessGroup>& group);
void unregister_group(const rpc::Agent& agent, const std::string& name);
// Null when `agent` has no live group of that name.
std::shared_ptr<ProcessGroup> find_group(const rpc::Agent& agent, const std::string& name);

}  // namespace tandem::ddp
