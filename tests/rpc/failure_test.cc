// Hostile and broken peers: raw bytes written to a live agent's socket. Each
// bad frame must close that one connection (with a logged protocol error)
// while the agent keeps serving everyone else.
#include "test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fcntl.h>
#include <sys/resource.h>

#include <fstream>
#include <optional>

#include "rpc/frames.h"
#include "tandem/rpc/agent/testing.h"
#include "tandem/rpc/common/auth.h"

using namespace tandem;
using namespace tandem::rpc;
using namespace std::chrono_literals;
using test::frame_bytes;
using test::raw_frame;

namespace {

int dial(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  return fd;
}

void write_all(int fd, const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;  // the agent may close on us mid-write: that is the point
    off += n;
  }
}

// True when the peer closes the connection within `wait` (reads and discards
// whatever arrives before that).
bool closed_by_peer(int fd, std::chrono::milliseconds wait) {
  auto until = std::chrono::steady_clock::now() + wait;
  char buf[4096];
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) > 0) {
      ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) return true;
    }
  }
  return false;
}

Message hello(int step, const std::string& worker, int rank) {
  Message h;
  h.kind = MessageKind::kHello;
  h.hello_step = static_cast<uint8_t>(step);
  h.hello_worker = worker;
  h.hello_rank = rank;
  return h;
}

// The next frame the peer writes on `fd`, or nothing within `wait`.
std::optional<Message> read_frame(int fd, std::chrono::milliseconds wait = 2000ms) {
  FrameDecoder dec{Limits{}};
  auto until = std::chrono::steady_clock::now() + wait;
  char buf[4096];
  while (!dec.has_message() && std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    dec.feed(buf, n);
  }
  if (!dec.has_message()) return std::nullopt;
  return dec.take();
}

// Plays a dialer's part of the handshake (rpc/common/auth.h) on `fd` as `worker`
// with `token`. Returns the agent's step 2 (checked against `token`).
Message greet(int fd, const std::string& worker, int rank, const std::string& token) {
  Message h = hello(1, worker, rank);
  h.hello_nonce = random_bytes(kNonceBytes);
  write_all(fd, frame_bytes(encode(h)));
  auto answer = read_frame(fd);
  REQUIRE(answer.has_value());
  REQUIRE(answer->hello_step == 2);
  CHECK(answer->hello_proof ==
        acceptor_proof(token, h.hello_nonce, answer->hello_nonce, rank, answer->hello_rank));
  Message proof = hello(3, worker, rank);
  proof.hello_proof =
      dialer_proof(token, h.hello_nonce, answer->hello_nonce, rank, answer->hello_rank);
  write_all(fd, frame_bytes(encode(proof)));
  return *answer;
}

// A request to "echo" with call id `id`, as a raw client writes it.
std::string echo_request(uint64_t id, c10::IValue value) {
  Message req;
  req.kind = MessageKind::kRequest;
  req.id = id;
  req.callee = "echo";
  req.values = {std::move(value)};
  return frame_bytes(encode(req));
}

// Reads the answer to echo_request(id, value) from `fd` and checks it.
void expect_echo(int fd, uint64_t id, int64_t value) {
  auto reply = read_frame(fd);
  REQUIRE(reply.has_value());
  CHECK(reply->kind == MessageKind::kResponse);
  CHECK(reply->id == id);
  CHECK(reply->values.at(0).toInt() == value);
}

}  // namespace

