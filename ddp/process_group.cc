#include "tandem/ddp/process_group.h"

#include "tandem/ddp/peers.h"

#include <ATen/ops/empty_like.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#if defined(TANDEM_WITH_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(TANDEM_WITH_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <signal.h>
#include <unistd.h>

#include <exception>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "tandem/rpc/agent.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rendezvous.h"

namespace tandem::ddp {

bool gloo_available() {
#if defined(TANDEM_WITH_GLOO)
  return true;
#else
  return false;
#endif
}

bool nccl_available() {
#if defined(TANDEM_WITH_NCCL)
  return true;
#else
  return false;
#endif
}
namespace {

std::string ms_text(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }

c10d::ReduceOp c10d_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // summed, then divided here (Gloo has no AVG)
      return c10d::ReduceOp::SUM;
    case ReduceOp::kProduct:
      return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
  }
  throw std::invalid_argument("unknown ReduceOp");
}

#if defined(TANDEM_WITH_GLOO)
// The Gloo device: GLOO_SOCKET_IFNAME as PyTorch reads it, else the address
// that routes towards the master (loopback for a local job).
std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_host) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  std::string host = "127.0.0.1";
  if (!master_host.empty() && !rpc::is_loopback_host(master_host)) {
    host = rpc::local_address_towards(master_host);
    if (host.empty()) {
      throw std::invalid_argument("cannot tell this host's address towards the master " +
                                  master_host + "; set GLOO_SOCKET_IFNAME");
    }
  }
  return c10d::ProcessGroupGloo::createDeviceForHostname(host);
}
#endif

// Gloo writes to its sockets without MSG_NOSIGNAL: a peer that died would
// kill this process with SIGPIPE instead of failing the collective. Python
// ignores SIGPIPE from startup, which is why PyTorch users never see it; a
// C++ program gets the same here, unless it installed a handler of its own.
void ignore_sigpipe_once() {
  static const bool done = [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
    return true;
  }();
  (void)done;
}

std::mutex g_default_mu;
std::shared_ptr<ProcessGroup> g_default;


// What the registry keeps per (agent, name).
struct Named {
  std::weak_ptr<const rpc::Agent> agent;
  std::weak_ptr<ProcessGroup> group;
};
std::mutex g_named_mu;
std::map<std::pair<const rpc::Agent*, std::string>, Named> g_named;

}  // namespace

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kProduct:
      return "product";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(ProcessGroupOptions o) {
  if (o.backend != "gloo" && o.backend != "nccl") {
    throw std::invalid_argument("unknown process group backend '" + o.backend + "' (gloo or nccl)");
  }
#if !defined(TANDEM_WITH_GLOO)
  if (o.backend == "gloo") {
    throw std::invalid_argument(
        "backend 'gloo' was left out of this build: its LibTorch ships no Gloo headers "
        "(PyTorch's wheels do not; use 'nccl' for CUDA tensors)");
  }
#endif
#if !defined(TANDEM_WITH_NCCL)
  if (o.backend == "nccl") {
    throw std::invalid_argument(
        "backend 'nccl' needs a LibTorch built with CUDA and NCCL; this build has neither "
        "(use 'gloo' for CPU tensors)");
  }
#endif
  if (o.timeout.count() <= 0) throw std::invalid_argument("process group timeout must be > 0");
  const rpc::WorldEnv env = rpc::world_from_env();
  const auto [rank, size] = rpc::rank_and_size(o.rank, o.world_size, env, "ProcessGroupOptions");
  std::string master_host;
  c10::intrusive_ptr<c10d::Store> store = o.store;
  if (!store) {
    auto [host, port] = rpc::master_from_init_method(o.init_method);
    master_host = host;
    // The job's rank 0 hosts the store (for a group of some ranks only, the
    // group's rank 0 may be another process); without a job rank, the group's.
    const int store_rank = env.rank >= 0 ? env.rank : rank;
    store = rpc::make_store(host, port, store_rank, size, o.timeout);
  } else if (o.init_method.rfind("tcp://", 0) == 0) {
    master_host = rpc::master_from_init_method(o.init_method).first;
  } else {
    master_host = env.master_addr;  // empty without one: loopback
  }
  std::string name = o.group_name.empty() ? "default" : o.group_name;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("tandem/pg/" + name, store);

  ignore_sigpipe_once();
  std::shared_ptr<ProcessGroup> pg(new ProcessGroup());
  pg->store_ = prefixed;
  pg->rank_ = rank;
  pg->size_ = size;
  pg->backend_ = o.backend;
  pg->timeout_ = o.timeout;
  try {
    if (o.backend == "gloo") {
#if defined(TANDEM_WITH_GLOO)
      auto opts = c10d::ProcessGroupGloo::Options::create(o.timeout);
      opts->devices.push_back(gloo_device(master_host));
      pg->pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, opts);
#endif
    } else {
#if defined(TANDEM_WITH_NCCL)
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = o.timeout;
      pg->pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, opts);
#endif
    }
    pg->peers_ = meet_peers(*prefixed, rank, size, o.member_name);
    pg->peers_->also_stalled = o.stalled;
    pg->watch_peers();
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError("process group '" + name + "' (" + o.backend + ", rank " +
                          std::to_string(rank) + " of " + std::to_string(size) +
                          ") could not meet its peers within " + ms_text(o.timeout) + ": " +
                          e.what());
  }
  return pg;
}


