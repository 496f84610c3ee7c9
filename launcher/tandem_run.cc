// tandem-run: starts the worker processes of one Tandem job on this node and watches over them.
//
//   tandem-run --nproc-per-node N [--nnodes K --node-rank R --master-addr A --master-port P]
//              PROGRAM ARGS...
//
// What it promises:
//   * torchrun-compatible environment. Each of the N workers started here sees RANK,
//     LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT with the
//     meaning torchrun gives them (RANK = R * N + LOCAL_RANK, WORLD_SIZE = N * K), so programs
//     written for torchrun run unchanged.
//   * No port to choose for a one-node job: with --nnodes 1 and no --master-port, a free port on
//     127.0.0.1 is picked. A multi-node job must name its port.
//   * The rendezvous store, hosted here (node 0, LibTorch 1.x builds) before any worker starts,
//     on loopback for a one-node job and on the master's address otherwise; the workers join
//     it as clients. A one-node job without TANDEM_TOKEN gets a random one.
//   * Labelled output. Every line a worker writes is prefixed with "[RANK]: " and written whole
//     to the launcher's stdout or stderr (the same stream the worker used). Lines of different
//     workers never interleave mid-line, a last line without a newline is still printed, and the
//     pipes are drained before the launcher exits.
//   * Signal forwarding. SIGINT and SIGTERM sent to the launcher are passed on to every live
//     worker. As with torchrun, each worker runs in its own session (process group), and signals
//     go to the whole group, so processes a worker started (a shell's children) get them too.
//   * Cores shared out. Unless OMP_NUM_THREADS is set, each of N > 1 workers gets
//     OMP_NUM_THREADS = cores / N (at least 1), as torchrun does (it sets 1): LibTorch's
//     intra-op pool and OpenBLAS's threads default to every core in every process, and
//     OpenBLAS's idle threads spin for a while after each call, so N workers on one node would
//     compete for the cores the one that computes needs.
//   * Fail fast. When a worker exits non-zero or is killed by a signal, the launcher says which,
//     sends SIGTERM to the other workers, SIGKILLs those still alive 5 seconds later, and exits
//     with the failed worker's exit code (128 + signal number for a signal). It exits 0 only
//     when every worker exited 0. Bad arguments exit 2; a program that cannot be run exits 127.
//
// It uses only the C++ standard library and POSIX (no LibTorch), so it starts instantly, and it
// is single-threaded: one poll() loop serves the worker pipes and a self-pipe fed by the signal
// handler, which keeps the handler async-signal-safe.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <memory>
#include <vector>

#include "launcher/trace_join.h"

#include "tandem/rpc/common/auth.h"
#ifdef TANDEM_RUN_HOSTS_STORE
#include "tandem/rpc/rendezvous/store_server.h"
#endif

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kUsage[] =
    "usage: tandem-run --nproc-per-node N [--nnodes K --node-rank R --master-addr A "
    "--master-port P] PROGRAM ARGS...\n";

constexpr char kHelp[] =
    "\n"
    "Starts N copies of PROGRAM on this node with torchrun-compatible environment variables\n"
    "(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT).\n"
    "\n"
    "options (also accepted as --opt=value):\n"
    "  --nproc-per-node N   workers to start on this node (required, N >= 1)\n"
    "  --nnodes K           nodes in the job (default 1)\n"
    "  --node-rank R        this node's index, 0 <= R < K (default 0)\n"
    "  --master-addr A      address of the rank-0 node (default 127.0.0.1)\n"
    "  --master-port P      port on the rank-0 node; 0 picks a free one when K is 1\n"
    "                       (default 0; required when K > 1)\n"
    "  --trace DIR          every worker writes its trace into DIR (TANDEM_TRACE); once they\n"
    "                       exited, this node's traces are joined into DIR/tandem-trace.json\n"
    "  --help               print this help and exit\n"
    "  --                   end of options; PROGRAM follows\n"
    "\n"
    "Unless OMP_NUM_THREADS is set, each worker gets OMP_NUM_THREADS = cores / N.\n"
    "Worker output is prefixed with \"[RANK]: \". SIGINT and SIGTERM are forwarded to the\n"
    "workers. When a worker fails the others get SIGTERM (SIGKILL after 5 s) and tandem-run\n"
    "exits with the failed worker's code (128 + signal when it was killed).\n";

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitCannotRun = 127;
constexpr int kSignalExitBase = 128;