TEST_CASE("failure: bad frames close only the offending connection") {
  test::World w(
      2, [](Registry& r) { r.def("echo", [](c10::IValue v) { return v; }); },
      [](AgentOptions& o) { o.token = "secret"; });
  const int port = w[1].info().port;
  // A good client first, so we can see it keeps working.
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 1) == 1);

  // What a raw client writes; with `greeted`, after a full handshake.
  struct Case {
    std::string what;
    std::string bytes;
    bool greeted = true;
  };
  std::vector<Case> cases;
  Preamble bad_magic;
  bad_magic.magic = 0xdeadbeef;
  bad_magic.envelope_bytes = 64;
  cases.push_back(
      {"bad magic", std::string(reinterpret_cast<char*>(&bad_magic), sizeof(bad_magic)), false});
  Preamble old_version;
  old_version.version = 1;  // sent the token itself
  old_version.envelope_bytes = 64;
  cases.push_back({"wire version 1",
                   std::string(reinterpret_cast<char*>(&old_version), sizeof(old_version)), false});
  Preamble huge;
  huge.envelope_bytes = 0xfffffff8u;
  cases.push_back({"impossible envelope length",
                   std::string(reinterpret_cast<char*>(&huge), sizeof(huge)), false});
  Preamble body;
  body.envelope_bytes = 64;
  body.body_bytes = 1ull << 60;
  cases.push_back(
      {"impossible body length", std::string(reinterpret_cast<char*>(&body), sizeof(body)), false});
  cases.push_back({"unknown dtype", raw_frame(
                                        [](auto env) {
                                          auto t = env.initTensors(1)[0];
                                          t.setDtype(123);
                                        },
                                        0)});
  cases.push_back({"byte length not matching the shape",
                   raw_frame(
                       [](auto env) {
                         auto t = env.initTensors(1)[0];
                         t.setDtype(static_cast<int16_t>(c10::ScalarType::Float));
                         t.initSizes(1).set(0, 1000);
                         t.initStrides(1).set(0, 1);
                         t.setByteLength(8);
                         env.initValues(1)[0].setTensor(0);
                       },
                       8)});
  cases.push_back({"capnp nesting over its limit", raw_frame(
                                                       [](auto env) {
                                                         auto v = env.initValues(1)[0];
                                                         for (int i = 0; i < 200; ++i)
                                                           v = v.initTuple(1)[0];
                                                         v.setInt(0);
                                                       },
                                                       0)});
  cases.push_back({"a request before the handshake",
                   raw_frame([](auto env) { env.initValues(1)[0].setInt(1); }, 0), false});
  Message unknown = hello(1, "mallory", 0);
  unknown.hello_nonce = std::string(kNonceBytes, 'n');
  cases.push_back({"a handshake naming an unknown worker", frame_bytes(encode(unknown)), false});
  Message short_nonce = hello(1, "worker0", 0);
  short_nonce.hello_nonce = "n";
  cases.push_back({"a handshake with a short nonce", frame_bytes(encode(short_nonce)), false});
  Message early_proof = hello(3, "worker0", 0);
  early_proof.hello_proof = std::string(kProofBytes, 'p');
  cases.push_back({"a proof before the handshake began", frame_bytes(encode(early_proof)), false});
  cases.push_back({"a handshake again after it is done", frame_bytes(encode(unknown))});

  for (auto& c : cases) {
    INFO("case: " << c.what);
    int fd = dial(port);
    if (c.greeted) greet(fd, "worker0", 0, "secret");
    write_all(fd, c.bytes);
    CHECK(closed_by_peer(fd, 2000ms));
    ::close(fd);
    // Everyone else is still served.
    CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 7) == 7);
  }

  {  // A dialer with the wrong token gets step 2 and is closed after its proof.
    int fd = dial(port);
    Message h = hello(1, "worker0", 0);
    h.hello_nonce = random_bytes(kNonceBytes);
    write_all(fd, frame_bytes(encode(h)));
    auto answer = read_frame(fd);
    REQUIRE(answer.has_value());
    CHECK(answer->hello_worker == "worker1");
    Message proof = hello(3, "worker0", 0);
    proof.hello_proof = dialer_proof("guess", h.hello_nonce, answer->hello_nonce, 0, 1);
    write_all(fd, frame_bytes(encode(proof)) + echo_request(1, int64_t(5)));
    CHECK(closed_by_peer(fd, 2000ms));  // and no reply came
    ::close(fd);
  }

  // A well-formed raw client with the token is served, and a frame cut off
  // mid-way just closes quietly.
  int fd = dial(port);
  greet(fd, "worker0", 0, "secret");
  write_all(fd, echo_request(99, int64_t(5)));
  expect_echo(fd, 99, 5);
  std::string partial = echo_request(99, int64_t(5));
  write_all(fd, partial.substr(0, partial.size() / 2));
  ::close(fd);
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 8) == 8);
  w.shutdown();
}