const std::vector<ProcessGroup::Member>& ProcessGroup::members() const { return peers_->members; }
std::string ProcessGroup::describe(int r) const { return peers_->describe(r); }

ProcessGroup::~ProcessGroup() {
  if (peers_ && peers_->stalled_out) {
    // Gloo's threads still wait on the stalled member (until the group's
    // timeout, or until the member's connections close) and its destructor
    // would join them: the engine is destroyed on a thread of its own
    // instead, so that this one goes on at once; it ends with the
    // collective it waits for (or with the process).
    std::thread([pg = std::move(pg_)]() mutable { pg.reset(); }).detach();
    return;
  }
  // Destroyed while an exception unwinds the stack: this rank failed, and
  // its peers will learn it from their own collectives.
  if (std::uncaught_exceptions() > 0) broken_->store(true);
  wait_for_peers_to_close();
#if defined(TANDEM_WITH_NCCL) && TORCH_VERSION_MAJOR >= 2
  // NCCL's communicators keep their threads, sockets and device handles
  // until the group is shut down (PyTorch's destroy_process_group); gloo's
  // end with the group.
  if (auto* nccl = dynamic_cast<c10d::ProcessGroupNCCL*>(pg_.get())) {
    try {
      nccl->shutdown();
    } catch (const std::exception&) {
      // (a communicator that failed: nothing more to end)
    }
  }
#endif
}

