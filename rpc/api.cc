#include "tandem/rpc/api.h"

#include "tandem/rpc/layer.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

namespace tandem::rpc {
namespace {
std::mutex g_mu;
std::shared_ptr<Agent> g_agent;

// Under tandem-run, SIGUSR1 prints the agent's debug info to stderr. The
// handler only writes a byte to a pipe; a thread reads it and prints.
int g_debug_pipe[2] = {-1, -1};
// A pointer, not a std::thread: a program that exits without shutdown()
// must not meet a joinable thread's destructor (std::terminate).
std::thread* g_debug_thread = nullptr;

void on_debug_signal(int) {
  const int saved = errno;
  const char byte = 'd';
  ssize_t ignored = ::write(g_debug_pipe[1], &byte, 1);
  (void)ignored;
  errno = saved;
}

void start_debug_signal() {  // g_mu held
  const char* launcher = std::getenv("TANDEM_LAUNCHER");
  if (!launcher || std::strcmp(launcher, "tandem-run") != 0 || g_debug_thread) return;
  if (::pipe2(g_debug_pipe, O_CLOEXEC) != 0) return;
  g_debug_thread = new std::thread([] {
    char byte;
    while (::read(g_debug_pipe[0], &byte, 1) == 1 && byte == 'd') {
      std::shared_ptr<Agent> agent;
      {
        std::lock_guard<std::mutex> lock(g_mu);
        agent = g_agent;
      }
      const std::string text = agent ? agent->debug_info() : "tandem debug info: no agent\n";
      std::fwrite(text.data(), 1, text.size(), stderr);
      std::fflush(stderr);
    }
  });
  struct sigaction action {};
  action.sa_handler = on_debug_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &action, nullptr);
}

void stop_debug_signal() {  // g_mu not held
  if (!g_debug_thread) return;
  ::signal(SIGUSR1, SIG_DFL);
  const char quit = 'q';
  ssize_t ignored = ::write(g_debug_pipe[1], &quit, 1);
  (void)ignored;
  g_debug_thread->join();
  delete g_debug_thread;
  g_debug_thread = nullptr;
  ::close(g_debug_pipe[0]);
  ::close(g_debug_pipe[1]);
  g_debug_pipe[0] = g_debug_pipe[1] = -1;
}
}  // namespace

std::shared_ptr<Agent> init(std::shared_ptr<Registry> registry, AgentOptions options) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_agent) throw std::logic_error("tandem::rpc::init: an agent is already running");
  g_agent = Agent::create(std::move(options), std::move(registry));
  start_debug_signal();
  return g_agent;
}

std::shared_ptr<Agent> current_agent() {
  if (Agent* a = handler_agent()) return a->shared_from_this();
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_agent) throw std::logic_error("tandem::rpc: no agent; call tandem::rpc::init() first");
  return g_agent;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_agent != nullptr;
}

void shutdown(bool graceful) {
  std::shared_ptr<Agent> agent;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (handler_agent() || (g_agent && layer::pool(*g_agent)->in_pool())) {
      throw std::logic_error("tandem::rpc::shutdown() cannot run inside a handler or callback");
    }
    agent = std::move(g_agent);
  }
  stop_debug_signal();
  if (agent) agent->shutdown(graceful);
}

}  // namespace tandem::rpc
