// rpc_bench: round-trip latency and bandwidth of Tandem's RPC, next to the
// physical floor (two plain blocking TCP sockets doing the same ping-pong).
//
// Two processes on loopback, like bench/anchors/rpc_echo.py: this one is
// the caller (rank 0); it starts itself again as the callee (rank 1). For each
// size, the caller sends a float tensor of max(bytes/4, 1) elements to the
// callee's registered "echo" and gets it back.
//
// Prints one JSON line per size, implementation and transport (Tandem's
// lines are measured once over TCP and once over shared memory):
//   {"bench":"rpc_echo","impl":"tandem","transport":"tcp","bytes":N,"p50_us":..,"p99_us":..,"gbps":..}
//   {"bench":"rpc_echo","impl":"tandem","transport":"shm","bytes":N,...}
//   {"bench":"rpc_echo","impl":"raw_tcp","bytes":N,...}
// gbps counts the bytes that crossed in both directions. And, like
// bench/anchors/rref.py, for remote references:
//   {"bench":"remote_create","impl":"tandem","transport":..,"p50_us":..}   remote() until the owner
//   confirmed
//   {"bench":"rref_to_here","impl":"tandem","transport":..,"bytes":N,"p50_us":..}   N = 0 and 1 MiB
// And what one trace event costs, tracing on and off (rpc/trace.h):
//   {"bench":"trace_event","impl":"tandem","on_ns":..,"off_ns":..}
// And what a call costs when both sides have slept (a model-parallel step's
// calls come between milliseconds of compute, not back to back): the 0-byte
// echo after the caller idled for idle_us, next to the machine's floor, one
// byte there and back through two pipes between two processes pinned to two
// cores (two wake-ups of a sleeping process on another core):
//   {"bench":"rpc_echo_cold","impl":"tandem","transport":..,"idle_us":1000,"p50_us":..}
//   {"bench":"rpc_echo_cold","impl":"raw_pipe","idle_us":1000,"p50_us":..}
// The floor under the back-to-back 0 B echo over shared memory: a word
// there and back between two processes spinning on two cores:
//   {"bench":"spin_floor","impl":"raw_spin","bytes":0,"p50_us":..}
// And what an idle job costs: the CPU time (getrusage) each process used
// over --idle-s seconds (10; 0: not measured) with both agents connected
// and nothing to do, in the first round, as a percentage of one core:
//   {"bench":"idle_cpu","impl":"tandem","transport":..,"idle_s":10,"caller_core_pct":..,
//    "callee_core_pct":..}
//
// Loopback latency on a small machine is bimodal: it depends on which cores
// the scheduler gives the two processes. So the whole measurement is repeated
// in --rounds fresh process pairs, Tandem and raw TCP alternating, and each
// figure is the median over rounds.
//
// With --device cuda (GPU machines), the echoed tensor lives on the caller's
// cuda:0 and arrives on the callee's cuda:0 (a device map {0: 0}); sizes
// default to 1 MiB, 64 MiB and 1 GiB, and the lines are
//   {"bench":"rpc_echo_cuda","impl":"tandem","transport":..,"bytes":N,"p50_us":..,"gbps":..}
// next to what plain copies on this GPU move (the ceiling):
//   {"bench":"cuda_copy","impl":"cuda","kind":"d2d"|"h2d_pinned"|"d2h_pinned","bytes":N,"gbps":..}
// (a copy's gbps counts its bytes once; the echo's, both directions).
// bench/anchors/rpc_echo_cuda.py is PyTorch's side (its 2.x, device maps).
//
// Usage: rpc_bench [--sizes 0,1024,1048576,16777216] [--rounds 5] [--transports tcp,shm]
//                  [--device cpu|cuda] [--connection-sleep 1|0] [--idle-s 10]
//                  [--iters N]
#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rref.h"
#include "tandem/rpc/stages.h"
#include "tests/support/local_job.h"

