// A local job for tests and benchmarks: this program started again as a
// worker process, and the loopback TCPStore its workers meet at.
//
// Shared by tests/ and bench/ (header-only, no doctest, not installed):
//  1. The parent hosts a store (store_server(), port 0: a free one) or picks
//     a free port for rank 0 to host it (free_port()).
//  2. spawn_self(worker_env(rank, world, port) + its own variables) starts
//     this executable again; the child sees that it is a worker from those
//     variables and meets the parent at the store.
//  3. wait_exit(pid) reaps it.
#pragma once

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace tandem::support {

constexpr const char* kLoopback = "127.0.0.1";

// Path of the running executable.
inline std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot find my own executable");
  return std::string(buf, static_cast<size_t>(n));
}

// Starts this executable again (no arguments) with this process's
// environment, where each "KEY=value" of `env` replaces or adds KEY.
inline pid_t spawn_self(const std::vector<std::string>& env) {
  auto key_of = [](const std::string& kv) { return kv.substr(0, kv.find('=')); };
  std::vector<std::string> all;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    bool replaced = false;
    for (const auto& x : env) replaced = replaced || key_of(x) == key_of(kv);
    if (!replaced) all.push_back(std::move(kv));
  }
  all.insert(all.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& s : all) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = self_exe();
  char* argv[] = {exe.data(), nullptr};
  pid_t pid = -1;
  if (::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()) != 0) {
    throw std::runtime_error("cannot start " + exe);
  }
  return pid;
}

// Waits for `pid` to end; returns its waitpid status.
inline int wait_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// The torchrun variables that make a spawned program worker `rank` of
// `world_size`, meeting at the store on this host's `master_port`.
inline std::vector<std::string> worker_env(int rank, int world_size, int master_port) {
  return {"RANK=" + std::to_string(rank), "WORLD_SIZE=" + std::to_string(world_size),
          std::string("MASTER_ADDR=") + kLoopback, "MASTER_PORT=" + std::to_string(master_port)};
}

// A store hosted here on loopback; port 0 picks a free one (getPort()).
inline c10::intrusive_ptr<c10d::TCPStore> store_server(
    std::chrono::milliseconds timeout = std::chrono::seconds(30), int port = 0) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = true;
  o.waitWorkers = false;
  o.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(kLoopback, o);
}

// A client of the store hosted on this host's `port`.
inline c10::intrusive_ptr<c10d::TCPStore> store_client(
    int port, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = false;
  o.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(kLoopback, o);
}

// A loopback port that was free a moment ago, for a store that someone else
// (rank 0's init(), from MASTER_PORT) will host.
inline int free_port() { return store_server()->getPort(); }

// Points MASTER_ADDR / MASTER_PORT of this process at `port` on loopback.
inline void set_master_env(int port) {
  ::setenv("MASTER_ADDR", kLoopback, 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
}

}  // namespace tandem::support
