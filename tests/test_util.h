// Shared set-up for Tandem's test suites; every test file includes it first.
//
// LibTorch comes first: glog's CHECK (pulled in by LibTorch) would otherwise
// replace doctest's.
//
// Every TEST_CASE ends with a leak check, done here once (LeakFixture): a
// case fails, naming what it left behind, when at its end
//  1. an agent it made is still alive (every agent is tracked from its
//     creation: track_agents() registers a tracking extension), or the
//     process-wide agent of rpc::init() is still up;
//  2. the process has more or fewer threads than when it started (threads
//     leave the kernel's bookkeeping a little after join: a bounded wait);
//  3. the process has other open file descriptors than when it started.
// And a World checks its agents before they go, in a graceful
// World::shutdown() and at the end of a case that did not shut it down: no
// agent may still hold anything for the user (user RRefs, owned RRef
// values, what the layers report: distributed autograd contexts).
// A case that fails by an exception (REQUIRE, an unexpected throw) is not
// checked: it has failed already.
//
// The check runs inside the case (TEST_CASE is TEST_CASE_FIXTURE here, at
// the bottom) so that doctest counts it: a listener's test_case_end comes
// after doctest has settled the case's result, too late to fail it.
#pragma once

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/local_job.h"
#include "tandem/rpc/agent.h"
#include "tandem/rpc/agent/testing.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/layer.h"
#include "tandem/rpc/rref_context.h"