void ProcessGroup::wait_for_peers_to_close() {
  if (size_ < 2 || !store_ || !pg_) return;  // (a group that never met: nothing to close)
  // Every rank counts itself in; a healthy one waits until the whole group
  // has (each incarnation of a group name adds `size` to the count).
  try {
    const int64_t mine = store_->add("closing", 1);
    if (broken_->load()) return;
    const int64_t all = (mine + size_ - 1) / size_ * size_;
    const auto deadline = std::chrono::steady_clock::now() +
                          std::min<std::chrono::milliseconds>(timeout_, std::chrono::seconds(10));
    // A peer on this host whose process has exited, or one found stalled,
    // will never close it: looked for every 100 ms.
    auto next_look = std::chrono::steady_clock::now();
    while (store_->add("closing", 0) < all && std::chrono::steady_clock::now() < deadline) {
      if (peers_ && std::chrono::steady_clock::now() >= next_look) {
        for (int r = 0; r < size_; ++r) {
          if (r != rank_ && peers_->exited(r)) return;
        }
        if (!peers_->stalled().empty()) return;
        next_look = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  } catch (...) {
    // The store is gone (its host exited): nobody is left to wait for.
  }
}

void ProcessGroup::check_tensor(const at::Tensor& t, const char* what) const {
  if (!t.defined()) throw std::invalid_argument(std::string(what) + ": the tensor is undefined");
  if (!t.is_contiguous()) {
    throw std::invalid_argument(std::string(what) + ": the tensor must be contiguous");
  }
  if (backend_ == "gloo" && !t.device().is_cpu()) {
    throw std::invalid_argument(std::string(what) + ": the gloo group takes CPU tensors, not " +
                                t.device().str());
  }
  if (backend_ == "nccl" && !t.device().is_cuda()) {
    throw std::invalid_argument(std::string(what) + ": the nccl group takes CUDA tensors, not " +
                                t.device().str());
  }
}

ProcessGroup::Pending ProcessGroup::pending(c10::intrusive_ptr<c10d::Work> work,
                                            const std::string& what,
                                            std::chrono::milliseconds timeout) const {
  Pending p;
  p.work_ = std::move(work);
  p.what_ = what + " on rank " + std::to_string(rank_) + " of " + std::to_string(size_);
  p.timeout_ = resolve(timeout);
  p.broken_ = broken_;
  p.peers_ = peers_;
  return p;
}

void ProcessGroup::all_reduce(at::Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout) {
  all_reduce_async(tensor, op, timeout).wait();
  if (op == ReduceOp::kAvg) tensor.div_(size_);
}

ProcessGroup::Pending ProcessGroup::all_reduce_async(at::Tensor& tensor, ReduceOp op,
                                                     std::chrono::milliseconds timeout) {
  check_tensor(tensor, "all_reduce");
  if (op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())) {
    throw std::invalid_argument("all_reduce: avg needs a floating-point tensor, not " +
                                std::string(c10::toString(tensor.scalar_type())));
  }
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d_op(op);
  opts.timeout = resolve(timeout);
  return pending(pg_->allreduce(ts, opts), std::string("all_reduce(") + to_string(op) + ")",
                 timeout);
}

void ProcessGroup::broadcast(at::Tensor& tensor, int src, std::chrono::milliseconds timeout) {
  broadcast_async(tensor, src, timeout).wait();
}

ProcessGroup::Pending ProcessGroup::broadcast_async(at::Tensor& tensor, int src,
                                                    std::chrono::milliseconds timeout) {
  check_tensor(tensor, "broadcast");
  if (src < 0 || src >= size_) {
    throw std::invalid_argument("broadcast: source rank " + std::to_string(src) +
                                " is not in [0, " + std::to_string(size_) + ")");
  }
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  opts.timeout = resolve(timeout);
  return pending(pg_->broadcast(ts, opts), "broadcast from rank " + std::to_string(src), timeout);
}

std::vector<at::Tensor> ProcessGroup::all_gather(const at::Tensor& tensor,
                                                 std::chrono::milliseconds timeout) {
  check_tensor(tensor, "all_gather");
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < size_; ++r) out[0].push_back(at::empty_like(tensor));
  std::vector<at::Tensor> in{tensor};
  c10d::AllgatherOptions opts;
  opts.timeout = resolve(timeout);
  pending(pg_->allgather(out, in, opts), "all_gather", timeout).wait();
  return out[0];
}

void ProcessGroup::barrier(std::chrono::milliseconds timeout) {
  c10d::BarrierOptions opts;
  opts.timeout = resolve(timeout);
  pending(pg_->barrier(opts), "barrier", timeout).wait();
}

bool ProcessGroup::Pending::on_completion(std::function<void()> fn) {
  if (!work_) return false;
  try {
    work_->getFuture()->addCallback([fn = std::move(fn)](c10::ivalue::Future&) { fn(); });
    return true;
  } catch (const std::exception&) {
    return false;  // this backend's work has no future
  }
}

bool ProcessGroup::Pending::done() const {
  if (!work_) return false;
  // A member found stalled: wait() throws at once.
  if (peers_ && peers_->watched() && !peers_->stalled().empty()) return true;
  // The future is what on_completion's callbacks hang on; the work's own
  // flag is set a moment after them.
  try {
    return work_->getFuture()->completed();
  } catch (const std::exception&) {
    return work_->isCompleted();  // this backend's work has no future
  }
}

void ProcessGroup::Pending::abandon() {
  if (broken_) broken_->store(true);
  work_.reset();
}

