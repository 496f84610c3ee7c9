// The signal self-pipe (launcher/run/signals.h).
#include "launcher/run/signals.h"

#include <unistd.h>

#include <cerrno>
#include <stdexcept>
#include <string>

#include "launcher/run/io.h"

namespace tandem::launcher {

namespace {

int signal_pipe_write_end = -1;

constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

void on_signal(int signal_number) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal_number);
  ssize_t ignored = ::write(signal_pipe_write_end, &byte, 1);  // full pipe: a wakeup is pending
  (void)ignored;
  errno = saved_errno;
}

}  // namespace

int install_signal_pipe() {
  int ends[2];
  if (!make_pipe(ends, /*nonblocking_write=*/true)) {
    throw std::runtime_error("cannot create signal pipe: " + errno_text(errno));
  }
  signal_pipe_write_end = ends[1];
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  for (int signal_number : kHandledSignals) {
    action.sa_flags = signal_number == SIGCHLD ? SA_RESTART | SA_NOCLDSTOP : SA_RESTART;
    ::sigaction(signal_number, &action, nullptr);
  }
  ::signal(SIGPIPE, SIG_IGN);  // a closed stdout must not kill the supervisor
  return ends[0];
}

sigset_t handled_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int signal_number : kHandledSignals) sigaddset(&set, signal_number);
  return set;
}

void reset_child_signals() {
  for (int signal_number : kHandledSignals) ::signal(signal_number, SIG_DFL);
  ::signal(SIGPIPE, SIG_DFL);
  sigset_t empty;
  sigemptyset(&empty);
  ::sigprocmask(SIG_SETMASK, &empty, nullptr);
}

}  // namespace tandem::launcher
