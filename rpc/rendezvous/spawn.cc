#include "tandem/rpc/spawn.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>

extern char** environ;

namespace tandem {
namespace {

constexpr const char* kChildVariable = "TANDEM_SPAWN_WORKER";

std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  size_t start = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] == '\0') {
      args.push_back(all.substr(start, i - start));
      start = i + 1;
    }
  }
  if (start < all.size()) args.push_back(all.substr(start));
  return args;
}

std::string own_executable() {
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) throw std::runtime_error("tandem::spawn: cannot tell which program this is");
  return std::string(path, static_cast<size_t>(n));
}

std::string find_launcher(const SpawnOptions& options) {
  if (!options.launcher.empty()) return options.launcher;
  if (const char* env = std::getenv("TANDEM_RUN"); env && *env) return env;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&find_launcher), &info) && info.dli_fname) {
    std::string lib = info.dli_fname;
    const auto slash = lib.rfind('/');
    if (slash != std::string::npos) {
      const std::string beside = lib.substr(0, slash) + "/../bin/tandem-run";
      if (::access(beside.c_str(), X_OK) == 0) return beside;
    }
  }
  return "tandem-run";  // from PATH
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// The launcher's output, relayed line by line, remembering each worker's last lines.
struct Relay {
  size_t keep = 20;
  std::map<int, std::deque<std::string>> last;  // by rank
  std::deque<std::string> launcher_lines;       // tandem-run's own
  int failed_rank = -1, exit_code = -1, signal = 0;

  void line(const std::string& text) {
    static const std::regex worker_line(R"(^\[(\d+)\]: (.*)$)");
    static const std::regex failure(
        R"(^tandem-run: worker (\d+) (exited with code (\d+)|killed by signal (\d+)))");
    std::smatch m;
    if (std::regex_match(text, m, worker_line)) {
      auto& lines = last[std::stoi(m[1])];
      lines.push_back(m[2]);
      if (lines.size() > keep) lines.pop_front();
    } else {
      if (std::regex_search(text, m, failure) && failed_rank < 0) {
        failed_rank = std::stoi(m[1]);
        if (m[3].matched) exit_code = std::stoi(m[3]);
        if (m[4].matched) signal = std::stoi(m[4]);
      }
      launcher_lines.push_back(text);
      if (launcher_lines.size() > keep) launcher_lines.pop_front();
    }
  }
};

struct Pipe {
  int fd = -1;
  int sink = -1;
  std::string pending;
};

}  // namespace

bool spawned_worker() {
  const char* v = std::getenv(kChildVariable);
  return v && std::strcmp(v, "1") == 0;
}

void spawn(int nprocs, const std::function<void(int, int)>& fn, const SpawnOptions& options) {
  if (nprocs < 1) {
    throw std::invalid_argument("tandem::spawn: nprocs must be at least 1, not " +
                                std::to_string(nprocs));
  }
  if (spawned_worker()) {
    // 2.: this process is one of the workers.
    const char* rank = std::getenv("RANK");
    const char* world = std::getenv("WORLD_SIZE");
    int code = 0;
    try {
      if (!rank || !world) throw std::runtime_error("RANK or WORLD_SIZE is not set");
      ::unsetenv(kChildVariable);  // a spawn() inside fn starts a job of its own
      fn(std::atoi(rank), std::atoi(world));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tandem::spawn: rank %s failed: %s\n", rank ? rank : "?", e.what());
      code = 1;
    } catch (...) {
      std::fprintf(stderr, "tandem::spawn: rank %s failed: an unknown exception\n",
                   rank ? rank : "?");
      code = 1;
    }
    std::fflush(nullptr);
    std::_Exit(code);
  }

  std::vector<std::string> args = {find_launcher(options), "--nproc-per-node",
                                   std::to_string(nprocs), own_executable()};
  const auto mine = own_arguments();
  for (size_t i = 1; i < mine.size(); ++i) args.push_back(mine[i]);
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    if (std::strncmp(*e, kChildVariable, std::strlen(kChildVariable)) != 0) env.emplace_back(*e);
  }
  env.push_back(std::string(kChildVariable) + "=1");
  auto argv = pointers(args);
  auto envp = pointers(env);

  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("tandem::spawn: cannot make a pipe");
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    throw std::runtime_error("tandem::spawn: cannot make a pipe");
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // the caller died: tandem-run stops the workers
    if (::getppid() != parent) ::_exit(127);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::execve(argv[0], argv.data(), envp.data());
    if (std::strchr(argv[0], '/') == nullptr) ::execvpe(argv[0], argv.data(), envp.data());
    const char msg[] = "tandem::spawn: cannot run tandem-run\n";
    ssize_t ignored = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
    (void)ignored;
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  if (pid < 0) {
    ::close(out[0]);
    ::close(err[0]);
    throw std::runtime_error(std::string("tandem::spawn: fork: ") + std::strerror(errno));
  }

  Relay relay;
  relay.keep = options.last_lines;
  Pipe pipes[2] = {{out[0], STDOUT_FILENO, {}}, {err[0], STDERR_FILENO, {}}};
  for (;;) {
    pollfd fds[2];
    int n = 0;
    Pipe* which[2];
    for (auto& p : pipes) {
      if (p.fd < 0) continue;
      fds[n] = {p.fd, POLLIN, 0};
      which[n++] = &p;
    }
    if (n == 0) break;
    if (::poll(fds, n, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < n; ++i) {
      if (fds[i].revents == 0) continue;
      Pipe& p = *which[i];
      char buf[65536];
      const ssize_t got = ::read(p.fd, buf, sizeof(buf));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        if (!p.pending.empty()) {
          write_all(p.sink, p.pending + "\n");
          relay.line(p.pending);
          p.pending.clear();
        }
        ::close(p.fd);
        p.fd = -1;
        continue;
      }
      p.pending.append(buf, static_cast<size_t>(got));
      size_t start = 0, nl;
      while ((nl = p.pending.find('\n', start)) != std::string::npos) {
        relay.line(p.pending.substr(start, nl - start));
        start = nl + 1;
      }
      write_all(p.sink, p.pending.substr(0, start));  // whole lines, as they came
      p.pending.erase(0, start);
    }
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;

  std::vector<std::string> last;
  std::string what;
  if (relay.failed_rank >= 0) {
    const auto& lines = relay.last[relay.failed_rank];
    last.assign(lines.begin(), lines.end());
    what = "tandem::spawn: rank " + std::to_string(relay.failed_rank) +
           (relay.signal ? " was killed by signal " + std::to_string(relay.signal) + " (" +
                               strsignal(relay.signal) + ")"
                         : " exited with code " + std::to_string(relay.exit_code));
  } else {
    last.assign(relay.launcher_lines.begin(), relay.launcher_lines.end());
    what = "tandem::spawn: the launcher (" + args[0] + ") " +
           (WIFEXITED(status) ? "exited with code " + std::to_string(WEXITSTATUS(status))
                              : "was killed by a signal");
  }
  if (!last.empty()) {
    what += "; its last lines:";
    for (const auto& l : last) what += "\n  " + l;
  }
  throw SpawnError(what, relay.failed_rank, relay.failed_rank >= 0 ? relay.exit_code : -1,
                   relay.signal, std::move(last));
}

}  // namespace tandem