constexpr auto kKillGrace = std::chrono::seconds(5);
// How long pipes may stay open after every worker exited (a descendant of a worker can hold
// them); everything the workers themselves wrote is readable at once.
constexpr auto kDrainGrace = std::chrono::seconds(2);
constexpr int kMaxPollMs = 1000;
constexpr size_t kReadChunk = 64 * 1024;

constexpr const char* kWorkerVariables[] = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT",
};

constexpr const char* kValueFlags[] = {
    "nproc-per-node", "nnodes", "node-rank", "master-addr", "master-port", "trace",
};

// ---------------------------------------------------------------------------------------------
// Output helpers

// Writes everything, retrying on EINTR and short writes. Output whose reader went away
// (EPIPE) is dropped: the launcher keeps supervising its workers.
void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        pollfd wait_fd{fd, POLLOUT, 0};
        ::poll(&wait_fd, 1, -1);
        continue;
      }
      return;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void write_all(int fd, const std::string& text) { write_all(fd, text.data(), text.size()); }

void report(const std::string& message) {
  write_all(STDERR_FILENO, "tandem-run: " + message + "\n");
}

std::string errno_text(int error) { return std::strerror(error); }


// ---------------------------------------------------------------------------------------------
// Command line

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Options {
  int nproc_per_node = 0;  // 0: not given
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free one (single node only)
  std::string trace_dir;  // --trace
  std::vector<std::string> program;
  bool help = false;
};

int parse_int(const std::string& flag, const std::string& text, long long min, long long max) {
  std::string expected = "expected an integer in [" + std::to_string(min) + ", " +
                         std::to_string(max) + "]";
  std::string bad = "invalid value '" + text + "' for " + flag + " (" + expected + ")";
  if (text.empty()) throw UsageError(bad);
  long long value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') throw UsageError(bad);
    value = value * 10 + (c - '0');
    if (value > max) throw UsageError(bad);
  }
  if (value < min) throw UsageError(bad);
  return static_cast<int>(value);
}

// Accepts torchrun's underscore spelling too: --nproc_per_node is --nproc-per-node.
std::string normalize_flag(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

bool takes_value(const std::string& name) {
  for (const char* flag : kValueFlags) {
    if (name == flag) return true;
  }
  return false;
}

void apply_option(Options& options, const std::string& name, const std::string& value) {
  const std::string flag = "--" + name;
  if (name == "nproc-per-node") {
    options.nproc_per_node = parse_int(flag, value, 1, INT_MAX);
  } else if (name == "nnodes") {
    options.nnodes = parse_int(flag, value, 1, INT_MAX);
  } else if (name == "node-rank") {
    options.node_rank = parse_int(flag, value, 0, INT_MAX - 1);
  } else if (name == "master-addr") {
    if (value.empty()) throw UsageError("--master-addr must not be empty");
    options.master_addr = value;
  } else if (name == "master-port") {
    options.master_port = parse_int(flag, value, 0, 65535);
  } else if (name == "trace") {
    if (value.empty()) throw UsageError("--trace must name a directory");
    options.trace_dir = value;
  }
}

void validate(const Options& options) {
  if (options.nproc_per_node == 0) throw UsageError("missing required option --nproc-per-node");
  if (options.node_rank >= options.nnodes) {
    throw UsageError("--node-rank " + std::to_string(options.node_rank) +
                     " is out of range for --nnodes " + std::to_string(options.nnodes) +
                     " (expected 0 <= node-rank < nnodes)");
  }
  if (static_cast<long long>(options.nproc_per_node) * options.nnodes > INT_MAX) {
    throw UsageError("--nproc-per-node times --nnodes is too large");
  }
  if (options.nnodes > 1 && options.master_port == 0) {
    throw UsageError("--master-port (non-zero) is required when --nnodes is greater than 1");
  }
  if (options.program.empty()) throw UsageError("missing PROGRAM to run");
}

Options parse_args(int argc, char** argv) {
  Options options;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // PROGRAM: options end here
    if (arg == "--help" || arg == "-h") {
      options.help = true;
      return options;
    }
    if (arg.compare(0, 2, "--") != 0) throw UsageError("unknown option '" + arg + "'");
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    const size_t equals = name.find('=');
    if (equals != std::string::npos) {
      value = name.substr(equals + 1);
      name.resize(equals);
    }
    name = normalize_flag(name);
    if (!takes_value(name)) throw UsageError("unknown option '" + arg + "'");
    if (!value) {
      if (i + 1 >= argc) throw UsageError("option --" + name + " requires a value");
      value = argv[++i];
    }
    apply_option(options, name, *value);
  }
  options.program.assign(argv + i, argv + argc);
  validate(options);
  return options;
}