void ProcessGroup::Pending::wait(std::chrono::milliseconds timeout) {
  if (!work_) throw std::logic_error("wait on an empty or finished ProcessGroup::Pending");
  auto work = std::move(work_);
  auto then = std::move(then_);
  const auto limit = timeout.count() < 0 ? timeout_ : timeout;
  auto rest = limit;  // what is left of it for Work::wait
  const auto t0 = std::chrono::steady_clock::now();
  try {
    if (peers_ && peers_->watched()) {
      auto peers = peers_;
      std::string stalled = peers->stalled();
      if (stalled.empty()) stalled = wait_watching(*work, [peers] { return peers->stalled(); }, limit);
      if (!stalled.empty()) {
        if (broken_) broken_->store(true);
        peers_->stalled_out = true;
        throw CollectiveError(what_ + " failed: " + stalled);
      }
      // (ended, or out of time: the rest of the limit, at least a moment)
      rest = std::max(std::chrono::milliseconds(1),
                      limit - std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::steady_clock::now() - t0));
    }
    work->wait(rest);
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    if (broken_) broken_->store(true);
    std::string msg = e.what();
    // c10d's text carries a C++ stack trace on some builds: keep its first line.
    if (auto nl = msg.find('\n'); nl != std::string::npos) msg.resize(nl);
    // A timeout is said as one; a broken connection is not (Gloo reports it
    // at once, long before any timeout).
    const bool timed_out =
        std::chrono::steady_clock::now() - t0 >= limit * 9 / 10 ||
        msg.find("imed out") != std::string::npos ||
        msg.find("imeout") != std::string::npos;  // Gloo: "timeout caused pair closure"
    std::string why = what_ + " failed";
    if (timed_out) why += " (timeout " + ms_text(limit) + ")";
    if (peers_) {
      if (std::string gone = peers_->gone(); !gone.empty()) why += ": " + gone;
    }
    throw CollectiveError(why + ": " + msg);
  }
  if (then) then();
}

// ---- the default group --------------------------------------------------------------

void init_process_group(ProcessGroupOptions options) {
  {
    std::lock_guard<std::mutex> lock(g_default_mu);
    if (g_default) {
      throw std::logic_error(
          "init_process_group: the default group exists already (destroy_process_group first)");
    }
  }
  auto pg = ProcessGroup::create(std::move(options));
  std::lock_guard<std::mutex> lock(g_default_mu);
  if (g_default) throw std::logic_error("init_process_group: the default group exists already");
  g_default = std::move(pg);
}

void init_process_group(const std::string& backend, const std::string& init_method, int world_size,
                        int rank, std::chrono::milliseconds timeout) {
  ProcessGroupOptions o;
  o.backend = backend;
  o.init_method = init_method;
  o.world_size = world_size;
  o.rank = rank;
  o.timeout = timeout;
  init_process_group(std::move(o));
}

void destroy_process_group() {
  std::shared_ptr<ProcessGroup> pg;
  {
    std::lock_guard<std::mutex> lock(g_default_mu);
    pg = std::move(g_default);
  }
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_default_mu);
  return g_default != nullptr;
}

std::shared_ptr<ProcessGroup> default_group_ptr() {
  std::lock_guard<std::mutex> lock(g_default_mu);
  if (!g_default) {
    throw std::logic_error("no default process group: call ddp::init_process_group first");
  }
  return g_default;
}

ProcessGroup& default_group() { return *default_group_ptr(); }
int get_rank() { return default_group().rank(); }
int get_world_size() { return default_group().size(); }

void all_reduce(at::Tensor& tensor, ReduceOp op, std::chrono::milliseconds timeout) {
  default_group_ptr()->all_reduce(tensor, op, timeout);
}
void broadcast(at::Tensor& tensor, int src, std::chrono::milliseconds timeout) {
  default_group_ptr()->broadcast(tensor, src, timeout);
}
std::vector<at::Tensor> all_gather(const at::Tensor& tensor, std::chrono::milliseconds timeout) {
  return default_group_ptr()->all_gather(tensor, timeout);
}
void barrier(std::chrono::milliseconds timeout) { default_group_ptr()->barrier(timeout); }

// ---- groups by name ----------------------------------------------------------------

void register_group(const rpc::Agent& agent, const std::string& name,
                    const std::shared_ptr<ProcessGroup>& group) {
  std::lock_guard<std::mutex> lock(g_named_mu);
  for (auto it = g_named.begin(); it != g_named.end();) {  // the dead ones go
    it = it->second.group.expired() || it->second.agent.expired() ? g_named.erase(it) : ++it;
  }
  g_named[{&agent, name}] = Named{agent.weak_from_this(), group};
}

void unregister_group(const rpc::Agent& agent, const std::string& name) {
  std::lock_guard<std::mutex> lock(g_named_mu);
  g_named.erase({&agent, name});
}

std::shared_ptr<ProcessGroup> find_group(const rpc::Agent& agent, const std::string& name) {
  std::lock_guard<std::mutex> lock(g_named_mu);
  auto it = g_named.find({&agent, name});
  if (it == g_named.end() || it->second.agent.lock().get() != &agent) return nullptr;
  return it->second.group.lock();
}

}  // namespace tandem::ddp
