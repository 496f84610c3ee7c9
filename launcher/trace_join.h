// Joining trace files (rpc/trace.h) into one timeline: tandem-run joins its
// node's workers, `tandem-trace merge` the files of several nodes. Each file
// holds one event per line between its first line and the line that starts
// with "]" (a worker's file and a joined file alike), and its clock is rank
// 0's already, so joining is concatenation: each worker stays a process of
// its own (pid = rank). Plain C++ and POSIX, like tandem-run.
#pragma once

#include <string>
#include <vector>

namespace tandem::launcher {

struct TraceJoin {
  int files = 0;                     // joined
  size_t events = 0;                 // lines taken
  std::vector<std::string> skipped;  // "PATH: why", for each file not taken
};

// Joins `inputs` (files; a directory stands for its tandem-trace-rank*.json,
// in rank order) into `out`. Throws std::runtime_error when `out` cannot be
// written or no input holds a trace.
TraceJoin join_traces(const std::vector<std::string>& inputs, const std::string& out);

}  // namespace tandem::launcher