// ---------------------------------------------------------------------------------------------
// Process setup

// Makes sure fds 0-2 exist, so pipes created later never land on them.
void ensure_standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0) continue;
    int null_fd = ::open("/dev/null", O_RDWR);
    if (null_fd >= 0 && null_fd != fd) {
      ::dup2(null_fd, fd);
      ::close(null_fd);
    }
  }
}

// Binds 127.0.0.1:0, reads the port the kernel chose, and releases it.
int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("cannot pick a free port: " + errno_text(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = 0;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  int error = errno;
  ::close(fd);
  if (!ok) throw std::runtime_error("cannot pick a free port: " + errno_text(error));
  return ntohs(address.sin_port);
}

void set_fd_flag(int fd, int get_command, int set_command, int flag) {
  int flags = ::fcntl(fd, get_command);
  if (flags >= 0) ::fcntl(fd, set_command, flags | flag);
}

// A pipe whose ends are close-on-exec; the read end is non-blocking. Returns false on failure.
bool make_pipe(int ends[2], bool nonblocking_write) {
  if (::pipe(ends) != 0) return false;
  for (int i = 0; i < 2; ++i) set_fd_flag(ends[i], F_GETFD, F_SETFD, FD_CLOEXEC);
  set_fd_flag(ends[0], F_GETFL, F_SETFL, O_NONBLOCK);
  if (nonblocking_write) set_fd_flag(ends[1], F_GETFL, F_SETFL, O_NONBLOCK);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Signals: the handler only writes the signal number into a self-pipe; the poll loop acts.

int signal_pipe_write_end = -1;

constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

void on_signal(int signal_number) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal_number);
  ssize_t ignored = ::write(signal_pipe_write_end, &byte, 1);  // full pipe: a wakeup is pending
  (void)ignored;
  errno = saved_errno;
}

// Returns the read end of the self-pipe.
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

// In a freshly forked worker: default dispositions and an empty mask, as a program expects.
void reset_child_signals() {
  for (int signal_number : kHandledSignals) ::signal(signal_number, SIG_DFL);
  ::signal(SIGPIPE, SIG_DFL);
  sigset_t empty;
  sigemptyset(&empty);
  ::sigprocmask(SIG_SETMASK, &empty, nullptr);
}

// ---------------------------------------------------------------------------------------------
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

void LineForwarder::read_some() {
  char buffer[kReadChunk];
  const ssize_t n = ::read(fd_, buffer, sizeof(buffer));
  if (n > 0) {
    pending_.append(buffer, static_cast<size_t>(n));
    emit_complete_lines();
    return;
  }
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  finish();
}

void LineForwarder::emit_complete_lines() {
  std::string out;
  size_t start = 0;
  size_t newline;
  while ((newline = pending_.find('\n', scanned_)) != std::string::npos) {
    out += prefix_;
    out.append(pending_, start, newline + 1 - start);
    start = newline + 1;
    scanned_ = start;
  }
  pending_.erase(0, start);
  scanned_ = pending_.size();
  if (!out.empty()) write_all(sink_, out);  // one write per batch: whole lines only
}

void LineForwarder::finish() {
  if (fd_ < 0) return;
  if (!pending_.empty()) write_all(sink_, prefix_ + pending_ + "\n");
  pending_.clear();
  scanned_ = 0;
  ::close(fd_);
  fd_ = -1;
}

// ---------------------------------------------------------------------------------------------
// Launcher

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
  LineForwarder out;
  LineForwarder err;
};

std::string variable_name(const char* entry) {
  const char* equals = std::strchr(entry, '=');
  return equals ? std::string(entry, equals) : std::string(entry);
}

bool is_worker_variable(const std::string& name) {
  for (const char* variable : kWorkerVariables) {
    if (name == variable) return true;
  }
  return false;
}