TEST_CASE("failure: a message whose tensors cannot be placed on their device fails alone") {
  // This process says it has one CUDA device (rpc/agent/testing.h): a frame for
  // cuda:0 passes the decoder's check, and placing its tensor there fails,
  // as a CUDA error (out of memory, say) would on a GPU machine.
  struct Devices {
    Devices() { testing::set_cuda_devices(1); }
    ~Devices() { testing::set_cuda_devices(-1); }
  } fake;
  if (at::hasCUDA()) {
    std::printf("skipped: this machine has a GPU, where the placement would succeed\n");
    return;
  }
  test::World w(
      2, [](Registry& r) { r.def("echo", [](c10::IValue v) { return v; }); },
      [](AgentOptions& o) { o.token = "secret"; });
  int fd = dial(w[1].info().port);
  greet(fd, "worker0", 0, "secret");
  write_all(fd, raw_frame(
                    [](auto env) {
                      env.setId(5);
                      env.setCallee("echo");
                      test::one_float_for_device(env, static_cast<int16_t>(c10::DeviceType::CUDA),
                                                 0);
                    },
                    4, std::string(4, 'x')));
  auto reply = read_frame(fd);
  REQUIRE(reply.has_value());
  CHECK(reply->kind == MessageKind::kError);
  CHECK(reply->id == 5);
  CHECK(reply->error_message.find("the request could not place its tensors on their devices on "
                                  "worker1") != std::string::npos);
  // The connection stays up: the next request on it is served.
  write_all(fd, echo_request(6, int64_t(9)));
  expect_echo(fd, 6, 9);
  ::close(fd);
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 3) == 3);
  w.shutdown();
}

TEST_CASE("failure: a caller with a different cluster token is refused") {
  // worker0 carries no token; worker1 wants one: the handshake fails and the
  // call ends with Disconnected instead of hanging.
  test::World w(
      2, [](Registry& r) { r.def("echo", [](c10::IValue v) { return v; }); },
      [](AgentOptions& o) { o.token = o.rank == 1 ? "secret" : "other"; });
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(w[0].rpc_sync("worker1", "echo", 1), DisconnectedError);
  CHECK(std::chrono::steady_clock::now() - t0 < 2000ms);
  w.shutdown(false);
}

namespace {

// Everything this process writes to stderr while it lives (fd 2 points at a
// temporary file meanwhile).
class CaptureStderr {
 public:
  CaptureStderr() : file_(std::tmpfile()) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    ::dup2(::fileno(file_), 2);
  }
  ~CaptureStderr() {
    restore();
    std::fclose(file_);
  }
  CaptureStderr(const CaptureStderr&) = delete;
  CaptureStderr& operator=(const CaptureStderr&) = delete;
  // What was written so far; stderr is back where it was after this.
  std::string text() {
    restore();
    std::string out;
    std::rewind(file_);
    char buf[4096];
    while (size_t n = std::fread(buf, 1, sizeof(buf), file_)) out.append(buf, n);
    return out;
  }

 private:
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }
  FILE* file_;
  int saved_ = -1;
};

// Lines of `s` (with `with` empty), or how often `with` occurs in it.
size_t count_lines(const std::string& s, const std::string& with) {
  size_t n = 0, pos = 0;
  while ((pos = s.find('\n', pos)) != std::string::npos) ++pos, ++n;
  if (with.empty()) return n;
  n = 0;
  pos = 0;
  while ((pos = s.find(with, pos)) != std::string::npos) ++pos, ++n;
  return n;
}

}  // namespace

TEST_CASE("failure: peer-chosen names are escaped in the log, and bad peers cannot flood it") {
  test::World w(2, [](Registry& r) { r.def("echo", [](c10::IValue v) { return v; }); });
  const int port = w[1].info().port;
  std::string log;
  {
    CaptureStderr capture;
    Message forged = hello(1, "x\n[0]: FORGED\x1b[31m\xff", 0);
    forged.hello_nonce = std::string(kNonceBytes, 'n');
    for (int i = 0; i < 40; ++i) {
      int fd = dial(port);
      write_all(fd, frame_bytes(encode(forged)));
      CHECK(closed_by_peer(fd, 2000ms));
      ::close(fd);
    }
    CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 3) == 3);
    log = capture.text();
  }
  INFO("log: " << log);
  // One line per written report, none forged, no escape byte reaches the terminal.
  CHECK(log.find("\n[0]: FORGED") == std::string::npos);
  CHECK(log.find('\x1b') == std::string::npos);
  CHECK(log.find('\xff') == std::string::npos);
  CHECK(log.find("x\\n[0]: FORGED\\x1b[31m\\xff") != std::string::npos);
  // 40 bad peers within a second: at most the burst of 10 lines.
  CHECK(count_lines(log, "handshake rejected") == 10);
  CHECK(count_lines(log, "") == 10);
  w.shutdown();
}

