// Where a CUDA tensor's trip between two processes on one GPU spends its time,
// measured on the CUDA runtime alone (no LibTorch, no Tandem): each primitive
// that an IPC transfer is made of, then whole echoes of a 1 MiB buffer in
// the shapes a transport could take. The parent is the caller, a forked child
// the callee; they talk over a socketpair (the host side of any transport).
//
// Built and run by tools/gpu_session.sh probe (nvcc -O2); not part of the
// CMake build, as it needs nvcc and a GPU.
//
// Prints one JSON line per figure:
//   {"bench":"cuda_ipc_probe","op":"...","bytes":N,"p50_us":..,"p99_us":..}
// and one {"bench":"cuda_ipc_probe","op":"mem_handle_stable","value":true|false}.
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

namespace {

constexpr size_t kBytes = 1 << 20;
constexpr int kIters = 300;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "cuda_ipc_probe: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
#define CK(x) check((x), #x)

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void report(const char* op, std::vector<double> s, size_t bytes = kBytes) {
  std::sort(s.begin(), s.end());
  const double p50 = s[s.size() / 2];
  const double p99 = s[std::min(s.size() - 1, s.size() * 99 / 100)];
  std::printf("{\"bench\":\"cuda_ipc_probe\",\"op\":\"%s\",\"bytes\":%zu,\"p50_us\":%.2f,"
              "\"p99_us\":%.2f}\n",
              op, bytes, p50, p99);
  std::fflush(stdout);
}

std::vector<double> time_each(int n, const std::function<void()>& f) {
  std::vector<double> s;
  for (int i = 0; i < n + 10; ++i) {
    const double t0 = now_us();
    f();
    const double t1 = now_us();
    if (i >= 10) s.push_back(t1 - t0);
  }
  return s;
}

void send_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t k = ::send(fd, c, n, 0);
    if (k <= 0) std::exit(3);
    c += k;
    n -= static_cast<size_t>(k);
  }
}
void recv_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = ::recv(fd, c, n, 0);
    if (k <= 0) std::exit(3);
    c += k;
    n -= static_cast<size_t>(k);
  }
}

// What crosses the socket for one transfer.
struct Ref {
  cudaIpcMemHandle_t mem;
  cudaIpcEventHandle_t event;
  // 0 stop, 1 echo with a host wait, 2 echo ordered on the GPU, 3 ping, 4 open
  // a fresh handle, 5 echo with no interprocess event, 6 the peer's event
  // waited on the host
  int op;
};

// The primitives, in one process.
void local_primitives() {
  CK(cudaSetDevice(0));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  void* a = nullptr;
  void* b = nullptr;
  CK(cudaMalloc(&a, kBytes));
  CK(cudaMalloc(&b, kBytes));

  cudaIpcMemHandle_t first, h;
  CK(cudaIpcGetMemHandle(&first, a));
  bool stable = true;
  report("get_mem_handle", time_each(kIters, [&] {
           CK(cudaIpcGetMemHandle(&h, a));
           stable = stable && std::memcmp(&h, &first, sizeof h) == 0;
         }));
  std::printf("{\"bench\":\"cuda_ipc_probe\",\"op\":\"mem_handle_stable\",\"value\":%s}\n",
              stable ? "true" : "false");

  report("event_create_ipc_and_handle", time_each(100, [&] {
           cudaEvent_t e;
           cudaIpcEventHandle_t eh;
           CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess));
           CK(cudaIpcGetEventHandle(&eh, e));
           CK(cudaEventDestroy(e));
         }));

  cudaEvent_t plain, ipc;
  CK(cudaEventCreateWithFlags(&plain, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&ipc, cudaEventDisableTiming | cudaEventInterprocess));
  report("event_record_ipc", time_each(kIters, [&] { CK(cudaEventRecord(ipc, st)); }));
  CK(cudaStreamSynchronize(st));
  report("event_record_plain", time_each(kIters, [&] { CK(cudaEventRecord(plain, st)); }));
  CK(cudaStreamSynchronize(st));
  report("copy_1mib_stream_sync", time_each(kIters, [&] {
           CK(cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice, st));
           CK(cudaStreamSynchronize(st));
         }));
  report("copy_1mib_plain_event_sync", time_each(kIters, [&] {
           CK(cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice, st));
           CK(cudaEventRecord(plain, st));
           CK(cudaEventSynchronize(plain));
         }));
  report("copy_1mib_ipc_event_sync", time_each(kIters, [&] {
           CK(cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice, st));
           CK(cudaEventRecord(ipc, st));
           CK(cudaEventSynchronize(ipc));
         }));
  report("copy_1mib_ipc_event_query_spin", time_each(kIters, [&] {
           CK(cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice, st));
           CK(cudaEventRecord(ipc, st));
           while (cudaEventQuery(ipc) == cudaErrorNotReady) {
           }
         }));
  report("wait_event_ipc_enqueue", time_each(kIters, [&] { CK(cudaStreamWaitEvent(st, ipc, 0)); }));
  CK(cudaStreamSynchronize(st));
  report("malloc_free_1mib", time_each(100, [&] {
           void* p = nullptr;
           CK(cudaMalloc(&p, kBytes));
           CK(cudaFree(p));
         }));
  CK(cudaEventDestroy(plain));
  CK(cudaEventDestroy(ipc));
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaStreamDestroy(st));
}

