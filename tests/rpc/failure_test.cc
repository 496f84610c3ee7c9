// Hostile and broken peers: raw bytes written to a live agent's socket. Each
// bad frame must close that one connection (with a logged protocol error)
// while the agent keeps serving everyone else.
#include "test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "rpc/frames.h"

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

std::string hello(const std::string& worker, int rank, const std::string& token = "") {
  Message h;
  h.kind = MessageKind::kHello;
  h.hello_worker = worker;
  h.hello_rank = rank;
  h.hello_token = token;
  return frame_bytes(encode(h));
}

}  // namespace

TEST_CASE("failure: bad frames close only the offending connection") {
  test::World w(2, [](Registry& r) { r.def("echo", [](c10::IValue v) { return v; }); },
                [](AgentOptions& o) { o.token = "secret"; });
  const int port = w[1].info().port;
  // A good client first, so we can see it keeps working.
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 1) == 1);

  std::vector<std::pair<std::string, std::string>> cases;
  Preamble bad_magic;
  bad_magic.magic = 0xdeadbeef;
  bad_magic.envelope_bytes = 64;
  cases.push_back({"bad magic", std::string(reinterpret_cast<char*>(&bad_magic), sizeof(bad_magic))});
  Preamble huge;
  huge.envelope_bytes = 0xfffffff8u;
  cases.push_back({"impossible envelope length", std::string(reinterpret_cast<char*>(&huge), sizeof(huge))});
  Preamble body;
  body.envelope_bytes = 64;
  body.body_bytes = 1ull << 60;
  cases.push_back({"impossible body length", std::string(reinterpret_cast<char*>(&body), sizeof(body))});
  const std::string greet = hello("worker0", 0, "secret");
  cases.push_back({"unknown dtype", greet + raw_frame([](auto env) {
                                      auto t = env.initTensors(1)[0];
                                      t.setDtype(123);
                                    }, 0)});
  cases.push_back({"byte length not matching the shape", greet + raw_frame([](auto env) {
    auto t = env.initTensors(1)[0];
    t.setDtype(static_cast<int16_t>(c10::ScalarType::Float));
    t.initSizes(1).set(0, 1000);
    t.initStrides(1).set(0, 1);
    t.setByteLength(8);
    env.initValues(1)[0].setTensor(0);
  }, 8)});
  cases.push_back({"capnp nesting over its limit", greet + raw_frame([](auto env) {
    auto v = env.initValues(1)[0];
    for (int i = 0; i < 200; ++i) v = v.initTuple(1)[0];
    v.setInt(0);
  }, 0)});
  cases.push_back({"a request before the handshake", raw_frame([](auto env) {
    env.initValues(1)[0].setInt(1);
  }, 0)});
  cases.push_back({"a wrong cluster token", hello("worker0", 0, "guess")});
  cases.push_back({"a handshake naming an unknown worker", hello("mallory", 0, "secret")});

  for (auto& [what, bytes] : cases) {
    INFO("case: " << what);
    int fd = dial(port);
    write_all(fd, bytes);
    CHECK(closed_by_peer(fd, 2000ms));
    ::close(fd);
    // Everyone else is still served.
    CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 7) == 7);
  }

  // A well-formed raw client with the token is served, and a frame cut off
  // mid-way just closes quietly.
  int fd = dial(port);
  Message req;
  req.kind = MessageKind::kRequest;
  req.id = 99;
  req.callee = "echo";
  req.values = {int64_t(5)};
  write_all(fd, greet + frame_bytes(encode(req)));
  FrameDecoder dec{Limits{}};
  char buf[4096];
  for (int i = 0; i < 100 && !dec.has_message(); ++i) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    dec.feed(buf, n);
  }
  REQUIRE(dec.has_message());
  Message resp = dec.take();
  CHECK(resp.kind == MessageKind::kResponse);
  CHECK(resp.id == 99);
  CHECK(resp.values.at(0).toInt() == 5);
  std::string partial = frame_bytes(encode(req));
  write_all(fd, partial.substr(0, partial.size() / 2));
  ::close(fd);
  CHECK(w[0].rpc_sync<int64_t>("worker1", "echo", 8) == 8);
  w.shutdown();
}

TEST_CASE("failure: a caller with a different cluster token is refused") {
  // worker0 carries no token; worker1 wants one: the handshake fails and the
  // call ends with Disconnected instead of hanging.
  test::World w(2, [](Registry& r) { r.def("echo", [](c10::IValue v) { return v; }); },
                [](AgentOptions& o) { o.token = o.rank == 1 ? "secret" : "other"; });
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(w[0].rpc_sync("worker1", "echo", 1), DisconnectedError);
  CHECK(std::chrono::steady_clock::now() - t0 < 2000ms);
  w.shutdown(false);
}