std::vector<char*> to_pointers(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

[[noreturn]] void run_child(int out_fd, int err_fd, char** argv, char** envp) {
  reset_child_signals();
  ::setsid();  // own session and process group, like torchrun's start_new_session
  ::dup2(out_fd, STDOUT_FILENO);  // dup2 clears close-on-exec on the copies
  ::dup2(err_fd, STDERR_FILENO);
  environ = envp;
  ::execvp(argv[0], argv);
  const int error = errno;
  write_all(STDERR_FILENO,
            std::string("tandem-run: cannot run ") + argv[0] + ": " + errno_text(error) + "\n");
  ::_exit(kExitCannotRun);
}

class Launcher {
 public:
  Launcher(Options options, int signal_fd) : options_(std::move(options)), signal_fd_(signal_fd) {}

  // Starts the workers, supervises them until all exited and their output is drained, and
  // returns the launcher's exit status.
  int run();

 private:
  void start_workers();
  void join_traces();
  bool spawn(int local_rank);
  std::vector<std::string> worker_environment(int local_rank) const;
  // OMP_NUM_THREADS for each worker when the user did not set it; 0: leave it unset.
  int threads_per_worker() const;
  void poll_once();
  int poll_timeout_ms() const;
  void handle_signals();
  void reap_workers();
  void on_worker_exit(Worker& worker, int status);
  void begin_shutdown(int exit_code);
  void signal_live_workers(int signal_number);
  void check_deadlines();
  bool has_open_pipes() const;
  Worker* find_worker(pid_t pid);

  Options options_;
  int signal_fd_;
  // A one-node job's cluster token when the user set none (see start_workers).
  std::string job_token_;
#ifdef TANDEM_RUN_HOSTS_STORE
  // The rendezvous store, hosted here on node 0 before any worker starts.
  std::unique_ptr<tandem::rpc::StoreServer> store_;
#endif
  bool hosts_store_ = false;
  std::vector<Worker> workers_;
  int live_workers_ = 0;
  int exit_code_ = 0;  // the first failure's status; 0 while none
  bool shutting_down_ = false;
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> drain_deadline_;
};

int Launcher::run() {
  start_workers();
  while (live_workers_ > 0 || has_open_pipes()) {
    poll_once();
    reap_workers();
    check_deadlines();
  }
  if (!options_.trace_dir.empty()) join_traces();
  return exit_code_;
}

// This node's workers' traces into <dir>/tandem-trace.json (launcher/trace_join.h).
void Launcher::join_traces() {
  std::vector<std::string> files;
  const int first = options_.node_rank * options_.nproc_per_node;
  for (int rank = first; rank < first + options_.nproc_per_node; ++rank) {
    files.push_back(options_.trace_dir + "/tandem-trace-rank" + std::to_string(rank) + ".json");
  }
  const std::string out = options_.trace_dir + "/tandem-trace.json";
  try {
    auto r = tandem::launcher::join_traces(files, out);
    for (const auto& s : r.skipped) report("no trace from " + s);
    report("joined the traces of " + std::to_string(r.files) + " worker(s) into " + out);
  } catch (const std::exception& e) {
    report(std::string("no joined trace: ") + e.what());
  }
}

int Launcher::threads_per_worker() const {
  if (options_.nproc_per_node <= 1 || std::getenv("OMP_NUM_THREADS") != nullptr) return 0;
  cpu_set_t set;
  long cores = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    cores = CPU_COUNT(&set);  // the cores this launcher may use, as its workers will
  } else {
    cores = sysconf(_SC_NPROCESSORS_ONLN);
  }
  return static_cast<int>(std::max(1L, cores / options_.nproc_per_node));
}

void Launcher::start_workers() {
  if (const int threads = threads_per_worker()) {
    report("OMP_NUM_THREADS=" + std::to_string(threads) + " for each of " +
           std::to_string(options_.nproc_per_node) +
           " workers (the node's cores shared out); set OMP_NUM_THREADS to choose");
  }
  // Workers prove the cluster token to each other (rpc/common/auth.h). A one-node
  // job without TANDEM_TOKEN gets a fresh random one, so that no other
  // process on the host can join it; nodes of a multi-node job must share
  // one, which only the user can give them all.
  const char* token = std::getenv("TANDEM_TOKEN");
  if ((!token || !*token) && options_.nnodes == 1) {
    job_token_ = tandem::rpc::random_hex(32);
  } else if (!token || !*token) {
    report("warning: TANDEM_TOKEN is not set: any process that can reach this job's workers "
           "can join it; set the same random TANDEM_TOKEN on every node");
  }
#ifdef TANDEM_RUN_HOSTS_STORE
  // Node 0's launcher hosts the store, listening on loopback for a one-node
  // job and on the master's address otherwise, before any worker starts:
  // no worker waits for rank 0 to come up, and the store outlives rank 0.
  // The workers join it as clients (TORCHELASTIC_USE_AGENT_STORE, as under
  // torchrun). TANDEM_STORE=c10d leaves it to rank 0.
  const char* store_choice = std::getenv("TANDEM_STORE");
  if (options_.node_rank == 0 && !(store_choice && std::string(store_choice) == "c10d")) {
    const char* bind = std::getenv("TANDEM_STORE_BIND");
    const std::string host = bind ? bind : options_.nnodes == 1 ? "127.0.0.1" : options_.master_addr;
    try {
      store_ = std::make_unique<tandem::rpc::StoreServer>(host, options_.master_port);
      hosts_store_ = true;
    } catch (const std::exception& e) {
      report(std::string(e.what()) + "; rank 0 hosts the store instead");
    }
  }
#endif
  workers_.reserve(options_.nproc_per_node);
  for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
    if (!spawn(local_rank)) {
      begin_shutdown(kExitFailure);
      return;
    }
  }
}