// The callee: copies what each Ref names into its own buffer, then answers.
int callee(int fd) {
  CK(cudaSetDevice(0));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  void* mine = nullptr;
  CK(cudaMalloc(&mine, kBytes));
  cudaEvent_t done, out;
  CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&out, cudaEventDisableTiming | cudaEventInterprocess));
  Ref answer{};
  CK(cudaIpcGetMemHandle(&answer.mem, mine));
  CK(cudaIpcGetEventHandle(&answer.event, out));
  void* peer = nullptr;
  cudaEvent_t peer_event = nullptr;
  cudaIpcMemHandle_t peer_mem{};
  std::vector<double> opens;
  for (;;) {
    Ref r;
    recv_all(fd, &r, sizeof r);
    if (r.op == 0) break;
    if (r.op == 3) {
      send_all(fd, &answer, sizeof answer);
      continue;
    }
    if (r.op == 4) {  // a fresh allocation's handle: open, time, close
      void* p = nullptr;
      const double t0 = now_us();
      CK(cudaIpcOpenMemHandle(&p, r.mem, cudaIpcMemLazyEnablePeerAccess));
      const double t1 = now_us();
      CK(cudaIpcCloseMemHandle(p));
      const double t2 = now_us();
      opens.push_back(t1 - t0);
      opens.push_back(t2 - t1);
      send_all(fd, &answer, sizeof answer);
      continue;
    }
    if (!peer || std::memcmp(&peer_mem, &r.mem, sizeof peer_mem) != 0) {
      if (peer) CK(cudaIpcCloseMemHandle(peer));
      CK(cudaIpcOpenMemHandle(&peer, r.mem, cudaIpcMemLazyEnablePeerAccess));
      peer_mem = r.mem;
    }
    if (!peer_event) CK(cudaIpcOpenEventHandle(&peer_event, r.event));
    if (r.op == 6) {
      CK(cudaEventSynchronize(peer_event));
    } else if (r.op != 5) {
      CK(cudaStreamWaitEvent(st, peer_event, 0));
    }
    CK(cudaMemcpyAsync(mine, peer, kBytes, cudaMemcpyDeviceToDevice, st));
    if (r.op == 5) {  // ready when the answer goes: the caller needs no event of ours
      CK(cudaEventRecord(done, st));
      CK(cudaEventSynchronize(done));
      send_all(fd, &answer, sizeof answer);
      continue;
    }
    if (r.op == 1) {  // as Tandem does today: the host waits for the copy before going on
      CK(cudaEventRecord(done, st));
      CK(cudaEventSynchronize(done));
    }
    CK(cudaEventRecord(out, st));  // the answer's bytes are ready after this
    send_all(fd, &answer, sizeof answer);
  }
  // The open and close times of fresh handles, back to the parent.
  int n = static_cast<int>(opens.size());
  send_all(fd, &n, sizeof n);
  if (n > 0) send_all(fd, opens.data(), sizeof(double) * opens.size());
  if (peer) CK(cudaIpcCloseMemHandle(peer));
  return 0;
}