TEST_CASE("failure: a planted rendezvous entry learns nothing, and the job fails clearly") {
  // Someone who can write to the store plants worker1's entry, pointing at
  // its own socket, before the real worker1 registers.
  int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  REQUIRE(::listen(lfd, 4) == 0);
  socklen_t len = sizeof(a);
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  const int fake_port = ntohs(a.sin_port);
  // The impostor answers step 1 as worker1 would, with a proof it cannot
  // make, and records everything it is sent.
  std::string heard;
  std::thread impostor([&] {
    int fd = ::accept(lfd, nullptr, nullptr);
    if (fd < 0) return;
    FrameDecoder dec{Limits{}};
    auto until = std::chrono::steady_clock::now() + 3s;
    bool answered = false;
    char buf[4096];
    while (std::chrono::steady_clock::now() < until) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      heard.append(buf, n);
      if (!answered) {
        dec.feed(buf, n);
        if (dec.has_message()) {
          Message h = hello(2, "worker1", 1);
          h.hello_nonce = random_bytes(kNonceBytes);
          h.hello_proof = random_bytes(kProofBytes);
          write_all(fd, frame_bytes(encode(h)));
          answered = true;
        }
      }
    }
    ::close(fd);
  });

  auto store = support::store_server();
  const std::string planted = "worker1\t127.0.0.1\t" + std::to_string(fake_port);
  store->set("tandem/worker/1", std::vector<uint8_t>(planted.begin(), planted.end()));
  auto reg = std::make_shared<Registry>();
  reg->def("echo", [](c10::IValue v) { return v; });
  auto options = [](int rank) {
    AgentOptions o;
    o.rank = rank;
    o.world_size = 2;
    o.token = "the-cluster-secret";
    return o;
  };
  auto a0 = Agent::create(options(0), reg, support::store_client(store->getPort()));
  // The real worker1 finds its entry taken and refuses to start, saying why.
  CHECK_THROWS_WITH_AS(Agent::create(options(1), reg, support::store_client(store->getPort())),
                       doctest::Contains("was written by someone else"), std::runtime_error);
  // worker0 dialed the planted address: the impostor cannot prove the token,
  // so the call fails at once, and nothing of it, nor the token, went out.
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(a0->rpc_sync("worker1", "echo", std::string("PAYLOAD-7f3a")),
                       doctest::Contains("did not prove the cluster token"), DisconnectedError);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  a0->shutdown(false);
  a0.reset();
  impostor.join();
  ::close(lfd);
  CHECK_FALSE(heard.empty());  // it was dialed, and heard step 1 and nothing else
  CHECK(heard.find("the-cluster-secret") == std::string::npos);
  CHECK(heard.find("PAYLOAD-7f3a") == std::string::npos);
  FrameDecoder dec{Limits{}};
  dec.feed(heard.data(), heard.size());
  REQUIRE(dec.has_message());
  CHECK(dec.take().hello_step == 1);
  CHECK_FALSE(dec.has_message());
}

namespace {
// This process's (or `pid`'s) resident memory, in MiB.
long rss_mib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6)) / 1024;
  }
  return -1;
}
}  // namespace

TEST_CASE("failure: a peer that sends requests but never reads cannot grow a worker's memory") {
  // 256 echo requests of 1 MiB, and not one answer read: the worker holds
  // what arrives once 32 MiB of answers wait, stops reading past 32 MiB
  // more, and serves everything once the answers are read.
  test::ChildWorker child("serve");
  auto agent = child.parent_agent(30s);
  const int port = agent->get_worker_info("worker1").port;
  CHECK(agent->rpc_sync<int64_t>("worker1", "pid") == child.pid);
  const long before = rss_mib(child.pid);

  int fd = dial(port);
  greet(fd, "worker0", 0, "");
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  constexpr int kRequests = 256;
  const at::Tensor mib = at::arange(1 << 18, at::kFloat);  // 1 MiB
  auto request = [&](int i) { return echo_request(static_cast<uint64_t>(i + 1), mib); };
  // Writes until all went or the worker has taken nothing for a second.
  int next = 0;
  std::string pending;
  size_t pending_off = 0;
  auto write_more = [&](std::chrono::milliseconds stall) {
    auto last_progress = std::chrono::steady_clock::now();
    while (next < kRequests || pending_off < pending.size()) {
      if (pending_off == pending.size()) {
        pending = request(next++);
        pending_off = 0;
      }
      ssize_t n =
          ::send(fd, pending.data() + pending_off, pending.size() - pending_off, MSG_NOSIGNAL);
      if (n > 0) {
        pending_off += static_cast<size_t>(n);
        last_progress = std::chrono::steady_clock::now();
        continue;
      }
      if (std::chrono::steady_clock::now() - last_progress > stall) return false;
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 20);
    }
    return true;
  };
  CHECK_FALSE(write_more(1000ms));  // the worker stopped reading
  const long during = rss_mib(child.pid);
  INFO("worker RSS before " << before << " MiB, during the flood " << during << " MiB, " << next
                            << " requests begun");
  CHECK(next < kRequests);
  CHECK(during - before < 160);  // the bounds (32 + 32 MiB), kernel buffers, the pool's work
  CHECK(agent->rpc_sync<int64_t>("worker1", "read_pauses") >= 1);
  // Others are still served meanwhile.
  CHECK(agent->rpc_sync<int64_t>("worker1", "pid") == child.pid);

  // Now read: every request is answered, once (in the order the pool's
  // threads finish them).
  FrameDecoder dec{Limits{}};
  std::vector<char> buf(1 << 20);
  int answered = 0;
  std::set<uint64_t> ids;
  auto until = std::chrono::steady_clock::now() + 60s;
  while (answered < kRequests && std::chrono::steady_clock::now() < until) {
    write_more(0ms);
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
    if (n == 0) break;
    if (n < 0) continue;
    dec.feed(buf.data(), static_cast<size_t>(n));
    while (dec.has_message()) {
      Message m = dec.take();
      CHECK(m.kind == MessageKind::kResponse);
      CHECK(ids.insert(m.id).second);
      CHECK(at::equal(m.values.at(0).toTensor(), mib));
      ++answered;
    }
  }
  CHECK(answered == kRequests);
  REQUIRE(ids.size() == size_t(kRequests));
  CHECK(*ids.begin() == 1);
  CHECK(*ids.rbegin() == uint64_t(kRequests));
  ::close(fd);
  agent->shutdown(true);
  agent = nullptr;
  CHECK(child.wait() == 0);
}