std::vector<std::string> Launcher::worker_environment(int local_rank) const {
  std::vector<std::string> env;
  for (char** entry = environ; entry && *entry; ++entry) {
    const std::string name = variable_name(*entry);
    if (is_worker_variable(name)) continue;
    if (hosts_store_ && name == "TORCHELASTIC_USE_AGENT_STORE") continue;  // set below
    env.emplace_back(*entry);
  }
  const int nproc = options_.nproc_per_node;
  const auto add = [&env](const char* name, const std::string& value) {
    env.push_back(std::string(name) + "=" + value);
  };
  add("RANK", std::to_string(options_.node_rank * nproc + local_rank));
  add("LOCAL_RANK", std::to_string(local_rank));
  add("WORLD_SIZE", std::to_string(nproc * options_.nnodes));
  add("LOCAL_WORLD_SIZE", std::to_string(nproc));
  add("GROUP_RANK", std::to_string(options_.node_rank));
  add("MASTER_ADDR", options_.master_addr);
  add("MASTER_PORT", std::to_string(options_.master_port));
  add("TANDEM_LAUNCHER", "tandem-run");  // rpc::init then prints debug info on SIGUSR1
  if (!options_.trace_dir.empty()) add("TANDEM_TRACE", options_.trace_dir);
  if (const int threads = threads_per_worker()) add("OMP_NUM_THREADS", std::to_string(threads));
  if (!job_token_.empty()) add("TANDEM_TOKEN", job_token_);
  if (hosts_store_) add("TORCHELASTIC_USE_AGENT_STORE", "True");
  return env;
}

bool Launcher::spawn(int local_rank) {
  const int rank = options_.node_rank * options_.nproc_per_node + local_rank;
  int out_pipe[2];
  int err_pipe[2];
  if (!make_pipe(out_pipe, false)) {
    report("cannot create a pipe for worker " + std::to_string(rank) + ": " + errno_text(errno));
    return false;
  }
  if (!make_pipe(err_pipe, false)) {
    report("cannot create a pipe for worker " + std::to_string(rank) + ": " + errno_text(errno));
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    return false;
  }
  std::vector<std::string> env = worker_environment(local_rank);
  std::vector<std::string> args = options_.program;
  std::vector<char*> envp = to_pointers(env);
  std::vector<char*> argv = to_pointers(args);

  // Signals stay blocked across fork so the child never runs the launcher's handler.
  const sigset_t blocked = handled_signal_set();
  sigset_t saved;
  ::sigprocmask(SIG_BLOCK, &blocked, &saved);
  const pid_t pid = ::fork();
  if (pid == 0) run_child(out_pipe[1], err_pipe[1], argv.data(), envp.data());
  const int fork_error = errno;
  ::sigprocmask(SIG_SETMASK, &saved, nullptr);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (pid < 0) {
    report("cannot start worker " + std::to_string(rank) + ": " + errno_text(fork_error));
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    return false;
  }
  const std::string prefix = "[" + std::to_string(rank) + "]: ";
  Worker worker;
  worker.rank = rank;
  worker.pid = pid;
  worker.alive = true;
  worker.out = LineForwarder(out_pipe[0], STDOUT_FILENO, prefix);
  worker.err = LineForwarder(err_pipe[0], STDERR_FILENO, prefix);
  workers_.push_back(std::move(worker));
  ++live_workers_;
  return true;
}

