// tandem-run's labelled output: a LineForwarder reads one worker stream
// (stdout or stderr) and writes its complete lines, each prefixed with
// "[RANK]: ", to the launcher's own stream in one write, so lines of
// different workers never interleave mid-line. The Launcher polls its fds
// and calls read_some(); finish() drains an unterminated last line.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <string>

namespace tandem::launcher {

// LineForwarder: one worker stream, forwarded line by line with a prefix.

class LineForwarder {
 public:
  LineForwarder() = default;
  LineForwarder(int fd, int sink, std::string prefix)
      : fd_(fd), sink_(sink), prefix_(std::move(prefix)) {}

  int fd() const { return fd_; }
  bool is_open() const { return fd_ >= 0; }

  // Reads what is available and prints the complete lines; at end of stream, finishes.
  void read_some();
  // Prints an unterminated last line (with a newline added) and closes the pipe.
  void finish();

 private:
  void emit_complete_lines();

  int fd_ = -1;
  int sink_ = STDOUT_FILENO;
  std::string prefix_;
  std::string pending_;  // bytes not yet printed; holds no newline before scanned_
  size_t scanned_ = 0;
};

}  // namespace tandem::launcher
