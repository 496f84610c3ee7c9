// tandem-run's plain POSIX helpers: whole writes to a descriptor (and the
// launcher's own "tandem-run: " messages), standard descriptors that exist,
// a free port, and close-on-exec pipes. Every other piece of launcher/run/
// writes and reports through these; they know nothing of workers.
#pragma once

#include <cstddef>
#include <string>

namespace tandem::launcher {

// Writes everything, retrying on EINTR and short writes. Output whose reader went away
// (EPIPE) is dropped: the launcher keeps supervising its workers.
void write_all(int fd, const char* data, size_t size);
void write_all(int fd, const std::string& text);
// "tandem-run: MESSAGE" on stderr.
void report(const std::string& message);
std::string errno_text(int error);

// Makes sure fds 0-2 exist, so pipes created later never land on them.
void ensure_standard_fds_open();
// Binds 127.0.0.1:0, reads the port the kernel chose, and releases it.
int pick_free_port();
// A pipe whose ends are close-on-exec; the read end is non-blocking. Returns false on failure.
bool make_pipe(int ends[2], bool nonblocking_write);

}  // namespace tandem::launcher