namespace {

namespace support = tandem::support;
using tandem::bench::median;
using tandem::bench::percentile;
using Clock = std::chrono::steady_clock;
using tandem::rpc::Agent;
using tandem::rpc::AgentOptions;
using tandem::rpc::Registry;

// --device cuda, in both processes (the callee learns it from the environment).
bool g_cuda = false;

int g_iters = 0;  // --iters: calls per size and round (0: by size, as below)

int iterations_for(int64_t bytes) {
  if (g_iters > 0) return g_iters;
  if (g_cuda) return bytes <= (1 << 20) ? 200 : bytes <= (64 << 20) ? 20 : 5;
  if (bytes <= 65536) return 2000;
  if (bytes <= (1 << 20)) return 200;
  return 40;
}

// One round's figures for one size.
struct Round {
  double p50 = 0, p99 = 0, mean = 0;
};

Round summarize(const std::vector<double>& lat_s) {
  Round r;
  for (double s : lat_s) r.mean += s;
  r.mean /= lat_s.size();
  r.p50 = percentile(lat_s, 0.5);
  r.p99 = percentile(lat_s, 0.99);
  return r;
}

void emit_p50(const char* bench, const std::string& transport, int64_t bytes,
              const std::vector<Round>& rounds) {
  std::vector<double> p50;
  for (const auto& r : rounds) p50.push_back(r.p50);
  if (bytes >= 0) {
    std::printf(
        "{\"bench\":\"%s\",\"impl\":\"tandem\",\"transport\":\"%s\",\"bytes\":%lld,"
        "\"p50_us\":%.1f,\"rounds\":%zu}\n",
        bench, transport.c_str(), static_cast<long long>(bytes), median(p50) * 1e6, rounds.size());
  } else {
    std::printf(
        "{\"bench\":\"%s\",\"impl\":\"tandem\",\"transport\":\"%s\",\"p50_us\":%.1f,"
        "\"rounds\":%zu}\n",
        bench, transport.c_str(), median(p50) * 1e6, rounds.size());
  }
  std::fflush(stdout);
}

void emit(const std::string& impl, const std::string& transport, int64_t bytes,
          const std::vector<Round>& rounds, const char* bench = "rpc_echo") {
  std::vector<double> p50, p99, mean;
  for (const auto& r : rounds) {
    p50.push_back(r.p50);
    p99.push_back(r.p99);
    mean.push_back(r.mean);
  }
  const std::string tr = transport.empty() ? "" : ",\"transport\":\"" + transport + "\"";
  std::printf(
      "{\"bench\":\"%s\",\"impl\":\"%s\"%s,\"bytes\":%lld,\"p50_us\":%.1f,\"p99_us\":%.1f,"
      "\"gbps\":%.3f,\"rounds\":%zu}\n",
      bench, impl.c_str(), tr.c_str(), static_cast<long long>(bytes), median(p50) * 1e6,
      median(p99) * 1e6, 2.0 * bytes / median(mean) / 1e9, rounds.size());
  std::fflush(stdout);
}

// ---- the raw TCP floor ----------------------------------------------------------

bool io_all(int fd, void* buf, size_t n, bool writing) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t k = writing ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k <= 0) return false;
    p += k;
    n -= k;
  }
  return true;
}

void nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Callee side: echo length-prefixed messages until the peer closes.
int raw_server(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return 1;
  nodelay(fd);
  std::vector<char> buf;
  uint64_t len = 0;
  while (io_all(fd, &len, sizeof(len), false)) {
    buf.resize(len);
    if (!io_all(fd, buf.data(), len, false)) break;
    if (!io_all(fd, &len, sizeof(len), true) || !io_all(fd, buf.data(), len, true)) break;
  }
  ::close(fd);
  return 0;
}

