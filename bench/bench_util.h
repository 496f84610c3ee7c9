// Helpers shared by the benchmark programs: percentiles, and a second
// process of the same program to talk to on loopback.
#pragma once

#include <spawn.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <sstream>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace tandem::bench {

inline double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Starts this program again with the environment plus `extra_env`.
inline pid_t spawn_self(const std::vector<std::string>& extra_env) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  env.insert(env.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) throw std::runtime_error("cannot find my own executable");
  exe[n] = '\0';
  char* argv[] = {exe, nullptr};
  pid_t pid = -1;
  if (::posix_spawn(&pid, exe, nullptr, nullptr, argv, envp.data()) != 0) {
    throw std::runtime_error("cannot start the callee process");
  }
  return pid;
}

// "1,4,16" -> {1, 4, 16}.
inline std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoll(item));
  return out;
}

// Points MASTER_ADDR / MASTER_PORT at a free loopback port, where rank 0
// will host the rendezvous store.
inline void set_free_master() {
  int port;
  {
    c10d::TCPStoreOptions so;
    so.port = 0;
    so.isServer = true;
    port = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so)->getPort();
  }
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
}

}  // namespace tandem::bench
