// tandem-run's command line: the usage and help texts, and parse_args, which
// turns argv into Options or throws UsageError (main prints it and exits 2).
// The Launcher (launcher/run/launcher.h) starts its workers from Options.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace tandem::launcher {

constexpr char kUsage[] =
    "usage: tandem-run --nproc-per-node N [--nnodes K|MIN:MAX --node-rank R --master-addr A "
    "--master-port P | --nnodes K|MIN:MAX --rdzv-endpoint E --rdzv-id ID] [--max-restarts N] "
    "[--replace-failed N] PROGRAM ARGS...\n";

constexpr char kHelp[] =
    "\n"
    "Starts N copies of PROGRAM on this node with torchrun-compatible environment variables\n"
    "(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT).\n"
    "\n"
    "options (also accepted as --opt=value):\n"
    "  --nproc-per-node N   workers to start on this node (required, N >= 1)\n"
    "  --nnodes K           nodes in the job (default 1); MIN:MAX makes it elastic: a round\n"
    "                       starts with MAX nodes, or with MIN or more once --last-call has\n"
    "                       passed, so a restart goes on without a node that is gone\n"
    "  --node-rank R        this node's index, 0 <= R < K; with --max-restarts or --nnodes\n"
    "                       MIN:MAX it may be left out: the launcher that can listen at\n"
    "                       --master-addr:--master-port is node 0, which numbers the others\n"
    "                       as they join\n"
    "  --master-addr A      address of the rank-0 node (default 127.0.0.1)\n"
    "  --master-port P      port on the rank-0 node; 0 picks a free one when K is 1\n"
    "                       (default 0; required when K > 1)\n"
    "  --max-restarts N     when a worker fails, stop the others and start every worker\n"
    "                       again, up to N times (default 0); each sees its round in\n"
    "                       TANDEM_RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT), with a\n"
    "                       fresh rendezvous store and, where tandem-run made it, a fresh token.\n"
    "                       On several nodes, node 0's launcher coordinates: every node's\n"
    "                       workers stop and start again together, and a node whose launcher\n"
    "                       is gone (closed, or silent for 5 s) fails the round\n"
    "  --replace-failed N   a worker that fails is started again alone, with the same rank,\n"
    "                       while the others go on, up to N times in all (default 0): for\n"
    "                       jobs whose replicas survive a peer's failure (tandem::ft::Manager);\n"
    "                       each sees how often its rank was replaced in\n"
    "                       TANDEM_REPLACEMENT_COUNT. Once N are spent, a failure stops the\n"
    "                       job (or restarts it: --max-restarts), as does a worker that exits\n"
    "                       with code 78: its failure is the job's (ft::QuorumError: no\n"
    "                       quorum left), which starting it alone cannot mend\n"
    "  --last-call S        an elastic round waits S seconds (default 10) for more than MIN\n"
    "                       nodes, or for a node of the last round that is gone, before it\n"
    "                       starts without them\n"
    "  --join-timeout S     how long a round waits for its minimum of nodes, and a node for\n"
    "                       node 0's launcher (default 600)\n"
    "  --peer-timeout S     a worker that sends its peers nothing for S seconds (stopped, frozen;\n"
    "                       a busy one sends heartbeats) counts as stalled: their calls and\n"
    "                       collectives waiting on it fail, so the job fails (and restarts)\n"
    "                       instead of hanging; 0 never (TANDEM_PEER_TIMEOUT; the workers'\n"
    "                       default is 30)\n"
    "  --rdzv-endpoint E    etcd's members (host:port,...): the launchers meet there and elect\n"
    "                       the one that coordinates the rounds; when it is lost, another takes\n"
    "                       over (the round it ran counts as failed) and the job goes on with\n"
    "                       the nodes left. Leave out --node-rank and --master-port\n"
    "  --rdzv-id ID         this launch's keys in etcd (default job): give each launch its own\n"
    "  --local-addr A       the address the other nodes reach this one at, with\n"
    "                       --rdzv-endpoint (default: the one that routes to etcd)\n"
    "  --trace DIR          every worker writes its trace into DIR (TANDEM_TRACE); once they\n"
    "                       exited, this node's traces are joined into DIR/tandem-trace.json\n"
    "  --help               print this help and exit\n"
    "  --                   end of options; PROGRAM follows\n"
    "\n"
    "Unless OMP_NUM_THREADS is set, each worker gets OMP_NUM_THREADS = cores / N.\n"
    "Worker output is prefixed with \"[RANK]: \". SIGINT and SIGTERM are forwarded to the\n"
    "workers. When a worker fails the others get SIGTERM (SIGKILL after 5 s) and tandem-run\n"
    "exits with the failed worker's code (128 + signal when it was killed), unless restarts\n"
    "are left. SIGINT or SIGTERM to tandem-run stops the job for good.\n";

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Options {
  int nproc_per_node = 0;  // 0: not given
  int nnodes = 1;          // the most nodes (K, or MAX of MIN:MAX)
  int min_nodes = 1;       // MIN of MIN:MAX; nnodes when not elastic
  // -1: not given. One node: 0. A coordinated job's node (coordinated()):
  // the launcher that can listen at the master's address is node 0, and
  // node 0's launcher gives every other its rank as it joins.
  int node_rank = -1;
  bool given_node_rank = false;  // --node-rank was given
  std::string master_addr = "127.0.0.1";
  int master_port = 0;       // 0: pick a free one (single node only)
  std::string trace_dir;     // --trace
  int max_restarts = 0;      // --max-restarts
  int replace_failed = 0;    // --replace-failed
  int last_call_s = 10;      // --last-call
  int join_timeout_s = 600;  // --join-timeout
  int peer_timeout_s = -1;   // --peer-timeout; -1: not given (the workers' own default)
  // --rdzv-endpoint: etcd's members; the launchers elect their coordinator
  // there (launcher/run/elect.cc) instead of node 0 being it. --rdzv-id
  // keeps one launch's keys apart from another's; --local-addr is the
  // address the other nodes reach this one at (empty: the one that routes
  // to etcd's first member).
  std::string rdzv_endpoint;
  std::string rdzv_id = "job";
  std::string local_addr;
  std::vector<std::string> program;
  bool help = false;
};

Options parse_args(int argc, char** argv);

// Whether node 0's launcher coordinates the job's rounds over its nodes
// (launcher/run/nodes.cc): several nodes that restart, or an elastic size.
inline bool coordinated(const Options& options) {
  return !options.rdzv_endpoint.empty() ||
         (options.nnodes > 1 && (options.max_restarts > 0 || options.min_nodes != options.nnodes));
}

}  // namespace tandem::launcher