namespace tandem::test {

// ---- waiting -------------------------------------------------------------------

// Waits until `cond` holds, at most `limit`; returns whether it held. For
// things that happen asynchronously (reference counting, a peer's clean-up,
// a thread's exit): wait for the thing, never a fixed time.
inline bool eventually(const std::function<bool()>& cond,
                       std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  auto until = std::chrono::steady_clock::now() + limit;
  while (!cond()) {
    if (std::chrono::steady_clock::now() >= until) return cond();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// ---- what this process holds ----------------------------------------------------

// Entries of a /proc directory, "." and ".." left out (and, with
// skip_own_fd, the descriptor of the listing itself).
inline std::vector<std::string> list_dir(const char* path, bool skip_own_fd = false) {
  std::vector<std::string> out;
  if (DIR* d = opendir(path)) {
    const std::string own = std::to_string(dirfd(d));
    while (dirent* e = readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == ".." || (skip_own_fd && name == own)) continue;
      out.push_back(name);
    }
    closedir(d);
  }
  return out;
}

// Thread ids of this process.
inline std::set<int> threads() {
  std::set<int> out;
  for (const auto& t : list_dir("/proc/self/task")) out.insert(std::stoi(t));
  return out;
}
inline int thread_count() { return static_cast<int>(threads().size()); }

// Open file descriptors of this process, with what each refers to.
inline std::map<int, std::string> fds() {
  std::map<int, std::string> out;
  for (const auto& f : list_dir("/proc/self/fd", true)) {
    char target[512] = {};
    std::string path = "/proc/self/fd/" + f;
    ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
    out[std::stoi(f)] = n > 0 ? std::string(target, static_cast<size_t>(n)) : "?";
  }
  return out;
}

// Every agent made in this process since track_agents() (main() calls it
// before the first test): its name, and a weak reference that expires when
// it is destroyed. Agents are tracked through a (no-op) extension, so those
// made by World, by Agent::create and by rpc::init() alike.
struct TrackedAgent {
  std::weak_ptr<rpc::Agent> agent;
  std::string name;
};
struct AgentLog {
  std::mutex mu;
  std::vector<TrackedAgent> made;
};
inline AgentLog& agent_log() {
  static AgentLog log;
  return log;
}
inline size_t agents_made() {
  std::lock_guard<std::mutex> lock(agent_log().mu);
  return agent_log().made.size();
}
// Names of the agents made since the `since`-th that are still alive.
inline std::vector<std::string> agents_alive(size_t since) {
  std::lock_guard<std::mutex> lock(agent_log().mu);
  std::vector<std::string> out;
  auto& made = agent_log().made;
  for (size_t i = since; i < made.size(); ++i) {
    if (!made[i].agent.expired()) out.push_back(made[i].name);
  }
  return out;
}
inline void track_agents() {
  struct Tracker : rpc::AgentExtension {
    void before_send(rpc::Message&, int) override {}
    void after_encode(const rpc::Message&, rpc::OutFrame&, int) override {}
    void after_receive(rpc::Message&, int) override {}
  };
  static const bool registered = [] {
    auto tracker = std::make_shared<Tracker>();
    rpc::register_agent_extension([tracker](rpc::Agent& a) -> std::shared_ptr<rpc::AgentExtension> {
      std::lock_guard<std::mutex> lock(agent_log().mu);
      agent_log().made.push_back({a.weak_from_this(), a.name()});
      return tracker;
    });
    return true;
  }();
  (void)registered;
}

// What `a` still holds for the user: live user RRefs, the RRef values it
// owns, and what the layers above report (distributed autograd contexts).
inline std::vector<std::string> held_objects(rpc::Agent& a) {
  std::vector<std::string> out = a.rrefs().live_user_refs();
  if (size_t n = a.rrefs().owned_values()) {
    out.push_back(std::to_string(n) + " owned RRef value(s)");
  }
  for (const auto& e : rpc::LayerAccess::extensions(a)) {
    for (auto& l : e->live_objects()) out.push_back(std::move(l));
  }
  return out;
}

inline std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// ---- the end-of-case leak check ----------------------------------------------------

// What a case started with; check_leaks() compares the end with it.
struct Snapshot {
  size_t agents = agents_made();
  std::set<int> threads = test::threads();
  std::map<int, std::string> fds = test::fds();
};

// The snapshot of the case running now (null between cases).
inline Snapshot*& current_snapshot() {
  static Snapshot* s = nullptr;
  return s;
}

// For a case that starts something meant to live as long as the process
// (CUDA's context, driver threads and device files): runs `start`, then
// takes the case's snapshot again, so that what `start` made is not
// counted as a leak.
inline void process_lifetime(const std::function<void()>& start) {
  start();
  if (Snapshot* s = current_snapshot()) *s = Snapshot();
}

// For a case that needs a GPU: where there is none, says it is skipped and
// returns false. Else makes what CUDA keeps for the life of the process (its
// context, driver threads and device files, the autograd engine's device
// thread) outside the case's leak count, and returns true.
inline bool cuda_or_skip() {
  if (!at::hasCUDA()) {
    std::printf("skipped: no CUDA device on this machine (this test runs on GPU machines)\n");
    return false;
  }
  process_lifetime([] {
    auto t = at::ones({2}, at::TensorOptions().device(at::kCUDA)).requires_grad_();
    (t * 2).sum().backward();
  });
  return true;
}

inline std::string thread_name(int tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

inline void check_leaks(const Snapshot& start) {
  if (rpc::is_initialized()) FAIL_CHECK("leak: rpc::init() without rpc::shutdown()");
  // Agents first: an agent that is gone has given back its threads and fds.
  if (!eventually([&] { return agents_alive(start.agents).empty(); })) {
    FAIL_CHECK("leak: agents made by this case are still alive (something holds them): "
               << join(agents_alive(start.agents)));
    return;  // their threads and fds would only repeat it
  }
  const size_t want = start.threads.size();
  if (!eventually([&] { return threads().size() == want; }, std::chrono::seconds(2))) {
    std::vector<std::string> added, ended;
    auto now = threads();
    for (int t : now) {
      if (!start.threads.count(t)) added.push_back(std::to_string(t) + " " + thread_name(t));
    }
    for (int t : start.threads) {
      if (!now.count(t)) ended.push_back(std::to_string(t));
    }
    FAIL_CHECK("leak: " << now.size() << " threads at the end, " << want
                        << " at the start; new: " << join(added) << "; ended: " << join(ended));
  }
  if (!eventually([&] { return fds() == start.fds; }, std::chrono::seconds(2))) {
    std::vector<std::string> opened, closed;
    auto now = fds();
    auto differ = [](const std::map<int, std::string>& a, const std::map<int, std::string>& b) {
      std::vector<std::string> out;
      for (auto& [fd, what] : a) {
        auto it = b.find(fd);
        if (it == b.end() || it->second != what) out.push_back(std::to_string(fd) + " -> " + what);
      }
      return out;
    };
    FAIL_CHECK("leak: file descriptors left open: " << join(differ(now, start.fds))
                                                    << "; closed that were open at the start: "
                                                    << join(differ(start.fds, now)));
  }
}

// The fixture of every TEST_CASE (below): a snapshot when a run of the case
// starts (each subcase path is a run), the check when it ends. Its one
// member is visible in test bodies (they are member functions of a struct
// derived from it): hence the unlikely name.
class LeakFixture {
 public:
  LeakFixture() { current_snapshot() = &leak_fixture_start_; }
  LeakFixture(const LeakFixture&) = delete;
  LeakFixture& operator=(const LeakFixture&) = delete;
  ~LeakFixture() noexcept(false) {
    current_snapshot() = nullptr;
    if (std::uncaught_exceptions() == 0) check_leaks(leak_fixture_start_);
  }

 private:
  Snapshot leak_fixture_start_;
};

// ---- N agents in this process --------------------------------------------------------

// N agents in this process, meeting at a TCPStore on an ephemeral port.
// At the end (see the top of this file) they must hold nothing.
struct World {
  explicit World(int n, std::function<void(rpc::Registry&)> define = {},
                 std::function<void(rpc::AgentOptions&)> tweak = {})
      : store(support::store_server()), port(store->getPort()) {
    registry = std::make_shared<rpc::Registry>();
    if (define) define(*registry);
    agents.resize(n);
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(n);
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
          rpc::AgentOptions o;
          o.rank = r;
          o.world_size = n;
          o.num_worker_threads = 2;
          o.rpc_timeout = std::chrono::seconds(20);
          o.init_timeout = std::chrono::seconds(30);
          if (tweak) tweak(o);
          agents[r] = rpc::Agent::create(o, registry, support::store_client(port));
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  // Every agent shuts down at once (graceful waits for the others);
  // rethrows the first error any of them raised. A graceful shutdown first
  // checks that every agent has let go of everything (see expect_released).
  void shutdown(bool graceful = true) {
    if (graceful) expect_released();
    shutdown_unchecked(graceful);
  }

  // The same without that check: for a case about shutting down while
  // something is still alive or on its way.
  void shutdown_unchecked(bool graceful = true) {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(agents.size());
    for (size_t i = 0; i < agents.size(); ++i) {
      if (agents[i]) {
        threads.emplace_back([this, i, graceful, &errors] {
          try {
            agents[i]->shutdown(graceful);
          } catch (...) {
            errors[i] = std::current_exception();
          }
        });
      }
    }
    for (auto& t : threads) t.join();
    agents.clear();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }

  // Every agent holds nothing for the user: no user RRefs, no owned RRef
  // values, no distributed autograd contexts (held_objects). Reference
  // counting and context release are asynchronous: a bounded wait.
  void expect_released() {
    for (auto& a : agents) {
      if (a && !eventually([&] { return held_objects(*a).empty(); })) {
        FAIL_CHECK("leak: " << a->name() << " still holds: " << join(held_objects(*a)));
      }
    }
  }

  // A case that did not shut its world down: the same check, then a
  // shutdown(false). A case that stopped agents on purpose (an owner that
  // dies keeps its values) ends with w.shutdown(false): nothing is checked.
  ~World() {
    if (agents.empty()) return;
    if (std::uncaught_exceptions() == 0) expect_released();
    try {
      shutdown_unchecked(false);
    } catch (const std::exception& e) {
      FAIL_CHECK("shutting the world down: " << e.what());
    }
  }

  rpc::Agent& operator[](int r) { return *agents[r]; }

  c10::intrusive_ptr<c10d::TCPStore> store;  // the rendezvous, hosted here
  int port = 0;
  std::shared_ptr<rpc::Registry> registry;
  std::vector<std::shared_ptr<rpc::Agent>> agents;
};

// ---- traces (rpc/trace.h) ---------------------------------------------------------

// One event of a Tandem trace file, as the layers write them (one per line).
struct TraceEvent {
  std::string ph, name, cat, id;
  int pid = -1;
  long tid = -1;
  int64_t ts = -1, dur = -1;
  std::string line;  // the whole event, for args
  int64_t end() const { return ts + std::max<int64_t>(dur, 0); }
};

// The events of a trace file (a worker's or a joined one); `ok` false when
// the file is missing or not closed.
struct Trace {
  bool ok = false;
  std::vector<TraceEvent> events;
  std::vector<TraceEvent> find(const std::string& ph, const std::string& name, int pid = -1) const {
    std::vector<TraceEvent> out;
    for (const auto& e : events) {
      if (e.ph == ph && e.name == name && (pid < 0 || e.pid == pid)) out.push_back(e);
    }
    return out;
  }
  // The async spans (b/e pairs) of `name` on `pid`, as slices [ts, end), by start.
  std::vector<TraceEvent> spans(const std::string& name, int pid) const {
    std::map<std::string, TraceEvent> open;
    std::vector<TraceEvent> out;
    for (const auto& e : events) {
      if (e.name != name || e.pid != pid) continue;
      if (e.ph == "b") open[e.id] = e;
      if (e.ph == "e" && open.count(e.id)) {
        TraceEvent s = open[e.id];
        s.dur = e.ts - s.ts;
        out.push_back(s);
        open.erase(e.id);
      }
    }
    std::stable_sort(out.begin(), out.end(),
                     [](const TraceEvent& a, const TraceEvent& b) { return a.ts < b.ts; });
    return out;
  }
};

inline Trace read_trace(const std::string& path) {
  Trace t;
  std::ifstream in(path);
  if (!in) return t;
  auto str = [](const std::string& l, const std::string& key) -> std::string {
    auto at = l.find("\"" + key + "\":\"");
    if (at == std::string::npos) return "";
    at += key.size() + 4;
    return l.substr(at, l.find('"', at) - at);
  };
  auto num = [](const std::string& l, const std::string& key) -> int64_t {
    auto at = l.find("\"" + key + "\":");
    if (at == std::string::npos) return -1;
    return std::strtoll(l.c_str() + at + key.size() + 3, nullptr, 10);
  };
  std::string line;
  std::getline(in, line);
  if (line.rfind("{\"traceEvents\":[", 0) != 0) return t;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] == ']') {
      t.ok = true;
      break;
    }
    TraceEvent e;
    e.ph = str(line, "ph");
    e.name = str(line, "name");
    e.cat = str(line, "cat");
    e.id = str(line, "id");
    if (e.id.empty() && num(line, "id") >= 0) e.id = std::to_string(num(line, "id"));
    e.pid = static_cast<int>(num(line, "pid"));
    e.tid = static_cast<long>(num(line, "tid"));
    e.ts = num(line, "ts");
    e.dur = num(line, "dur");
    e.line = line;
    t.events.push_back(std::move(e));
  }
  return t;
}

// Whether python3 reads `path` as JSON (true when python3 is missing: the
// line-by-line reading above is then the only check).
inline bool valid_json(const std::string& path) {
  if (std::system("command -v python3 >/dev/null 2>&1") != 0) {
    std::printf("(python3 not installed: %s was checked line by line only)\n", path.c_str());
    return true;
  }
  return std::system(
             ("python3 -c \"import json,sys; json.load(open(sys.argv[1]))\" " + path).c_str()) == 0;
}

// A fresh directory under /tmp, removed with what is in it at the end of
// scope (without a fork: a fork's handlers stop OpenBLAS's threads, which
// the leak check would count).
struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/tandem-test-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

// ---- a worker process ------------------------------------------------------------

// A shell command's exit code (128 + signal when killed) and its output,
// stdout and stderr together.
struct RunResult {
  int status = -1;
  std::string output;
};
inline RunResult run_command(const std::string& cmd) {
  RunResult r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) r.output.append(buf, n);
  int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

// A job of `world` copies of this test binary in `mode` (see main.cc),
// started directly rather than by tandem-run (which would end the others as
// soon as one fails, before they can say how they failed), each bounded by
// `timeout 90`. Returns every rank's output, each line prefixed "[rank] ",
// and its exit code as a last line "[rank] exit <code>" (124: it hung).
inline std::string run_direct_job(const std::string& mode, int world) {
  const int port = support::free_port();
  const std::string n = std::to_string(world - 1);
  return run_command("d=$(mktemp -d); for r in $(seq 0 " + n +
                     "); do (RANK=$r WORLD_SIZE=" + std::to_string(world) +
                     " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
                     " TANDEM_TEST_WORKER=" + mode + " timeout 90 " + support::self_exe() +
                     " > $d/$r.log 2>&1; echo \"exit $?\" >> $d/$r.log) & done; wait; " +
                     "for r in $(seq 0 " + n + "); do sed \"s/^/[$r] /\" $d/$r.log; done; " +
                     "rm -rf $d")
      .output;
}

// The line of `text` that starts with `prefix` ("[0] failed"), or "".
inline std::string line_of(const std::string& text, const std::string& prefix) {
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    if (text.compare(at, prefix.size(), prefix) == 0) return text.substr(at, end - at);
    at = end + 1;
  }
  return "";
}

