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
#include <system_error>
#include <thread>

namespace tandem::rpc {
namespace {
std::mutex g_mu;
std::shared_ptr<Agent> g_agent;

// Under tandem-run, SIGUSR1 prints the agent's debug info to stderr. The
// handler only writes a byte to a pipe; a thread reads it and prints. It
// answers for the agent's whole life, a graceful shutdown's long wait
// included (a pipeline's stage workers spend their run there): the agent
// it prints stays in g_debug_agent until shutdown() has returned, and only
// then does the signal get its previous disposition back.
// Starting and stopping it take g_signal_mu (never under g_mu), so that
// they happen one at a time.
std::mutex g_signal_mu;
int g_debug_pipe[2] = {-1, -1};
std::shared_ptr<Agent> g_debug_agent;  // under g_mu: what the signal prints
struct sigaction g_previous_action {};
// A pointer, not a std::thread: a program that exits without shutdown()
// must not meet a joinable thread's destructor (std::terminate).
std::thread* g_debug_thread = nullptr;  // under g_signal_mu

void on_debug_signal(int) {
  const int saved = errno;
  const char byte = 'd';
  ssize_t ignored = ::write(g_debug_pipe[1], &byte, 1);
  (void)ignored;
  errno = saved;
}

void start_debug_signal() {  // g_mu not held
  std::lock_guard<std::mutex> serial(g_signal_mu);
  const char* launcher = std::getenv("TANDEM_LAUNCHER");
  if (!launcher || std::strcmp(launcher, "tandem-run") != 0 || g_debug_thread) return;
  if (::pipe2(g_debug_pipe, O_CLOEXEC) != 0) return;
  g_debug_thread = new std::thread([] {
    char byte;
    while (::read(g_debug_pipe[0], &byte, 1) == 1 && byte == 'd') {
      std::shared_ptr<Agent> agent;
      {
        std::lock_guard<std::mutex> lock(g_mu);
        agent = g_debug_agent;
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
  ::sigaction(SIGUSR1, &action, &g_previous_action);
}

// Once no agent is left to print (none running, none shutting down).
void stop_debug_signal_if_unused() {  // g_mu not held
  std::lock_guard<std::mutex> serial(g_signal_mu);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_agent || g_debug_agent) return;
  }
  if (!g_debug_thread) return;
  ::sigaction(SIGUSR1, &g_previous_action, nullptr);
  const char quit = 'q';
  ssize_t ignored = ::write(g_debug_pipe[1], &quit, 1);
  (void)ignored;
  try {
    g_debug_thread->join();
  } catch (const std::system_error&) {
    // (nothing to join: it ended already)
  }
  delete g_debug_thread;
  g_debug_thread = nullptr;
  ::close(g_debug_pipe[0]);
  ::close(g_debug_pipe[1]);
  g_debug_pipe[0] = g_debug_pipe[1] = -1;
}
}  // namespace

std::shared_ptr<Agent> init(std::shared_ptr<Registry> registry, AgentOptions options) {
  std::shared_ptr<Agent> agent;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_agent) throw std::logic_error("tandem::rpc::init: an agent is already running");
    g_agent = Agent::create(std::move(options), std::move(registry));
    g_debug_agent = agent = g_agent;
  }
  start_debug_signal();
  return agent;
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
  // The debug signal keeps printing this agent while it shuts down, and is
  // given back once it is gone, whether its shutdown worked or threw.
  struct AfterShutdown {
    const std::shared_ptr<Agent>& agent;
    ~AfterShutdown() {
      if (agent) {
        std::lock_guard<std::mutex> lock(g_mu);
        if (g_debug_agent == agent) g_debug_agent.reset();
      }
      // (an init() meanwhile, or another shutdown still going, keeps it)
      stop_debug_signal_if_unused();
    }
  } after{agent};
  if (agent) agent->shutdown(graceful);
}

}  // namespace tandem::rpc
