// tandem-run's Launcher: starts this node's workers (launcher/run/start.cc:
// the environment, the cluster token, the rendezvous store it hosts, fork
// and exec) and watches over them until all exited and their output is
// drained (launcher/run/supervise.cc: the poll loop, signals forwarded,
// fail fast). A job of several nodes that restarts, or an elastic one, is
// coordinated by node 0's launcher (launcher/run/nodes.cc): it admits the
// nodes of each round, and every node's workers start and stop together.
// main() (launcher/tandem_run.cc) parses Options, installs the signal pipe
// (launcher/run/signals.h) and runs it; its answer is the launcher's exit
// code.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "launcher/run/channel.h"
#include "launcher/run/line_forwarder.h"
#include "launcher/run/options.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/rendezvous/etcd_client.h"
#ifdef TANDEM_RUN_HOSTS_STORE
#include "tandem/rpc/rendezvous/store_server.h"
#endif

namespace tandem::launcher {

using Clock = std::chrono::steady_clock;

constexpr int kExitFailure = 1;
// A worker's exit code that asks --replace-failed not to start it again
// alone: its failure is the job's (ft::kExitNotReplaceable).
constexpr int kExitNotReplaceable = 78;
constexpr int kExitUsage = 2;
constexpr int kExitCannotRun = 127;
constexpr int kSignalExitBase = 128;
// Launchers of a coordinated job say a word every kCoordinatorHeartbeat; one
// silent for kCoordinatorSilence is lost.
constexpr auto kCoordinatorHeartbeat = std::chrono::seconds(1);
constexpr auto kCoordinatorSilence = std::chrono::seconds(5);

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
  bool replaced = false;  // --replace-failed started another in its place
  LineForwarder out;
  LineForwarder err;
};

// What this node's workers of a round are told (their environment).
struct Round {
  int number = 0;      // rounds started before this one: TANDEM_RESTART_COUNT
  int restarts = 0;    // of them, after a failure: TORCHELASTIC_RESTART_COUNT
  int nnodes = 1;      // nodes in the round: WORLD_SIZE = nnodes * nproc-per-node
  int group_rank = 0;  // this node's place among them: GROUP_RANK
  int store_port = 0;  // the round's rendezvous store on the master: MASTER_PORT
};

// A node of a coordinated job, as node 0's launcher sees it.
struct Node {
  int node_rank = 0;  // its --node-rank: the order of the group ranks
  Channel channel;
  bool in_round = false;  // a member of the round being run or stopped
  bool done = false;      // its workers of the round all exited 0
  bool stopped = false;   // its workers of the round are gone
};

// A connection to node 0's launcher that has not joined yet.
struct Pending {
  Channel channel;
  std::string nonce;  // node 0's, which both proofs cover
  Clock::time_point since = Clock::now();
  bool asked = false;  // its join came and node 0 proved itself (nodes.cc, 3.)
  int node_rank = -1;
  std::string node_nonce;
};

class Launcher {
 public:
  Launcher(Options options, int signal_fd) : options_(std::move(options)), signal_fd_(signal_fd) {}

  // Starts the workers, supervises them until all exited and their output is drained, and
  // returns the launcher's exit status.
  int run();

 private:
  // Plain: this node alone restarts (or the job is one node). Coordinated:
  // launcher/run/nodes.cc.
  int run_plain();
  // A plain node other than 0: whether node 0's launcher coordinates (it
  // greets a connection to the master's port within 300 ms).
  bool coordinating_node0();
  int run_coordinated();
  void start_workers();
  // After a failure with restarts left, once every worker of the round is
  // gone: the next round, with a fresh store and token.
  void next_round();
  void join_traces();
  bool spawn(int local_rank);
  std::vector<std::string> worker_environment(int local_rank) const;
  // OMP_NUM_THREADS for each worker when the user did not set it; 0: leave it unset.
  int threads_per_worker() const;
  // Waits for output, signals and (coordinated) the launchers' messages; `extra`
  // adds descriptors with what to do when they are ready.
  void poll_once(std::vector<std::pair<int, std::function<void()>>> extra = {});
  int poll_timeout_ms() const;
  void handle_signals();
  void reap_workers();
  void on_worker_exit(Worker& worker, int status);
  void begin_shutdown(int exit_code);
  void signal_live_workers(int signal_number);
  void check_deadlines();
  bool has_open_pipes() const;
  Worker* find_worker(pid_t pid);