// What `fn` threw, or "" when it did not.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// The body of a simple worker_main(): joins the world from the environment
// (a 60 s rendezvous) with `reg`'s functions and serves until the others
// shut down, or this process dies; 0, or 2 with the error on stderr.
inline int serve(std::shared_ptr<rpc::Registry> reg) {
  try {
    rpc::AgentOptions opts;
    opts.init_timeout = std::chrono::seconds(60);
    rpc::init(std::move(reg), opts);
    rpc::shutdown(true);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker failed: %s\n", e.what());
    return 2;
  }
}

// This test binary started again as worker 1 of 2 in `mode`
// ("TANDEM_TEST_WORKER=mode" makes it a worker: see main.cc), meeting the
// test (worker 0) at `store`. The destructor kills and reaps it if the test
// did not wait for it.
struct ChildWorker {
  explicit ChildWorker(const std::string& mode)
      : store(support::store_server()), pid(support::spawn_self([&] {
          auto env = support::worker_env(1, 2, store->getPort());
          env.push_back("TANDEM_TEST_WORKER=" + mode);
          return env;
        }())) {}
  ChildWorker(const ChildWorker&) = delete;
  ChildWorker& operator=(const ChildWorker&) = delete;
  ~ChildWorker() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      wait();
    }
  }
  // The test's own agent: worker 0 of the two.
  std::shared_ptr<rpc::Agent> parent_agent(std::chrono::milliseconds rpc_timeout) {
    rpc::AgentOptions o;
    o.rank = 0;
    o.world_size = 2;
    o.rpc_timeout = rpc_timeout;
    return rpc::Agent::create(o, std::make_shared<rpc::Registry>(), store);
  }
  // Waits for the worker to end; returns its waitpid status.
  int wait() {
    int status = support::wait_exit(pid);
    pid = -1;
    return status;
  }
  // Waits for the worker and checks that it exited with `code` (the code a
  // test's "die" function gives std::_Exit).
  void expect_exit(int code) {
    const int status = wait();
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == code);
  }

  c10::intrusive_ptr<c10d::TCPStore> store;
  pid_t pid = -1;
};

}  // namespace tandem::test

// Every TEST_CASE runs in a LeakFixture (see the top of this file).
#undef TEST_CASE
#define TEST_CASE(name) TEST_CASE_FIXTURE(::tandem::test::LeakFixture, name)