std::vector<Round> raw_client(const std::vector<int64_t>& sizes) {
  std::vector<Round> rounds;
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::listen(lfd, 1);
  socklen_t alen = sizeof(a);
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &alen);
  pid_t child = support::spawn_self(
      {"TANDEM_BENCH_ROLE=raw", "TANDEM_BENCH_PORT=" + std::to_string(ntohs(a.sin_port))});
  int fd = ::accept(lfd, nullptr, nullptr);
  ::close(lfd);
  nodelay(fd);
  for (int64_t bytes : sizes) {
    // Same payload as the RPC: a float tensor of max(bytes/4, 1) elements.
    uint64_t n = std::max<int64_t>(bytes / 4, 1) * 4;
    std::vector<char> out(n, 1), in(n);
    int iters = iterations_for(bytes);
    std::vector<double> lat;
    for (int i = 0; i < iters + 10; ++i) {
      auto t0 = Clock::now();
      uint64_t len = n;
      io_all(fd, &len, sizeof(len), true);
      io_all(fd, out.data(), n, true);
      io_all(fd, &len, sizeof(len), false);
      io_all(fd, in.data(), len, false);
      if (i >= 10) lat.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    rounds.push_back(summarize(lat));
  }
  ::close(fd);
  support::wait_exit(child);
  return rounds;
}

// ---- Tandem RPC ------------------------------------------------------------------

// The CPU time (user and system) this process's threads have used, in µs.
int64_t cpu_us() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  const auto us = [](const timeval& t) { return int64_t(t.tv_sec) * 1000000 + t.tv_usec; };
  return us(u.ru_utime) + us(u.ru_stime);
}

std::shared_ptr<Registry> registry() {
  auto reg = std::make_shared<Registry>();
  reg->def("echo", [](at::Tensor t) { return t; });
  reg->def("make", [](int64_t bytes) { return at::zeros({std::max<int64_t>(bytes / 4, 1)}); });
  reg->def("cpu_us", [] { return cpu_us(); });
  return reg;
}

AgentOptions options(int rank) {
  AgentOptions o;
  o.rank = rank;
  o.world_size = 2;
  o.num_worker_threads = 4;
  if (g_cuda && rank == 0) o.set_device_map("worker1", {{0, 0}});  // worker1 answers by its inverse
  return o;
}

int rpc_callee() {
  auto agent = tandem::rpc::init(registry(), options(1));
  tandem::rpc::shutdown(true);
  return 0;
}

struct TandemRound {
  std::vector<Round> echo;
  Round remote_create;
  std::vector<Round> to_here;  // one per kRRefSizes
  Round cold;                  // the 0-byte echo after kIdle asleep
  // What each process burned while the job idled (--idle-s), as a
  // percentage of one core; negative when not measured.
  double idle_caller_pct = -1, idle_callee_pct = -1;
};

int g_idle_s = 10;  // --idle-s

constexpr std::chrono::microseconds kIdle{1000};
constexpr int kColdCalls = 200;

const std::vector<int64_t> kRRefSizes = {0, 1 << 20};