void Launcher::poll_once() {
  std::vector<pollfd> fds;
  std::vector<LineForwarder*> forwarders;
  fds.push_back({signal_fd_, POLLIN, 0});
  forwarders.push_back(nullptr);
  for (Worker& worker : workers_) {
    for (LineForwarder* forwarder : {&worker.out, &worker.err}) {
      if (!forwarder->is_open()) continue;
      fds.push_back({forwarder->fd(), POLLIN, 0});
      forwarders.push_back(forwarder);
    }
  }
  if (::poll(fds.data(), fds.size(), poll_timeout_ms()) <= 0) return;  // timeout or EINTR
  if (fds[0].revents != 0) handle_signals();
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents != 0) forwarders[i]->read_some();
  }
}

int Launcher::poll_timeout_ms() const {
  const Clock::time_point now = Clock::now();
  long long timeout = kMaxPollMs;
  for (const auto& deadline : {kill_deadline_, drain_deadline_}) {
    if (!deadline) continue;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - now).count();
    timeout = std::min(timeout, std::max(0LL, static_cast<long long>(left)));
  }
  return static_cast<int>(timeout);
}

void Launcher::handle_signals() {
  unsigned char buffer[64];
  ssize_t n;
  while ((n = ::read(signal_fd_, buffer, sizeof(buffer))) > 0) {
    for (ssize_t i = 0; i < n; ++i) {
      const int signal_number = buffer[i];
      if (signal_number == SIGINT || signal_number == SIGTERM) signal_live_workers(signal_number);
      // SIGCHLD only wakes the loop; reap_workers() runs after every poll.
    }
  }
}

void Launcher::reap_workers() {
  int status = 0;
  pid_t pid;
  while (live_workers_ > 0 && (pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
    Worker* worker = find_worker(pid);
    if (worker != nullptr && worker->alive) on_worker_exit(*worker, status);
  }
}

void Launcher::on_worker_exit(Worker& worker, int status) {
  worker.alive = false;
  --live_workers_;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  if (shutting_down_) return;  // a consequence of the shutdown already under way
  int code = kExitFailure;
  std::string what = "exited abnormally";
  if (WIFEXITED(status)) {
    code = WEXITSTATUS(status);
    what = "exited with code " + std::to_string(code);
  } else if (WIFSIGNALED(status)) {
    code = kSignalExitBase + WTERMSIG(status);
    what = "killed by signal " + std::to_string(WTERMSIG(status));
  }
  report("worker " + std::to_string(worker.rank) + " " + what);
  begin_shutdown(code);
}

void Launcher::begin_shutdown(int exit_code) {
  if (shutting_down_) return;
  shutting_down_ = true;
  exit_code_ = exit_code;
  signal_live_workers(SIGTERM);
  kill_deadline_ = Clock::now() + kKillGrace;
}

// Signals each live worker's process group; a worker that has not called setsid() yet (just
// forked) has no group of its own, so it is signalled directly.
void Launcher::signal_live_workers(int signal_number) {
  for (const Worker& worker : workers_) {
    if (!worker.alive) continue;
    if (::kill(-worker.pid, signal_number) != 0) ::kill(worker.pid, signal_number);
  }
}

void Launcher::check_deadlines() {
  const Clock::time_point now = Clock::now();
  if (kill_deadline_ && now >= *kill_deadline_) {
    kill_deadline_.reset();
    signal_live_workers(SIGKILL);
  }
  if (live_workers_ == 0 && !drain_deadline_) drain_deadline_ = now + kDrainGrace;
  if (drain_deadline_ && now >= *drain_deadline_) {
    for (Worker& worker : workers_) {
      worker.out.finish();
      worker.err.finish();
    }
  }
}

bool Launcher::has_open_pipes() const {
  for (const Worker& worker : workers_) {
    if (worker.out.is_open() || worker.err.is_open()) return true;
  }
  return false;
}

Worker* Launcher::find_worker(pid_t pid) {
  for (Worker& worker : workers_) {
    if (worker.pid == pid) return &worker;
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  ensure_standard_fds_open();
  Options options;
  try {
    options = parse_args(argc, argv);
  } catch (const UsageError& error) {
    write_all(STDERR_FILENO, std::string("tandem-run: ") + error.what() + "\n" + kUsage);
    return kExitUsage;
  }
  if (options.help) {
    write_all(STDOUT_FILENO, std::string(kUsage) + kHelp);
    return 0;
  }
  try {
    if (options.master_port == 0) options.master_port = pick_free_port();
    const int signal_fd = install_signal_pipe();
    Launcher launcher(std::move(options), signal_fd);
    return launcher.run();
  } catch (const std::exception& error) {
    report(error.what());
    return kExitFailure;
  }
}
