// main() of an example that is a job of several workers, started either way
// a PyTorch user starts one:
//   - under tandem-run (or torchrun: RANK is set), this process is one
//     worker, and worker(argc, argv) runs here;
//   - started alone (`build/bin/char_lm`), it starts its workers itself with
//     tandem::spawn, as a Python script calls torch.multiprocessing.spawn:
//     each runs worker(argc, argv) with the same flags, their output comes
//     labelled "[RANK]: ", and the exit code is the first failing worker's
//     (0 when every worker exits 0). --help is answered at once, here.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "tandem/rpc/rendezvous.h"
#include "tandem/rpc/spawn.h"

namespace examples {

inline bool asks_for_help(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) return true;
  }
  return false;
}

inline int launch(const char* program, int nprocs, int argc, char** argv,
                  const std::function<int(int, char**)>& worker) {
  const bool spawned = tandem::spawned_worker();
  if (!spawned && tandem::rpc::world_from_env().rank >= 0) return worker(argc, argv);
  if (!spawned && asks_for_help(argc, argv)) return worker(argc, argv);  // outside any world
  try {
    tandem::spawn(nprocs, [&](int, int) {
      // A worker's own exit code (2 for a bad flag) is the job's.
      if (const int rc = worker(argc, argv)) std::exit(rc);
    });
    return 0;
  } catch (const tandem::SpawnError& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return e.exit_code > 0 ? e.exit_code : 1;
  }
}

}  // namespace examples