  // Coordinated jobs (launcher/run/nodes.cc).
  std::vector<std::pair<int, std::function<void()>>> node_descriptors();
  void node_tick();
  // Node 0's listener and the connections that have not joined yet, the
  // node's side of the handshake (join.cc); true when it took the line.
  void accept_nodes();
  void tick_pending(Clock::time_point now);
  bool on_coordinator_handshake(const std::vector<std::string>& words, const std::string& line);
  // False once the connection is done with (admitted or refused).
  bool on_pending_line(size_t index, const std::string& line);
  // The lowest node rank after 0 that no joined node holds; -1 when all do.
  int free_node_rank() const;
  // Logs (rate-limited) the lines `channel` refused for their MAC.
  void report_refused_lines(Channel& channel, const std::string& who);
  void on_node_line(Node& node, const std::string& line);
  void on_node_lost(int node_rank, const std::string& why);
  // Node 0 and the nodes in the round being run or stopped.
  int nodes_in_round() const;
  // "--nnodes" as a round waits for: "3 node(s)", "2 to 3 node(s)".
  std::string nodes_wanted() const;
  void on_coordinator_line(const std::string& line);
  void connect_to_coordinator();
  void maybe_start_round();
  void start_round();
  void begin_local_round();
  void round_failed(const std::string& what, int code, bool restart);
  void stop_round();
  void check_round_over();
  void finish(int code);
  void local_worker_failed(const Worker& worker, int code, const std::string& what);
  void local_round_over();
  void open_round_store();

  // --rdzv-endpoint (launcher/run/elect.cc): the coordinator elected in etcd.
  bool elected() const { return !options_.rdzv_endpoint.empty(); }
  std::string etcd_key(const std::string& name) const;
  // Claims the coordinator's key, or follows the launcher it names; `lost`:
  // the value of a coordinator this launcher found gone, which it may replace.
  void elect(const std::string& lost);
  void become_coordinator(const std::string& claim, int gen);
  // The coordinator's word on the job in etcd ("round ..." or "exit ...").
  void record_state(const std::string& state);
  // The coordinator, each heartbeat: does etcd still name it?
  void check_leadership(Clock::time_point now);
  // A follower whose coordinator is gone: its workers stopped, it elects anew.
  void coordinator_lost(const std::string& why);
  // The client for the coordinator's calls from its loop (a short limit).
  rpc::EtcdClient& loop_etcd();

  Options options_;
  int signal_fd_;
  Round round_;
  // Coordinated: whether this node's workers of the round are running or
  // being stopped (not yet all gone).
  bool round_active_ = false;
  bool local_done_ = false;
  bool local_stopped_ = false;
  bool finished_ = false;
  // Node 0: the launchers' listening socket, connections not yet joined, the
  // other nodes, and the phase of the round.
  int listen_fd_ = -1;
  std::vector<Pending> pending_;
  Clock::time_point accept_paused_until_{};  // accept() ran out of descriptors
  bool accept_error_logged_ = false;
  // What peers that broke the protocol made us say, rate-limited.
  rpc::ProtocolLog peer_log_;
  std::vector<Node> nodes_;
  enum class Phase { kJoining, kRunning, kStopping } phase_ = Phase::kJoining;
  Clock::time_point joining_since_{};
  std::optional<Clock::time_point> enough_since_;   // when the round first had MIN nodes
  int last_round_nodes_ = 0;                        // nodes the last round started with
  std::optional<Clock::time_point> stop_deadline_;  // for the nodes to report a stop
  std::optional<int> final_code_;                   // the job ends with this once the round stopped
  bool count_restart_ = false;  // the round being stopped restarts after a failure
  // Another node: its channel to node 0's launcher.
  Channel coordinator_;
  bool joined_ = false;    // asked node 0 to join (lost from then on: the job ends)
  bool admitted_ = false;  // node 0 proved the token, and so did this node
  std::string coordinator_nonce_, my_nonce_;
  Clock::time_point connect_deadline_{};
  Clock::time_point next_connect_{};
  // --rdzv-endpoint: the etcd client, the coordinator's value this launcher
  // follows or holds ("GEN ADDR:PORT"), and an election waiting for this
  // node's workers to stop.
  std::unique_ptr<rpc::EtcdClient> etcd_;
  // (the coordinator's, for calls from its loop: a short limit)
  std::unique_ptr<rpc::EtcdClient> loop_etcd_;
  std::string followed_, leading_;
  bool reelect_ = false;
  bool etcd_trouble_logged_ = false;
  Clock::time_point next_leadership_check_{};
  Clock::time_point elect_deadline_{};
  // A one-node job's cluster token when the user set none (see start_workers).
  std::string job_token_;
#ifdef TANDEM_RUN_HOSTS_STORE
  // The rendezvous store, hosted here on node 0 before any worker starts.
  std::unique_ptr<tandem::rpc::StoreServer> store_;
#endif
  bool hosts_store_ = false;
  std::vector<Worker> workers_;
  // --replace-failed: workers started again alone, in all and per local rank.
  int replacements_ = 0;
  std::map<int, int> replaced_;
  int live_workers_ = 0;
  int exit_code_ = 0;  // the first failure's status; 0 while none
  bool shutting_down_ = false;
  // A failed round is being stopped to start the next (--max-restarts).
  bool restarting_ = false;
  // SIGINT or SIGTERM came to the launcher: no more restarts.
  bool stopped_by_user_ = false;
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> drain_deadline_;
};

}  // namespace tandem::launcher
