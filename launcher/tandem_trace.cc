// tandem-trace merge OUT INPUT...: joins trace files (rpc/trace.h) into one
// timeline. An INPUT is a trace file (a worker's, or one tandem-run joined)
// or a directory standing for the worker files in it. For a job on several
// nodes: copy each node's --trace directory here and merge them.
//
// Exit status: 0 when joined (files that are not traces are named on stderr
// and left out), 1 when nothing could be joined or OUT not written, 2 for
// bad arguments.
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "launcher/trace_join.h"

int main(int argc, char** argv) {
  const char* usage =
      "usage: tandem-trace merge OUT INPUT...\n"
      "  joins Tandem trace files into OUT; an INPUT is a trace file or a directory\n"
      "  (its tandem-trace-rank*.json). Open OUT in ui.perfetto.dev or chrome://tracing.\n";
  if (argc == 2 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::fputs(usage, stdout);
    return 0;
  }
  if (argc < 4 || std::strcmp(argv[1], "merge") != 0) {
    std::fprintf(stderr, "tandem-trace: %s\n%s",
                 argc < 2 ? "no command given"
                 : std::strcmp(argv[1], "merge") != 0
                     ? ("unknown command '" + std::string(argv[1]) + "'").c_str()
                     : "merge needs OUT and at least one INPUT",
                 usage);
    return 2;
  }
  std::vector<std::string> inputs(argv + 3, argv + argc);
  try {
    auto r = tandem::launcher::join_traces(inputs, argv[2]);
    for (const auto& s : r.skipped) std::fprintf(stderr, "tandem-trace: left out %s\n", s.c_str());
    std::printf("tandem-trace: joined %d file(s), %zu event(s), into %s\n", r.files, r.events,
                argv[2]);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem-trace: %s\n", e.what());
    return 1;
  }
}
