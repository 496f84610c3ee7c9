// tandem-run's signals: SIGINT, SIGTERM and SIGCHLD reach the launcher as
// bytes on a self-pipe, which the Launcher's poll loop
// (launcher/run/supervise.cc) reads and acts on; the handler only writes, so
// it stays async-signal-safe. A worker blocks them across fork and resets
// them before exec (launcher/run/start.cc).
#pragma once

#include <signal.h>

namespace tandem::launcher {

// Returns the read end of the self-pipe.
int install_signal_pipe();
// The signals the launcher handles, to block across fork.
sigset_t handled_signal_set();
// In a freshly forked worker: default dispositions and an empty mask, as a program expects.
void reset_child_signals();

}  // namespace tandem::launcher