// remote() until the owner confirmed, then to_here() of a held value.
void rref_round(Agent& agent, TandemRound& out) {
  std::vector<double> lat;
  for (int i = 0; i < 1010; ++i) {
    auto t0 = Clock::now();
    auto r = tandem::rpc::remote<at::Tensor>(agent, "worker1", "make", int64_t(0));
    r.wait_confirmed();
    if (i >= 10) lat.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  out.remote_create = summarize(lat);
  for (int64_t bytes : kRRefSizes) {
    auto r = tandem::rpc::remote<at::Tensor>(agent, "worker1", "make", bytes);
    r.to_here();
    int iters = bytes <= 65536 ? 1000 : 40;
    lat.clear();
    for (int i = 0; i < iters; ++i) {
      auto t0 = Clock::now();
      r.to_here();
      lat.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    out.to_here.push_back(summarize(lat));
  }
}

TandemRound rpc_caller(const std::vector<int64_t>& sizes, const std::string& transport,
                       bool idle) {
  TandemRound result;
  std::vector<Round>& out = result.echo;
  ::setenv("TANDEM_TRANSPORT", transport.c_str(), 1);  // for both processes
  pid_t child = tandem::bench::spawn_peer("rpc");
  auto agent = tandem::rpc::init(registry(), options(0));
  // A transport that does not do what was asked is no measurement of it.
  agent->rpc_sync<at::Tensor>("worker1", "echo", at::zeros({1}));
  if (agent->transport_to("worker1") != transport) {
    throw std::runtime_error("asked for transport " + transport + ", got " +
                             agent->transport_to("worker1"));
  }
  for (int64_t bytes : sizes) {
    at::Tensor t = at::zeros({std::max<int64_t>(bytes / 4, 1)},
                             at::TensorOptions().device(g_cuda ? at::kCUDA : at::kCPU));
    if (g_cuda && !agent->rpc_sync<at::Tensor>("worker1", "echo", t).is_cuda()) {
      throw std::runtime_error("a CUDA tensor's echo came back off the GPU");
    }
    int iters = iterations_for(bytes);
    for (int i = 0; i < 10; ++i) agent->rpc_sync<at::Tensor>("worker1", "echo", t);
    std::vector<double> lat;
    lat.reserve(iters);
    for (int i = 0; i < iters; ++i) {
      auto t0 = Clock::now();
      agent->rpc_sync<at::Tensor>("worker1", "echo", t);
      TANDEM_STAGE(kReturned);  // rpc/stages.h (compiled out unless asked for)
      lat.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    out.push_back(summarize(lat));
  }
  if (!g_cuda) {
    rref_round(*agent, result);
    std::vector<double> lat;
    const at::Tensor t = at::zeros({1});
    for (int i = 0; i < kColdCalls; ++i) {
      std::this_thread::sleep_for(kIdle);
      const auto t0 = Clock::now();
      agent->rpc_sync<at::Tensor>("worker1", "echo", t);
      TANDEM_STAGE(kReturned);  // rpc/stages.h (compiled out unless asked for)
      lat.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    result.cold = summarize(lat);
    if (idle && g_idle_s > 0) {
      // Both agents up, connected, and nothing to do.
      const int64_t callee0 = agent->rpc_sync<int64_t>("worker1", "cpu_us");
      const int64_t self0 = cpu_us();
      std::this_thread::sleep_for(std::chrono::seconds(g_idle_s));
      const int64_t callee1 = agent->rpc_sync<int64_t>("worker1", "cpu_us");
      const int64_t self1 = cpu_us();
      result.idle_caller_pct = 100.0 * double(self1 - self0) / (g_idle_s * 1e6);
      result.idle_callee_pct = 100.0 * double(callee1 - callee0) / (g_idle_s * 1e6);
    }
  }
  tandem::rpc::shutdown(true);
  support::wait_exit(child);
  return result;
}

// What plain copies of `bytes` move on this GPU, in GB/s (bytes once):
// device to device, and between the device and pinned host memory.
void cuda_ceilings(const std::vector<int64_t>& sizes) {
  for (int64_t bytes : sizes) {
    const int64_t n = std::max<int64_t>(bytes / 4, 1);
    at::Tensor a = at::zeros({n}, at::TensorOptions().device(at::kCUDA));
    at::Tensor b = at::empty_like(a);
    at::Tensor h = at::empty({n}, at::TensorOptions().pinned_memory(true));
    const int iters = iterations_for(bytes);
    auto gbps = [&](auto copy) {
      copy();
      torch::cuda::synchronize();
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) copy();
      torch::cuda::synchronize();
      return bytes * iters / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
    };
    const std::pair<const char*, double> kinds[] = {
        {"d2d", gbps([&] { b.copy_(a, true); })},
        {"h2d_pinned", gbps([&] { a.copy_(h, true); })},
        {"d2h_pinned", gbps([&] { h.copy_(a, true); })}};
    for (const auto& [kind, g] : kinds) {
      std::printf(
          "{\"bench\":\"cuda_copy\",\"impl\":\"cuda\",\"kind\":\"%s\",\"bytes\":%lld,"
          "\"gbps\":%.3f}\n",
          kind, static_cast<long long>(bytes), g);
    }
    std::fflush(stdout);
  }
}

// The first two CPUs this process may run on, and its whole set (to restore
// once a floor is measured); false on a machine of one core.
bool two_cpus(cpu_set_t& mine, int (&cpus)[2]) {
  if (::sched_getaffinity(0, sizeof mine, &mine) != 0 || CPU_COUNT(&mine) < 2) return false;
  int found = 0;
  for (int c = 0; c < CPU_SETSIZE && found < 2; ++c) {
    if (CPU_ISSET(c, &mine)) cpus[found++] = c;
  }
  return true;
}

void pin(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  (void)::sched_setaffinity(0, sizeof one, &one);
}

// The floor under a call between two sleeping processes: one byte to a child
// pinned to another core and back, through two pipes, after `idle` asleep.
// p50 in seconds; 0 on a machine of one core.
double pipe_wake(std::chrono::microseconds idle) {
  cpu_set_t mine;
  int cpus[2];
  if (!two_cpus(mine, cpus)) return 0;
  int there[2], back[2];
  if (::pipe(there) != 0) return 0;
  if (::pipe(back) != 0) {
    ::close(there[0]);
    ::close(there[1]);
    return 0;
  }
  const pid_t child = ::fork();
  if (child == 0) {  // only async-signal-safe calls from here
    ::close(there[1]);
    ::close(back[0]);
    pin(cpus[1]);
    char c;
    while (::read(there[0], &c, 1) == 1 && ::write(back[1], &c, 1) == 1) {
    }
    ::_exit(0);
  }
  ::close(there[0]);
  ::close(back[1]);
  std::vector<double> lat;
  if (child > 0) {
    pin(cpus[0]);
    for (int i = 0; i < kColdCalls; ++i) {
      if (idle.count() > 0) std::this_thread::sleep_for(idle);
      char c = 1;
      const auto t0 = Clock::now();
      if (::write(there[1], &c, 1) != 1 || ::read(back[0], &c, 1) != 1) break;
      lat.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    ::sched_setaffinity(0, sizeof mine, &mine);
  }
  ::close(there[1]);
  ::close(back[0]);
  if (child > 0) ::waitpid(child, nullptr, 0);
  return lat.empty() ? 0 : median(lat);
}

// The floor under a back-to-back call over shared memory: a word written
// in a shared mapping by one process, seen by another pinned to the other
// core that is spinning on it, and answered the same way (no system call,
// no wake-up: two cache-line transfers). p50 in seconds; 0 on one core.
double spin_round_trip() {
  cpu_set_t mine;
  int cpus[2];
  if (!two_cpus(mine, cpus)) return 0;
  struct Words {
    alignas(64) std::atomic<uint64_t> ping{0};
    alignas(64) std::atomic<uint64_t> pong{0};
  };
  void* at = ::mmap(nullptr, sizeof(Words), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                    -1, 0);
  if (at == MAP_FAILED) return 0;
  auto* w = new (at) Words;
  constexpr uint64_t kEnd = ~uint64_t(0);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child == 0) {  // only async-signal-safe calls from here
    pin(cpus[1]);
    uint64_t seen = 0;
    for (uint64_t spins = 0;; ++spins) {
      const uint64_t v = w->ping.load(std::memory_order_acquire);
      if (v == kEnd) break;
      if (v != seen) {
        seen = v;
        w->pong.store(v, std::memory_order_release);
      } else if ((spins & 0xfffff) == 0 && ::getppid() != parent) {
        break;  // the bench is gone
      }
    }
    ::_exit(0);
  }
  std::vector<double> lat;
  if (child > 0) {
    pin(cpus[0]);
    constexpr int kWarmup = 1000, kCalls = 20000;
    for (uint64_t i = 1; i <= kWarmup + kCalls; ++i) {
      const auto t0 = Clock::now();
      w->ping.store(i, std::memory_order_release);
      bool answered = true;
      for (uint64_t spins = 0; w->pong.load(std::memory_order_acquire) != i; ++spins) {
        if ((spins & 0xffff) == 0 && Clock::now() - t0 > std::chrono::seconds(1)) {
          answered = false;  // the other side was descheduled for good: no floor
          break;
        }
      }
      if (!answered) {
        lat.clear();
        break;
      }
      if (i > kWarmup) lat.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    w->ping.store(kEnd, std::memory_order_release);
    ::waitpid(child, nullptr, 0);
    ::sched_setaffinity(0, sizeof mine, &mine);
  }
  ::munmap(at, sizeof(Words));
  return lat.empty() ? 0 : median(lat);
}

void spin_floor() {
  const double p50 = spin_round_trip();
  if (p50 <= 0) return;  // one core, or no answer: no floor to give
  std::printf("{\"bench\":\"spin_floor\",\"impl\":\"raw_spin\",\"bytes\":0,\"p50_us\":%.2f}\n",
              p50 * 1e6);
  std::fflush(stdout);
}

void wake_floor() {
  const double p50 = pipe_wake(kIdle);
  if (p50 <= 0) return;  // one core: no floor to give
  std::printf(
      "{\"bench\":\"rpc_echo_cold\",\"impl\":\"raw_pipe\",\"idle_us\":%lld,\"p50_us\":%.1f}\n",
      static_cast<long long>(kIdle.count()), p50 * 1e6);
  std::fflush(stdout);
}

}  // namespace

// What one trace event costs (rpc/trace.h): a layer's slice with its args,
// as the engine and the optimizer write them, on and off.
void trace_cost() {
  const int n = 200000;
  auto per_event = [&](tandem::rpc::Tracer* tracer) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      tandem::rpc::TraceScope scope(tracer, "optim");
      if (scope.on()) {
        scope.set_name("optimizer step");
        scope.set_args("{\"context\":" + std::to_string(i) + "}");
      }
    }
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
           n;
  };
  const double off = per_event(nullptr);
  char dir[] = "/tmp/tandem-bench-trace-XXXXXX";
  if (!::mkdtemp(dir)) return;
  double on = 0;
  {
    tandem::rpc::Tracer tracer(dir, 0, "bench");
    on = per_event(&tracer);
  }  // writes its file: gone with the folder
  std::system((std::string("rm -rf ") + dir).c_str());
  std::printf("{\"bench\":\"trace_event\",\"impl\":\"tandem\",\"on_ns\":%.1f,\"off_ns\":%.1f}\n",
              on, off);
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  try {
    if (const char* role = std::getenv("TANDEM_BENCH_ROLE")) {
      unsetenv("TANDEM_BENCH_ROLE");
      if (std::strcmp(role, "raw") == 0)
        return raw_server(std::atoi(std::getenv("TANDEM_BENCH_PORT")));
      if (std::strcmp(role, "rpc") == 0) {
        const char* device = std::getenv("TANDEM_BENCH_DEVICE");
        g_cuda = device && std::strcmp(device, "cuda") == 0;
        return rpc_callee();
      }
      return 2;
    }
    std::vector<int64_t> list = {0, 1024, 1048576, 16777216};
    int rounds = 5;
    std::string transport_list = "tcp,shm";
    std::string device = "cpu";
    int connection_sleep = 1;
    tandem::bench::Flags flags("rpc_bench");
    flags.add("--sizes", &list, 0)
        .add("--rounds", &rounds, 1)
        .add("--transports", &transport_list)
        .add("--device", &device)
        .add("--connection-sleep", &connection_sleep, 0)
        .add("--idle-s", &g_idle_s, 0)
        .add("--iters", &g_iters, 0);
    if (!flags.parse(argc, argv)) return 2;
    // (for both processes: an A/B of Limits::sleep_on_connection)
    if (connection_sleep == 0) ::setenv("TANDEM_SLEEP_ON_CONNECTION", "0", 1);
    if (device != "cpu" && device != "cuda") {
      std::fprintf(stderr, "rpc_bench: --device takes cpu or cuda, not '%s'\n", device.c_str());
      return 2;
    }
    if (device == "cuda") {
      if (!torch::cuda::is_available()) {
        std::fprintf(stderr,
                     "rpc_bench: --device cuda: LibTorch sees no CUDA device on this "
                     "machine\n");
        return 2;
      }
      g_cuda = true;
      ::setenv("TANDEM_BENCH_DEVICE", "cuda", 1);  // for the callee
      bool given = false;
      for (int i = 1; i < argc; ++i) given = given || std::strcmp(argv[i], "--sizes") == 0;
      if (!given) list = {1 << 20, 64 << 20, int64_t(1) << 30};
      cuda_ceilings(list);
    }
    std::vector<std::string> transports;
    for (size_t at = 0; at <= transport_list.size();) {
      size_t comma = std::min(transport_list.find(',', at), transport_list.size());
      std::string t = transport_list.substr(at, comma - at);
      if (t != "tcp" && t != "shm") {
        std::fprintf(stderr, "rpc_bench: --transports takes tcp and/or shm, not '%s'\n", t.c_str());
        return 2;
      }
      transports.push_back(t);
      at = comma + 1;
    }
    const size_t nt = transports.size();
    std::vector<std::vector<std::vector<Round>>> ours(nt,
                                                      std::vector<std::vector<Round>>(list.size()));
    std::vector<std::vector<Round>> raw(list.size());
    std::vector<std::vector<Round>> creates(nt), colds(nt);
    std::vector<std::vector<std::vector<Round>>> to_here(
        nt, std::vector<std::vector<Round>>(kRRefSizes.size()));
    if (g_cuda) {
      for (int r = 0; r < rounds; ++r) {
        for (size_t k = 0; k < nt; ++k) {
          auto a = rpc_caller(list, transports[k], false);
          for (size_t i = 0; i < list.size(); ++i) ours[k][i].push_back(a.echo[i]);
        }
      }
      for (size_t k = 0; k < nt; ++k) {
        for (size_t i = 0; i < list.size(); ++i) {
          emit("tandem", transports[k], list[i], ours[k][i], "rpc_echo_cuda");
        }
      }
      return 0;
    }
    for (int r = 0; r < rounds; ++r) {
      for (size_t k = 0; k < nt; ++k) {
        auto a = rpc_caller(list, transports[k], /*idle=*/r == 0);
        for (size_t i = 0; i < list.size(); ++i) ours[k][i].push_back(a.echo[i]);
        if (a.idle_caller_pct >= 0) {
          std::printf(
              "{\"bench\":\"idle_cpu\",\"impl\":\"tandem\",\"transport\":\"%s\","
              "\"idle_s\":%d,\"caller_core_pct\":%.3f,\"callee_core_pct\":%.3f}\n",
              transports[k].c_str(), g_idle_s, a.idle_caller_pct, a.idle_callee_pct);
          std::fflush(stdout);
        }
        creates[k].push_back(a.remote_create);
        colds[k].push_back(a.cold);
        for (size_t i = 0; i < kRRefSizes.size(); ++i) to_here[k][i].push_back(a.to_here[i]);
      }
      auto b = raw_client(list);
      for (size_t i = 0; i < list.size(); ++i) raw[i].push_back(b[i]);
    }
    for (size_t k = 0; k < nt; ++k) {
      for (size_t i = 0; i < list.size(); ++i) emit("tandem", transports[k], list[i], ours[k][i]);
    }
    for (size_t i = 0; i < list.size(); ++i) emit("raw_tcp", "", list[i], raw[i]);
    for (size_t k = 0; k < nt; ++k) {
      emit_p50("remote_create", transports[k], -1, creates[k]);
      for (size_t i = 0; i < kRRefSizes.size(); ++i) {
        emit_p50("rref_to_here", transports[k], kRRefSizes[i], to_here[k][i]);
      }
    }
    for (size_t k = 0; k < nt; ++k) {
      std::vector<double> p50;
      for (const auto& r : colds[k]) p50.push_back(r.p50);
      std::printf(
          "{\"bench\":\"rpc_echo_cold\",\"impl\":\"tandem\",\"transport\":\"%s\","
          "\"idle_us\":%lld,\"p50_us\":%.1f,\"rounds\":%zu}\n",
          transports[k].c_str(), static_cast<long long>(kIdle.count()), median(p50) * 1e6,
          colds[k].size());
    }
    wake_floor();
    spin_floor();
    trace_cost();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rpc_bench: %s\n", e.what());
    return 1;
  }
}
