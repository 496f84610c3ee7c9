#include "tandem/ddp/process_group.h"

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

#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
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

std::string this_host() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

// Field 22 of /proc/<pid>/stat (when the process started, in clock ticks
// since boot) and its state (field 3); empty when there is no such process.
// Together with the pid, the start time tells a process from a later one
// that reused its number.
std::pair<std::string, char> proc_start_and_state(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string line;
  if (!std::getline(in, line)) return {"", 0};
  const auto close = line.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return {"", 0};
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  char state = 0;
  // After the name: state is field 3, start time field 22.
  for (int f = 3; f <= 22 && rest >> field; ++f) {
    if (f == 3) state = field.empty() ? 0 : field[0];
    if (f == 22) return {field, state};
  }
  return {"", state};
}

// What the registry keeps per (agent, name).
struct Named {
  std::weak_ptr<const rpc::Agent> agent;
  std::weak_ptr<ProcessGroup> group;
};
std::mutex g_named_mu;
std::map<std::pair<const rpc::Agent*, std::string>, Named> g_named;

}  // namespace

// Who the ranks are (published at creation under who/<incarnation>/<rank>),
// and, once a collective has failed, which of them are gone: worked out
// once per group, by the first failure, and given to every later one.
struct ProcessGroup::Peers {
  int rank = 0;
  int64_t incarnation = 0;
  std::string my_host;
  std::vector<Member> members;
  std::vector<std::string> starts;  // per rank: its process's start time, for the liveness check
  c10::intrusive_ptr<c10d::Store> store;
  std::mutex mu;
  std::optional<std::string> verdict;

  std::string key(const char* what, int r) const {
    return std::string(what) + "/" + std::to_string(incarnation) + "/" + std::to_string(r);
  }

  std::string describe(int r) const {
    std::string s = "rank " + std::to_string(r);
    if (static_cast<size_t>(r) >= members.size()) return s;
    const Member& m = members[static_cast<size_t>(r)];
    s += " (";
    if (!m.name.empty()) s += "worker \"" + m.name + "\", ";
    s += "pid " + std::to_string(m.pid) + " on " + m.host + ")";
    return s;
  }

  // A process on this host that has exited (or is a zombie, or whose
  // number now belongs to another process).
  bool exited(int r) const {
    const Member& m = members[static_cast<size_t>(r)];
    if (m.host != my_host || m.pid <= 0) return false;
    if (m.pid == static_cast<int64_t>(::getpid())) return false;  // ranks as threads of one process
    auto [start, state] = proc_start_and_state(std::to_string(m.pid));
    return start.empty() || state == 'Z' || state == 'X' || start != starts[static_cast<size_t>(r)];
  }

  // "rank 2 (worker "w2", pid 42 on h) is gone (its process exited)", or
  // what else is known; empty when every peer checked in.
  std::string gone() {
    std::lock_guard<std::mutex> lock(mu);
    if (verdict) return *verdict;
    const int n = static_cast<int>(members.size());
    std::vector<int> exited_ranks, silent;
    std::vector<bool> settled(static_cast<size_t>(n), false);
    settled[static_cast<size_t>(rank)] = true;
    for (int r = 0; r < n; ++r) {
      if (r != rank && exited(r)) {
        exited_ranks.push_back(r);
        settled[static_cast<size_t>(r)] = true;
      }
    }
    bool store_lost = false;
    try {
      store->set(key("down", rank), std::vector<uint8_t>{1});
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      for (;;) {
        bool all = true;
        for (int r = 0; r < n; ++r) {
          if (settled[static_cast<size_t>(r)]) continue;
          if (store->check({key("down", r)})) {
            settled[static_cast<size_t>(r)] = true;
          } else {
            all = false;
          }
        }
        if (all || std::chrono::steady_clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    } catch (const std::exception&) {
      store_lost = true;
    }
    if (!store_lost) {
      for (int r = 0; r < n; ++r) {
        if (!settled[static_cast<size_t>(r)]) silent.push_back(r);
      }
    }
    std::string text;
    auto add = [&](const std::string& part) { text += (text.empty() ? "" : "; ") + part; };
    for (int r : exited_ranks) add(describe(r) + " is gone (its process exited)");
    if (!silent.empty()) {
      std::string who;
      for (int r : silent) who += (who.empty() ? "" : ", ") + describe(r);
      add(who + (silent.size() == 1 ? " did" : " did") +
          " not check in within 2 s of the failure (gone, or stuck elsewhere)");
    }
    if (store_lost) {
      add("the group's store cannot be reached (its host, the job's rank 0, may be gone)");
    }
    verdict = text;
    return text;
  }
};
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

std::shared_ptr<ProcessGroup::Peers> ProcessGroup::meet_peers(c10d::Store& store, int rank,
                                                              int size, std::string name) {
  auto peers = std::make_shared<Peers>();
  peers->rank = rank;
  peers->my_host = this_host();
  peers->store = c10::intrusive_ptr<c10d::Store>::reclaim_copy(&store);
  // Each incarnation of a group name adds `size`: every rank adds once
  // before any waits on the others, so all agree on the incarnation.
  peers->incarnation = (store.add("incarnations", 1) - 1) / size;
  if (name.empty()) {
    try {
      name = rpc::current_agent()->name();
    } catch (const std::logic_error&) {
      // no agent in this process: the rank alone names it
    }
  }
  const std::string pid = std::to_string(::getpid());
  const std::string me =
      name + "\n" + peers->my_host + "\n" + pid + "\n" + proc_start_and_state(pid).first;
  store.set(peers->key("who", rank), std::vector<uint8_t>(me.begin(), me.end()));
  for (int r = 0; r < size; ++r) {
    const auto bytes = store.get(peers->key("who", r));
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    Member m;
    std::string pid_text, start;
    std::getline(in, m.name);
    std::getline(in, m.host);
    std::getline(in, pid_text);
    std::getline(in, start);
    m.pid = std::strtoll(pid_text.c_str(), nullptr, 10);
    peers->members.push_back(std::move(m));
    peers->starts.push_back(std::move(start));
  }
  return peers;
}

const std::vector<ProcessGroup::Member>& ProcessGroup::members() const { return peers_->members; }
std::string ProcessGroup::describe(int r) const { return peers_->describe(r); }

ProcessGroup::~ProcessGroup() {
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
    // A peer on this host whose process has exited will never close it:
    // looked for every 100 ms.
    auto next_look = std::chrono::steady_clock::now();
    while (store_->add("closing", 0) < all && std::chrono::steady_clock::now() < deadline) {
      if (peers_ && std::chrono::steady_clock::now() >= next_look) {
        for (int r = 0; r < size_; ++r) {
          if (r != rank_ && peers_->exited(r)) return;
        }
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
  auto limit = timeout.count() < 0 ? timeout_ : timeout;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    work->wait(limit);
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