TEST_CASE("failure: connections that never finish their handshake are closed, and capped") {
  test::World w(
      2, [](Registry& r) { r.def("echo", [](c10::IValue v) { return v; }); },
      [](AgentOptions& o) {
        o.limits.handshake_timeout = 300ms;
        o.limits.max_handshaking_connections = 8;
      });
  const int port = w[1].info().port;
  // Slow-loris: each sends one byte of a preamble and waits.
  std::vector<int> loris;
  for (int i = 0; i < 20; ++i) {
    loris.push_back(dial(port));
    write_all(loris.back(), std::string(1, 'T'));
  }
  // Past the cap, the newcomers are closed at once; the rest after the timeout.
  for (int fd : loris) CHECK(closed_by_peer(fd, 2000ms));
  for (int fd : loris) ::close(fd);
  const TransportStats s = w[1].transport_stats();
  CHECK(s.refused_connections >= 12 - 1);  // (one may race the first ones' handshakes)
  CHECK(s.handshake_timeouts >= 8 - 1);
  CHECK(s.refused_connections + s.handshake_timeouts >= 20);
  // A well-behaved peer is served all along.
  auto t0 = std::chrono::steady_clock::now();
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 4) == 4);
  CHECK(std::chrono::steady_clock::now() - t0 < 1s);
  w.shutdown();
}

TEST_CASE("failure: out of file descriptors, a worker backs off instead of spinning") {
  test::World w(2, [](Registry& r) { r.def("echo", [](c10::IValue v) { return v; }); });
  const int port = w[1].info().port;
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 1) == 1);
  rlimit saved{};
  ::getrlimit(RLIMIT_NOFILE, &saved);
  std::vector<int> held;
  {
    // Fill the descriptor table: dial until this process has no fd left (the
    // kernel completes connections the worker can then not accept).
    rlimit tight = saved;
    tight.rlim_cur = static_cast<rlim_t>(test::fds().size() + 16);
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &tight) == 0);
    for (;;) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) break;
      held.push_back(fd);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(port);
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    }
    rusage r0{}, r1{};
    ::getrusage(RUSAGE_SELF, &r0);
    std::this_thread::sleep_for(500ms);  // the worker sits with connections it cannot accept
    ::getrusage(RUSAGE_SELF, &r1);
    auto cpu_ms = [](const rusage& r) {
      return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000.0 +
             (r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1000.0;
    };
    ::setrlimit(RLIMIT_NOFILE, &saved);
    INFO("CPU over 500 ms out of descriptors: " << cpu_ms(r1) - cpu_ms(r0) << " ms");
    CHECK(cpu_ms(r1) - cpu_ms(r0) < 150);  // a spinning loop thread burns ~500
  }
  CHECK(w[1].transport_stats().accept_backoffs >= 1);
  for (int fd : held) ::close(fd);
  // With descriptors back, it accepts again.
  auto t0 = std::chrono::steady_clock::now();
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 2) == 2);
  int fd = dial(port);
  greet(fd, "worker0", 0, "");
  ::close(fd);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  w.shutdown();
}