void caller(int fd) {
  CK(cudaSetDevice(0));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  void* a = nullptr;
  void* back = nullptr;
  CK(cudaMalloc(&a, kBytes));
  CK(cudaMalloc(&back, kBytes));
  CK(cudaMemset(a, 1, kBytes));
  cudaEvent_t written, done;
  CK(cudaEventCreateWithFlags(&written, cudaEventDisableTiming | cudaEventInterprocess));
  CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  Ref r{};
  CK(cudaIpcGetMemHandle(&r.mem, a));
  CK(cudaIpcGetEventHandle(&r.event, written));
  CK(cudaDeviceSynchronize());

  report("socket_round_trip", time_each(kIters, [&] {
           r.op = 3;
           send_all(fd, &r, sizeof r);
           Ref ans;
           recv_all(fd, &ans, sizeof ans);
         }),
         0);

  void* peer = nullptr;
  cudaEvent_t peer_event = nullptr;
  auto echo = [&](int op, bool handle_each_time) {
    return [&, op, handle_each_time] {
      if (handle_each_time) CK(cudaIpcGetMemHandle(&r.mem, a));
      CK(cudaEventRecord(written, st));
      r.op = op;
      send_all(fd, &r, sizeof r);
      Ref ans;
      recv_all(fd, &ans, sizeof ans);
      if (!peer) CK(cudaIpcOpenMemHandle(&peer, ans.mem, cudaIpcMemLazyEnablePeerAccess));
      if (!peer_event) CK(cudaIpcOpenEventHandle(&peer_event, ans.event));
      CK(cudaStreamWaitEvent(st, peer_event, 0));
      CK(cudaMemcpyAsync(back, peer, kBytes, cudaMemcpyDeviceToDevice, st));
      CK(cudaEventRecord(done, st));
      CK(cudaEventSynchronize(done));
    };
  };
  // No interprocess event at all: each side waits for its own copy on the
  // host (a plain event) before the message goes, so the reader needs none.
  report("echo_plain_events_host_sync", time_each(kIters, [&] {
           CK(cudaEventRecord(done, st));
           CK(cudaEventSynchronize(done));
           r.op = 5;
           send_all(fd, &r, sizeof r);
           Ref ans;
           recv_all(fd, &ans, sizeof ans);
           if (!peer) CK(cudaIpcOpenMemHandle(&peer, ans.mem, cudaIpcMemLazyEnablePeerAccess));
           CK(cudaMemcpyAsync(back, peer, kBytes, cudaMemcpyDeviceToDevice, st));
           CK(cudaEventRecord(done, st));
           CK(cudaEventSynchronize(done));
         }));
  report("echo_ipc_event_host_sync", time_each(kIters, echo(6, false)));
  // The same bytes moved, but every copy made by the caller's process (the
  // callee only answers on the socket): what the GPU's switching between
  // the two processes' contexts costs the echoes above.
  report("echo_all_copies_in_caller", time_each(kIters, [&] {
           r.op = 3;
           send_all(fd, &r, sizeof r);
           Ref ans;
           recv_all(fd, &ans, sizeof ans);
           if (!peer) CK(cudaIpcOpenMemHandle(&peer, ans.mem, cudaIpcMemLazyEnablePeerAccess));
           CK(cudaMemcpyAsync(peer, a, kBytes, cudaMemcpyDeviceToDevice, st));
           CK(cudaMemcpyAsync(back, peer, kBytes, cudaMemcpyDeviceToDevice, st));
           CK(cudaEventRecord(done, st));
           CK(cudaEventSynchronize(done));
         }));
  report("echo_callee_host_waits", time_each(kIters, echo(1, false)));
  report("echo_callee_host_waits_handle_each_send", time_each(kIters, echo(1, true)));
  report("echo_gpu_ordered_only", time_each(kIters, echo(2, false)));

  // Fresh allocations: what opening (and closing) a handle costs the callee.
  std::vector<void*> fresh;
  for (int i = 0; i < 20; ++i) {
    void* p = nullptr;
    CK(cudaMalloc(&p, kBytes));
    fresh.push_back(p);
    Ref f{};
    CK(cudaIpcGetMemHandle(&f.mem, p));
    f.op = 4;
    send_all(fd, &f, sizeof f);
    Ref ans;
    recv_all(fd, &ans, sizeof ans);
  }
  Ref stop{};
  stop.op = 0;
  send_all(fd, &stop, sizeof stop);
  int n = 0;
  recv_all(fd, &n, sizeof n);
  std::vector<double> times(static_cast<size_t>(n));
  if (n > 0) recv_all(fd, times.data(), sizeof(double) * times.size());
  std::vector<double> open_t, close_t;
  for (size_t i = 0; i + 1 < times.size(); i += 2) {
    open_t.push_back(times[i]);
    close_t.push_back(times[i + 1]);
  }
  if (!open_t.empty()) {
    report("open_mem_handle_fresh", open_t);
    report("close_mem_handle", close_t);
  }
  for (void* p : fresh) CK(cudaFree(p));
  if (peer) CK(cudaIpcCloseMemHandle(peer));
}

}  // namespace

int main() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 2;
  // Fork before any CUDA call: a CUDA context does not survive fork.
  const pid_t child = ::fork();
  if (child < 0) return 2;
  if (child == 0) {
    ::close(sv[0]);
    return callee(sv[1]);
  }
  ::close(sv[1]);
  // The child initialises CUDA while the parent does: the primitives run
  // first, then the cross-process part.
  local_primitives();
  caller(sv[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
