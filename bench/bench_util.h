// Helpers shared by the benchmark programs: percentiles and command-line
// flags. The second process a benchmark talks to on loopback is started
// with tests/support/local_job.h, as the tests start theirs.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/rpc/api.h"
#include "tests/support/local_job.h"

namespace tandem::bench {

// Starts this program again as worker 1 of 2 with TANDEM_BENCH_ROLE=`role`,
// meeting this process (worker 0, whose init() hosts the store) at a free
// port it puts in MASTER_PORT; returns the child's pid.
inline pid_t spawn_peer(const std::string& role) {
  const int port = support::free_port();
  support::set_master_env(port);
  auto env = support::worker_env(1, 2, port);
  env.push_back("TANDEM_BENCH_ROLE=" + role);
  return support::spawn_self(env);
}

// In the process spawn_peer started (TANDEM_BENCH_ROLE=`role`): joins as
// worker 1 of 2 with `options`, serves until worker 0 shuts down, and
// returns the exit code; -1 in the first process (no role), 2 for another role.
inline int serve_as_peer(const std::string& role, rpc::AgentOptions options) {
  const char* mine = std::getenv("TANDEM_BENCH_ROLE");
  if (mine == nullptr) return -1;
  const bool known = role == mine;
  unsetenv("TANDEM_BENCH_ROLE");
  if (!known) return 2;
  rpc::init(std::make_shared<rpc::Registry>(), options);
  rpc::shutdown(true);
  return 0;
}

// What carries `agent`'s calls to `peer` ("tcp" or "shm"), once a call
// (to no function: its refusal is expected) opened the connection: a bench
// line says which transport it measured.
inline std::string transport_to(rpc::Agent& agent, const std::string& peer) {
  try {
    agent.call(peer, "bench.no_such_function", {}).wait();
  } catch (const std::exception&) {
  }
  return agent.transport_to(peer);
}

inline double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

// Milliseconds since `t0` on the steady clock.
inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// "1,2,4" -> {"1", "2", "4"}.
inline std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Command-line flags of the form `--name value`, each bound to a variable
// that holds its default:
//
//   int rounds = 5;
//   std::vector<int64_t> sizes = {0, 1024};
//   Flags flags("rpc_bench");
//   flags.add("--sizes", &sizes, 0).add("--rounds", &rounds, 1);
//   if (!flags.parse(argc, argv)) return 2;
class Flags {
 public:
  explicit Flags(std::string program) : program_(std::move(program)) {}

  // An integer of at least `min`.
  Flags& add(const std::string& name, int* value, int min) {
    flags_.push_back({name, std::to_string(*value), [=](const std::string& s) {
                        int64_t v = to_int(s);
                        if (v < min || v > std::numeric_limits<int>::max())
                          throw std::invalid_argument("out of range");
                        *value = static_cast<int>(v);
                      }});
    return *this;
  }

  // Any non-empty text (a path).
  Flags& add(const std::string& name, std::string* value) {
    flags_.push_back({name, *value, [=](const std::string& s) {
                        if (s.empty()) throw std::invalid_argument("empty");
                        *value = s;
                      }});
    return *this;
  }

  // A comma-separated, non-empty list of integers, each at least `min`: "1,4,16".
  Flags& add(const std::string& name, std::vector<int64_t>* values, int64_t min) {
    std::string def;
    for (int64_t v : *values) def += (def.empty() ? "" : ",") + std::to_string(v);
    flags_.push_back({name, def, [=](const std::string& s) {
                        std::vector<int64_t> out;
                        std::stringstream in(s);
                        std::string item;
                        while (std::getline(in, item, ',')) {
                          out.push_back(to_int(item));
                          if (out.back() < min) throw std::invalid_argument("out of range");
                        }
                        if (out.empty()) throw std::invalid_argument("empty list");
                        *values = std::move(out);
                      }});
    return *this;
  }

  // Sets the variables from argv. On an unknown flag, a missing value or a
  // bad one, prints what is wrong and the usage to stderr; returns false.
  bool parse(int argc, char** argv) const {
    for (int i = 1; i < argc; ++i) {
      const std::string name = argv[i];
      auto f =
          std::find_if(flags_.begin(), flags_.end(), [&](const Flag& x) { return x.name == name; });
      if (f == flags_.end()) return fail("unknown argument '" + name + "'");
      if (i + 1 == argc) return fail(name + " needs a value");
      try {
        f->set(argv[++i]);
      } catch (const std::exception&) {
        return fail("bad value '" + std::string(argv[i]) + "' for " + name);
      }
    }
    return true;
  }

 private:
  struct Flag {
    std::string name;
    std::string default_value;
    std::function<void(const std::string&)> set;
  };

  static int64_t to_int(const std::string& s) {
    size_t used = 0;
    int64_t v = std::stoll(s, &used);
    if (used != s.size()) throw std::invalid_argument("not an integer");
    return v;
  }

  bool fail(const std::string& why) const {
    std::string usage = "usage: " + program_;
    for (const auto& f : flags_) usage += " [" + f.name + " " + f.default_value + "]";
    std::fprintf(stderr, "%s: %s\n%s\n", program_.c_str(), why.c_str(), usage.c_str());
    return false;
  }

  std::string program_;
  std::vector<Flag> flags_;
};

// The folder this program lives in (the launcher and the examples that
// restart_bench and ft_bench run are built beside it).
inline std::string self_dir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string p(buf, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/'));
}

// The pid of a live process named `comm` whose environment holds every one
// of `vars` ("NAME=value"); -1 when there is none.
inline pid_t find_process(const std::string& comm, const std::vector<std::string>& vars) {
  DIR* proc = ::opendir("/proc");
  if (!proc) return -1;
  pid_t found = -1;
  while (dirent* e = ::readdir(proc)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
    if (pid <= 0) continue;
    std::ifstream in(std::string("/proc/") + e->d_name + "/environ", std::ios::binary);
    std::string env((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const bool all = std::all_of(vars.begin(), vars.end(), [&](const std::string& v) {
      return env.find(std::string(1, '\0') + v + '\0') != std::string::npos ||
             env.rfind(v + '\0', 0) == 0;
    });
    if (!all) continue;
    std::ifstream name_file(std::string("/proc/") + e->d_name + "/comm");
    std::string name;
    std::getline(name_file, name);
    if (name == comm) {
      found = pid;
      break;
    }
  }
  ::closedir(proc);
  return found;
}

}  // namespace tandem::bench
