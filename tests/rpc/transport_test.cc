// The transport contract (rpc/transport.h), checked against every backend:
// TCP, shm (same-host connections with tensors in shared memory), and the
// fault-injecting decorator over each with no faults planned. Then the
// decorator's own faults, one by one, and what only shm does.
#include "test_util.h"

#include <ATen/ops/full.h>

#include <condition_variable>
#include <mutex>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <ATen/ops/arange.h>

#include <atomic>
#include <cstddef>
#include <cstring>

#include "tandem/rpc/transport.h"
#include "tandem/rpc/transport/faulty/faulty_transport.h"
#include "tandem/rpc/transport/shm/ring.h"
#include "tandem/rpc/transport/shm/segments.h"

using namespace tandem::rpc;
using namespace std::chrono_literals;

namespace {

struct Backend {
  std::string name;
  TransportFactory make;
  bool local = false;  // dial the same-host endpoint (connect_local), not TCP
};

std::vector<Backend> backends() {
  return {{"tcp", tcp_transport()},
          {"shm", shm_transport(), true},
          {"faulty(tcp), no faults", faulty_transport(std::make_shared<FaultPlan>())},
          {"faulty(shm), no faults",
           faulty_transport(std::make_shared<FaultPlan>(), shm_transport()), true}};
}

// One transport and what its callbacks saw.
struct Endpoint {
  // `inline_ok`: which messages a polling thread may take (null: none).
  explicit Endpoint(const TransportFactory& make, const Limits& limits = Limits{},
                    std::function<bool(const Message&)> inline_ok = nullptr) {
    Transport::Callbacks cb;
    cb.inline_ok = std::move(inline_ok);
    cb.on_message = [this](const ConnectionPtr& c, Message&& m) {
      // A callback that polls its connection again must read nothing.
      if (poll_in_callback && c->poll_inline()) ++reentered;
      std::lock_guard<std::mutex> lock(mu);
      threads.push_back(std::this_thread::get_id());
      peer = c;
      got.push_back(std::move(m));
      cv.notify_all();
    };
    cb.on_closed = [this](const ConnectionPtr& c, const std::string& reason) {
      std::lock_guard<std::mutex> lock(mu);
      threads.push_back(std::this_thread::get_id());
      closed.emplace_back(c->id(), reason);
      cv.notify_all();
    };
    t = make(limits, std::move(cb));
  }
  ~Endpoint() { t->close(); }

  // Waits (at most `limit`) until `pred` holds, under the lock.
  template <class P>
  bool wait(P pred, std::chrono::milliseconds limit = 10s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return pred(); });
  }
  size_t messages() {
    std::lock_guard<std::mutex> lock(mu);
    return got.size();
  }
  int closes_of(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    int n = 0;
    for (auto& [c, _] : closed) n += c == id;
    return n;
  }

  std::unique_ptr<Transport> t;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Message> got;
  std::vector<std::pair<uint64_t, std::string>> closed;
  std::vector<std::thread::id> threads;
  ConnectionPtr peer;  // the connection the last message came on
  std::atomic<bool> poll_in_callback{false};
  std::atomic<int> reentered{0};
};

Message request(uint64_t id, std::vector<c10::IValue> values = {}) {
  Message m;
  m.kind = MessageKind::kRequest;
  m.id = id;
  m.callee = "f";
  m.values = std::move(values);
  return m;
}

// A connection from `a` to `b`, greeted as an agent greets (the peer of an
// accepted connection writes two handshake frames first: rpc/common/auth.h) and
// seen by `b`, which then forgets the greeting: b.got holds what follows.
// `local`: through b's same-host endpoint.
ConnectionPtr open(Endpoint& a, Endpoint& b, int port, bool local = false) {
  auto c =
      local ? a.t->connect_local(b.t->local_endpoint(), 5s) : a.t->connect("127.0.0.1", port, 5s);
  REQUIRE(c);
  CHECK(std::string(c->kind()) == (local ? "shm" : "tcp"));
  Message hello;
  hello.kind = MessageKind::kHello;
  hello.hello_worker = "a";
  hello.hello_rank = 0;
  size_t before = b.messages();
  for (uint8_t step : {1, 3}) {
    hello.hello_step = step;
    c->send(encode(hello));
  }
  REQUIRE(b.wait([&] { return b.got.size() == before + 2; }));
  std::lock_guard<std::mutex> lock(b.mu);
  b.got.clear();
  return c;
}

// The connection b accepted in open(), after it has sent the acceptor's
// greeting (step 2 of the handshake), which the dialer's decoder wants
// before anything else.
ConnectionPtr greet_back(Endpoint& b) {
  ConnectionPtr served;
  {
    std::lock_guard<std::mutex> lock(b.mu);
    served = b.peer;
  }
  REQUIRE(served);
  Message hello;
  hello.kind = MessageKind::kHello;
  hello.hello_worker = "b";
  hello.hello_step = 2;
  served->send(encode(hello));
  return served;
}

// Runs `body(backend)` for every backend, each as its own subcase.
template <class F>
void for_each_backend(F body) {
  for (const auto& b : backends()) {
    SUBCASE(b.name.c_str()) { body(b); }
  }
}

}  // namespace

TEST_CASE("transport: empty, large and many-tensor messages arrive intact and in order") {
  for_each_backend([](const Backend& be) {
    const TransportFactory& make = be.make;
    Endpoint a(make), b(make);
    int port = b.t->listen("127.0.0.1", 0);
    auto c = open(a, b, port, be.local);
    c->send(encode(request(1)));                 // no values at all
    auto big = at::arange(8 << 20, at::kFloat);  // 32 MiB
    c->send(encode(request(2, {big})));
    std::vector<at::Tensor> many;
    for (int i = 0; i < 500; ++i) many.push_back(at::full({i % 7}, double(i)));
    c->send(encode(request(3, {c10::List<at::Tensor>(many)})));
    c->send(encode(request(4, {at::empty({0, 3})})));  // an empty tensor
    REQUIRE(b.wait([&] { return b.got.size() == 4; }));
    CHECK(b.got[0].id == 1);
    CHECK(b.got[0].values.empty());
    CHECK(b.got[1].id == 2);
    CHECK(at::equal(b.got[1].values.at(0).toTensor(), big));
    CHECK(b.got[2].id == 3);
    auto list = b.got[2].values.at(0).toTensorList();
    REQUIRE(list.size() == many.size());
    for (size_t i = 0; i < many.size(); ++i) CHECK(at::equal(list[i], many[i]));
    CHECK(b.got[3].values.at(0).toTensor().sizes() == at::IntArrayRef{0, 3});
  });
}

TEST_CASE("transport: close from either side is reported once on both, and send throws after") {
  for_each_backend([](const Backend& be) {
    const TransportFactory& make = be.make;
    Endpoint a(make), b(make);
    int port = b.t->listen("127.0.0.1", 0);
    SUBCASE("the connecting side closes") {
      auto c = open(a, b, port, be.local);
      c->close("");
      REQUIRE(a.wait([&] { return !a.closed.empty(); }));
      REQUIRE(b.wait([&] { return !b.closed.empty(); }));
      CHECK(a.closed.at(0).second.empty());  // an orderly close by this side
      CHECK(c->closed());
      CHECK_THROWS_AS(c->send(encode(request(9))), DisconnectedError);
      c->close("again");  // idempotent
    }
    SUBCASE("the accepting side closes") {
      auto c = open(a, b, port, be.local);
      b.peer->close("");
      REQUIRE(a.wait([&] { return !a.closed.empty(); }));
      REQUIRE(b.wait([&] { return !b.closed.empty(); }));
      CHECK(b.closed.at(0).second.empty());
      CHECK_FALSE(a.closed.at(0).second.empty());  // the peer went: a reason is given
      CHECK_THROWS_AS(c->send(encode(request(9))), DisconnectedError);
    }
    // Once both transports are closed no callback runs any more: a second
    // report would have come by now.
    a.t->close();
    b.t->close();
    CHECK(a.closed.size() == 1);
    CHECK(b.closed.size() == 1);
  });
}

TEST_CASE("transport: closing with sends in flight loses no order and reports once") {
  for_each_backend([](const Backend& be) {
    const TransportFactory& make = be.make;
    Endpoint a(make), b(make);
    int port = b.t->listen("127.0.0.1", 0);
    auto c = open(a, b, port, be.local);
    auto chunk = at::ones({1 << 20});  // 4 MiB each: the socket cannot take them all at once
    int sent = 0;
    for (int i = 0; i < 40; ++i) {
      c->send(encode(request(100 + i, {chunk})));
      ++sent;
    }
    c->close("");
    REQUIRE(a.wait([&] { return a.closed.size() == 1; }));
    REQUIRE(b.wait([&] { return b.closed.size() == 1; }));
    // Whatever arrived is a prefix of what was sent, each frame whole.
    std::lock_guard<std::mutex> lock(b.mu);
    for (size_t i = 0; i < b.got.size(); ++i) {
      CHECK(b.got[i].id == 100 + i);
      CHECK(at::equal(b.got[i].values.at(0).toTensor(), chunk));
    }
    CHECK(b.got.size() <= size_t(sent));
    CHECK(a.closes_of(c->id()) == 1);
  });
}

TEST_CASE("transport: callbacks never run inline, only on the transport's thread") {
  for_each_backend([](const Backend& be) {
    const TransportFactory& make = be.make;
    Endpoint a(make), b(make);
    int port = b.t->listen("127.0.0.1", 0);
    auto c = open(a, b, port, be.local);
    c->send(encode(request(1)));
    // on_closed must not run inside close(): it reports from the loop, whose
    // thread is recorded below (an emptiness check right after close()
    // raced with a fast loop thread).
    c->close("");
    REQUIRE(a.wait([&] { return a.closed.size() == 1; }));
    REQUIRE(b.wait([&] { return b.closed.size() == 1; }));
    for (Endpoint* e : {&a, &b}) {
      std::lock_guard<std::mutex> lock(e->mu);
      for (auto id : e->threads) CHECK(id != std::this_thread::get_id());
    }
    CHECK_FALSE(a.t->on_transport_thread());
  });
}

TEST_CASE("transport: a peer that vanishes closes the connection, sends then throw") {
  for_each_backend([](const Backend& be) {
    const TransportFactory& make = be.make;
    Endpoint a(make);
    auto b = std::make_unique<Endpoint>(make);
    int port = b->t->listen("127.0.0.1", 0);
    auto c = open(a, *b, port, be.local);
    const std::string endpoint = b->t->local_endpoint();
    b.reset();  // the whole peer goes, its listener too
    REQUIRE(a.wait([&] { return a.closed.size() == 1; }));
    CHECK_FALSE(a.closed.at(0).second.empty());
    CHECK_THROWS_AS(c->send(encode(request(1))), DisconnectedError);
    CHECK_THROWS_AS(a.t->connect("127.0.0.1", port, 1s), DisconnectedError);
    if (be.local) CHECK_THROWS_AS(a.t->connect_local(endpoint, 1s), DisconnectedError);
    CHECK(a.t->live_connections() == 0);
  });
}

// ---- the fault-injecting decorator's own faults ------------------------------------

namespace {
std::vector<uint64_t> ids_of(Endpoint& e) {
  std::lock_guard<std::mutex> lock(e.mu);
  std::vector<uint64_t> out;
  for (const auto& m : e.got) out.push_back(m.id);
  return out;
}
}  // namespace

TEST_CASE("faulty transport: drop, delay, duplicate, reorder and cut hit the chosen frames") {
  auto plan = std::make_shared<FaultPlan>();
  Endpoint a(faulty_transport(plan)), b(tcp_transport());
  int port = b.t->listen("127.0.0.1", 0);
  auto c = open(a, b, port);
  auto send_ids = [&](std::vector<uint64_t> ids) {
    for (auto id : ids) c->send(encode(request(id)));
  };
  SUBCASE("drop: the second request only") {
    plan->add({Fault::kDrop, MessageKind::kRequest, "f", /*skip=*/1, /*count=*/1});
    send_ids({1, 2, 3});
    REQUIRE(b.wait([&] { return b.got.size() == 2; }));
    CHECK(ids_of(b) == std::vector<uint64_t>{1, 3});
    CHECK(plan->hits(0) == 1);
  }
  SUBCASE("delay: later frames wait behind the delayed one") {
    plan->add({Fault::kDelay, MessageKind::kRequest, "", 0, 1, 300ms});
    auto t0 = std::chrono::steady_clock::now();
    send_ids({1, 2});
    REQUIRE(b.wait([&] { return b.got.size() == 2; }));
    CHECK(std::chrono::steady_clock::now() - t0 >= 300ms);
    CHECK(ids_of(b) == std::vector<uint64_t>{1, 2});
  }
  SUBCASE("duplicate") {
    plan->add({Fault::kDuplicate, MessageKind::kRequest});
    send_ids({1, 2});
    REQUIRE(b.wait([&] { return b.got.size() == 3; }));
    CHECK(ids_of(b) == std::vector<uint64_t>{1, 1, 2});
  }
  SUBCASE("reorder: the hit frame swaps with the next") {
    plan->add({Fault::kReorder, MessageKind::kRequest});
    send_ids({1, 2, 3});
    REQUIRE(b.wait([&] { return b.got.size() == 3; }));
    CHECK(ids_of(b) == std::vector<uint64_t>{2, 1, 3});
  }
  SUBCASE("cut: the connection closes on the chosen frame") {
    plan->add({Fault::kCut, MessageKind::kRequest, "", 1, 1});
    send_ids({1, 2});
    REQUIRE(a.wait([&] { return a.closed.size() == 1; }));
    REQUIRE(b.wait([&] { return b.closed.size() == 1; }));
    CHECK(ids_of(b) == std::vector<uint64_t>{1});
    CHECK_THROWS_AS(c->send(encode(request(3))), DisconnectedError);
  }
  SUBCASE("a fault that matches nothing does nothing") {
    plan->add({Fault::kDrop, MessageKind::kResponse});
    plan->add({Fault::kDrop, MessageKind::kRequest, "g"});
    send_ids({1, 2});
    REQUIRE(b.wait([&] { return b.got.size() == 2; }));
    CHECK(plan->hits(0) == 0);
    CHECK(plan->hits(1) == 0);
  }
  CHECK_THROWS_AS(plan->add({Fault::kDrop, MessageKind::kHello}), std::invalid_argument);
}

// ---- shm: what only the shared-memory backend does -----------------------------------

namespace {

Limits small_pool() {
  Limits l;
  l.max_shared_bytes = 16 << 20;  // one 16 MiB segment
  return l;
}

// A connected shm pair: a dials b's same-host endpoint.
struct ShmPair {
  explicit ShmPair(const Limits& limits = Limits{})
      : a(shm_transport(), limits), b(shm_transport(), limits) {
    port = b.t->listen("127.0.0.1", 0);
    c = open(a, b, port, /*local=*/true);
  }
  Endpoint a, b;
  int port = 0;
  ConnectionPtr c;
};

at::Tensor received(Endpoint& e, size_t i) {
  std::lock_guard<std::mutex> lock(e.mu);
  return e.got.at(i).values.at(0).toTensor();
}

}  // namespace

TEST_CASE("shm: large tensors travel through shared memory, small ones in the frame") {
  ShmPair p(small_pool());
  auto small = at::arange(256, at::kFloat);      // 1 KiB: inline
  auto large = at::arange(1 << 18, at::kFloat);  // 1 MiB: shared
  p.c->send(encode(request(1, {c10::List<at::Tensor>({small, large, small * 2})})));
  REQUIRE(p.b.wait([&] { return p.b.got.size() == 1; }));
  {
    std::lock_guard<std::mutex> lock(p.b.mu);
    auto list = p.b.got[0].values.at(0).toTensorList();
    CHECK(at::equal(list[0], small));
    CHECK(at::equal(list[1], large));
    CHECK(at::equal(list[2], small * 2));
    // What the socket carried: not the megabyte.
    CHECK(p.b.got[0].wire_bytes < 16 << 10);
  }
  auto s = p.a.t->stats();
  CHECK(s.shared_tensors == 1);
  CHECK(s.shared_bytes == large.nbytes());
  CHECK(s.shared_fallbacks == 0);
}

TEST_CASE("shm: blocks a receiver lets go of are reused: a long stream fits a small pool") {
  ShmPair p(small_pool());
  // 64 messages of 4 MiB through a 16 MiB pool: only reuse makes them fit.
  for (int i = 0; i < 64; ++i) {
    auto t = at::full({1 << 20}, float(i));
    p.c->send(encode(request(i, {t})));
    REQUIRE(p.b.wait([&] { return p.b.got.size() == 1; }));
    CHECK(at::equal(received(p.b, 0), t));
    std::lock_guard<std::mutex> lock(p.b.mu);
    p.b.got.clear();  // the tensor dies: its block goes back
  }
  auto s = p.a.t->stats();
  CHECK(s.shared_tensors == 64);
  CHECK(s.shared_fallbacks == 0);
}

TEST_CASE("shm: a receiver that keeps everything fills the pool; the rest goes inline, intact") {
  ShmPair p(small_pool());
  std::vector<at::Tensor> sent;
  for (int i = 0; i < 8; ++i) {
    sent.push_back(at::full({1 << 20}, float(i)));  // 4 MiB each, 32 MiB in all
    p.c->send(encode(request(i, {sent.back()})));
  }
  REQUIRE(p.b.wait([&] { return p.b.got.size() == 8; }));
  for (int i = 0; i < 8; ++i) CHECK(at::equal(received(p.b, i), sent[i]));
  auto s = p.a.t->stats();
  CHECK(s.shared_tensors == 3);  // three 4 MiB blocks (and headers) fit 16 MiB
  CHECK(s.shared_fallbacks == 5);
  {
    std::lock_guard<std::mutex> lock(p.b.mu);
    p.b.got.clear();
  }
  p.c->send(encode(request(9, {sent[0]})));  // room again
  REQUIRE(p.b.wait([&] { return p.b.got.size() == 1; }));
  CHECK(p.a.t->stats().shared_tensors == 4);
}

TEST_CASE("shm: a received tensor outlives its sender and the connection") {
  auto large = at::arange(1 << 18, at::kFloat);
  at::Tensor kept;
  {
    Endpoint b(shm_transport());
    int port = b.t->listen("127.0.0.1", 0);
    {
      Endpoint a(shm_transport());
      auto c = open(a, b, port, /*local=*/true);
      c->send(encode(request(1, {large})));
      REQUIRE(b.wait([&] { return b.got.size() == 1; }));
      kept = received(b, 0);
    }  // the sender, its transport and its segments go
    REQUIRE(b.wait([&] { return b.closed.size() == 1; }));
    std::lock_guard<std::mutex> lock(b.mu);
    b.got.clear();
  }  // the receiver's transport goes too
  CHECK(at::equal(kept, large));
}

TEST_CASE("shm: where segments cannot be made, large tensors go through the socket") {
  testing::fail_shared_segments("refused for this test");
  ShmPair p;
  auto large = at::arange(1 << 18, at::kFloat);
  p.c->send(encode(request(1, {large})));
  REQUIRE(p.b.wait([&] { return p.b.got.size() == 1; }));
  testing::fail_shared_segments("");
  CHECK(at::equal(received(p.b, 0), large));
  auto s = p.a.t->stats();
  CHECK(s.shared_tensors == 0);
  CHECK(s.shared_fallbacks == 1);
}

TEST_CASE("shm: a spinning thread reads its connection itself, and the order holds") {
  // b lets a polling thread take every message but those for "loop".
  Endpoint a(shm_transport());
  Endpoint b(shm_transport(), Limits{}, [](const Message& m) { return m.callee != "loop"; });
  const int port = b.t->listen("127.0.0.1", 0);
  auto c = open(a, b, port, /*local=*/true);
  ConnectionPtr served;
  size_t base = 0;
  {
    std::lock_guard<std::mutex> lock(b.mu);
    served = b.peer;
    base = b.threads.size();
  }
  REQUIRE(served);
  std::atomic<bool> stop{false};
  b.poll_in_callback = true;
  // Spins as the agent's threads do: inside one, writes to the ring wake
  // nobody, between them they wake the loop thread, which then races the
  // poller for what comes.
  std::thread poller([&] {
    while (!stop) {
      PollingSpin spin;
      for (int k = 0; k < 200 && !stop; ++k) served->poll_inline();
    }
  });
  const std::thread::id poller_id = poller.get_id();
  const int n = 300;
  for (int i = 1; i <= n; ++i) {
    Message m = request(static_cast<uint64_t>(i));
    if (i % 10 == 0) m.callee = "loop";
    c->send(encode(m));
    if (i % 3 == 0) std::this_thread::sleep_for(50us);
  }
  REQUIRE(b.wait([&] { return b.got.size() == static_cast<size_t>(n); }));
  stop = true;
  poller.join();
  int on_poller = 0;
  {
    std::lock_guard<std::mutex> lock(b.mu);
    for (int i = 0; i < n; ++i) {
      CAPTURE(i);
      CHECK(b.got[i].id == static_cast<uint64_t>(i + 1));  // each once, in order
      const bool polled = b.threads.at(base + i) == poller_id;
      if (b.got[i].callee == "loop") CHECK_FALSE(polled);  // left to the loop thread
      on_poller += polled;
    }
  }
  CHECK(on_poller > 0);
  CHECK(b.reentered == 0);
  // Closed by the peer while a thread polls: reported once, and polling
  // then reads nothing.
  stop = false;
  std::thread again([&] {
    while (!stop) served->poll_inline();
  });
  c->close("");
  CHECK(b.wait([&] { return !b.closed.empty(); }));
  stop = true;
  again.join();
  CHECK(b.closes_of(served->id()) == 1);
  CHECK_FALSE(served->poll_inline());
}

TEST_CASE(
    "shm: a small ring wraps, fills and wakes; frames both ways arrive once, in order, intact") {
  // A 4 KiB ring: frames of every size wrap around it, larger ones stream
  // through it while their writer waits for space (ring.h, 2.-3.), and
  // 40 KiB tensors bring new segments whose descriptors come first (4.).
  // Threads poll each side in PollingSpins, so wake-ups are skipped and
  // handed back as they would be between two workers.
  Limits limits;
  limits.shm_ring_bytes = 4096;
  auto all_but_loop = [](const Message& m) { return m.callee != "loop"; };
  Endpoint a(shm_transport(), limits, all_but_loop), b(shm_transport(), limits, all_but_loop);
  const int port = b.t->listen("127.0.0.1", 0);
  auto c = open(a, b, port, /*local=*/true);
  {
    std::lock_guard<std::mutex> lock(b.mu);
    b.got.clear();
  }
  ConnectionPtr served = greet_back(b);
  const int n = 600;
  const int64_t sizes[] = {0, 25, 700, 1500, 10000, 0, 3, 2048};  // floats
  auto payload = [&](int i) {
    const int64_t floats = i % 50 == 0 ? 10240 : sizes[i % 8];  // 40 KiB: a segment
    return at::full({floats}, static_cast<float>(i));
  };
  std::atomic<bool> stop{false};
  auto poll = [&](const ConnectionPtr& conn) {
    return std::thread([&, conn] {
      while (!stop) {
        {
          PollingSpin spin;
          for (int k = 0; k < 200; ++k) conn->poll_inline();
        }
        std::this_thread::sleep_for(20us);
      }
    });
  };
  std::thread poll_b = poll(served), poll_a = poll(c);
  auto send_all = [&](const ConnectionPtr& conn) {
    return std::thread([&, conn] {
      for (int i = 1; i <= n; ++i) {
        Message m = request(static_cast<uint64_t>(i), {payload(i)});
        if (i % 7 == 0) m.callee = "loop";
        conn->send(encode(m));
      }
    });
  };
  std::thread to_b = send_all(c), to_a = send_all(served);
  to_b.join();
  to_a.join();
  CHECK(b.wait([&] { return b.got.size() == static_cast<size_t>(n); }, 30s));
  CHECK(a.wait([&] { return a.got.size() == static_cast<size_t>(n) + 1; }, 30s));
  stop = true;
  poll_a.join();
  poll_b.join();
  auto check = [&](Endpoint& e, size_t skip) {
    std::lock_guard<std::mutex> lock(e.mu);
    REQUIRE(e.got.size() == n + skip);
    for (int i = 1; i <= n; ++i) {
      const Message& m = e.got[skip + i - 1];
      CAPTURE(i);
      REQUIRE(m.id == static_cast<uint64_t>(i));
      const at::Tensor t = m.values.at(0).toTensor();
      CHECK(at::equal(t, payload(i)));
    }
  };
  check(b, 0);
  check(a, 1);  // after b's greeting
  const auto sa = a.t->stats(), sb = b.t->stats();
  CHECK(sa.shared_tensors > 0);
  CHECK(sa.polled_messages + sb.polled_messages > 0);
  CHECK(sa.ring_wakes + sb.ring_wakes > 0);
  CHECK(a.closed.empty());
  CHECK(b.closed.empty());
}

TEST_CASE("shm: with a ring on one side only, frames both ways arrive once, in order, intact") {
  // One side could make no ring ('N'): it reads the other's ring, and its
  // own frames go through the socket, which then carries no wake-ups; the
  // ring's writer, finding it full, looks again on its own (ring.h, 3.).
  Limits small, none;
  small.shm_ring_bytes = 4096;
  none.shm_ring_bytes = 0;
  bool dialer_has_ring = true;
  SUBCASE("the dialer has the ring") { dialer_has_ring = true; }
  SUBCASE("the acceptor has the ring") { dialer_has_ring = false; }
  Endpoint a(shm_transport(), dialer_has_ring ? small : none);
  Endpoint b(shm_transport(), dialer_has_ring ? none : small);
  const int port = b.t->listen("127.0.0.1", 0);
  auto c = open(a, b, port, /*local=*/true);
  ConnectionPtr served = greet_back(b);
  const int n = 300;
  auto payload = [](int i) { return at::full({i % 3 == 0 ? 3000 : i % 40}, float(i)); };
  auto send_all = [&](const ConnectionPtr& conn) {
    return std::thread([&, conn] {
      for (int i = 1; i <= n; ++i) conn->send(encode(request(uint64_t(i), {payload(i)})));
    });
  };
  std::thread to_b = send_all(c), to_a = send_all(served);
  to_b.join();
  to_a.join();
  CHECK(b.wait([&] { return b.got.size() == size_t(n); }, 30s));
  CHECK(a.wait([&] { return a.got.size() == size_t(n) + 1; }, 30s));
  auto check = [&](Endpoint& e, size_t skip) {
    std::lock_guard<std::mutex> lock(e.mu);
    REQUIRE(e.got.size() == n + skip);
    for (int i = 1; i <= n; ++i) {
      CAPTURE(i);
      REQUIRE(e.got[skip + i - 1].id == uint64_t(i));
      CHECK(at::equal(e.got[skip + i - 1].values.at(0).toTensor(), payload(i)));
    }
  };
  check(b, 0);
  check(a, 1);
  CHECK(a.closed.empty());
  CHECK(b.closed.empty());
}

TEST_CASE(
    "shm: a reader that stops reading leaves the ring full; the writer queues, and goes on "
    "when answers drain") {
  // Backpressure (uv_transport.h, 5.) through a 4 KiB ring: b holds a few
  // requests, then stops reading past max_held_bytes; a's ring fills and
  // its sends queue. Answers resume b, whose reads wake a's writer.
  Limits limits;
  limits.shm_ring_bytes = 4096;
  limits.max_unanswered_requests = 4;
  limits.max_held_bytes = 16 << 10;
  Endpoint a(shm_transport(), limits), b(shm_transport(), limits);
  const int port = b.t->listen("127.0.0.1", 0);
  auto c = open(a, b, port, /*local=*/true);
  greet_back(b);
  REQUIRE(a.wait([&] { return a.got.size() == 1; }));
  const int n = 60;
  auto payload = [](int i) { return at::full({1000}, float(i)); };  // 4000 B: a ring each
  for (int i = 1; i <= n; ++i) c->send(encode(request(uint64_t(i), {payload(i)})));
  REQUIRE(b.wait([&] { return b.got.size() == 4; }));
  std::this_thread::sleep_for(100ms);
  CHECK(b.messages() == 4);  // the rest held, then left in the ring and a's queue
  CHECK(b.t->stats().read_pauses == 1);
  for (size_t i = 0; i < size_t(n); ++i) {
    if (!b.wait([&] { return b.got.size() > i; }, 10s)) {
      std::lock_guard<std::mutex> la(a.mu), lb(b.mu);
      FAIL("stuck at " << i << " of " << n
                       << "; a closed: " << (a.closed.empty() ? "-" : a.closed[0].second)
                       << "; b closed: " << (b.closed.empty() ? "-" : b.closed[0].second)
                       << "; a got " << a.got.size());
    }
    Message r;
    r.kind = MessageKind::kResponse;
    {
      std::lock_guard<std::mutex> lock(b.mu);
      r.id = b.got.at(i).id;
    }
    b.peer->send(encode(r));
  }
  REQUIRE(a.wait([&] { return a.got.size() == size_t(n) + 1; }, 10s));
  std::lock_guard<std::mutex> lock(b.mu);
  REQUIRE(b.got.size() == size_t(n));
  for (int i = 1; i <= n; ++i) {
    CAPTURE(i);
    CHECK(b.got[i - 1].id == uint64_t(i));
    CHECK(at::equal(b.got[i - 1].values.at(0).toTensor(), payload(i)));
  }
  CHECK(a.closed.empty());
  CHECK(b.closed.empty());
}

// A same-host connection from `a` to `b`, whose messages `b` reads in a
// spin (its filter takes each): `served` is b's end, for polling.
struct PolledPair {
  PolledPair() {
    c = open(a, b, b.t->listen("127.0.0.1", 0), /*local=*/true);
    std::lock_guard<std::mutex> lock(b.mu);
    served = b.peer;
    REQUIRE(served);
  }
  Endpoint a{shm_transport()};
  Endpoint b{shm_transport(), Limits{}, [](const Message&) { return true; }};
  ConnectionPtr c, served;
};

TEST_CASE(
    "shm: a write into a ring a spin polls wakes nobody; what the spin leaves, the loop delivers") {
  PolledPair pair;
  Endpoint &a = pair.a, &b = pair.b;
  ConnectionPtr c = pair.c, served = pair.served;
  for (int round = 1; round <= 20; ++round) {
    CAPTURE(round);
    const uint64_t wakes = a.t->stats().ring_wakes;
    {
      PollingSpin spin;
      // The first poll makes this thread a reader of the ring (ring.h, 3.)...
      CHECK_FALSE(served->poll_inline());
      // ...so the writer sees no need to wake b's loop thread,
      c->send(encode(request(static_cast<uint64_t>(round))));
      CHECK(a.t->stats().ring_wakes == wakes);
    }  // and the spin ends without reading: the loop thread must.
    CHECK(b.wait([&] { return b.got.size() == static_cast<size_t>(round); }, 5s));
  }
  // Outside a spin, a poll registers nothing: the write wakes the loop thread.
  served->poll_inline();
  c->send(encode(request(21)));
  CHECK(b.wait([&] { return b.got.size() == 21; }, 5s));
}

namespace {
// Sleeps on `served`, polled by this thread, until `arrived()`: the frame
// `id` that `c` writes 3 ms later. How long that took (each sleep may last
// 10 s: only the peer's write ends it sooner).
std::chrono::steady_clock::duration sleep_for_write(const ConnectionPtr& served,
                                                    const ConnectionPtr& c, uint64_t id,
                                                    const std::function<bool()>& arrived) {
  PollingSpin spin;
  CHECK_FALSE(served->poll_inline());  // (this thread now polls it)
  ConnectionSleep sleep;
  REQUIRE(sleep.ok());
  std::thread writer([&] {
    std::this_thread::sleep_for(3ms);
    c->send(encode(request(id)));
  });
  const auto t0 = std::chrono::steady_clock::now();
  while (!arrived() && sleep.wait(10s, arrived)) {
  }
  writer.join();
  return std::chrono::steady_clock::now() - t0;
}

// A sleep that another thread's waker ends, then one that ends at its bound.
void woken_by_waker_then_bound(ConnectionSleep& sleep) {
  using Clock = std::chrono::steady_clock;
  std::atomic<bool> flag{false};
  std::thread waker([&, wake = sleep.waker()] {
    std::this_thread::sleep_for(3ms);
    flag = true;
    wake();
  });
  auto t0 = Clock::now();
  while (!flag && sleep.wait(10s, [&] { return flag.load(); })) {
  }
  waker.join();
  CHECK(Clock::now() - t0 < 5s);
  t0 = Clock::now();
  CHECK(sleep.wait(30ms, [] { return false; }));
  CHECK(Clock::now() - t0 >= 25ms);
}
}  // namespace

TEST_CASE("shm: a thread asleep on its connection: the peer's write, a waker or the end wake it") {
  // rpc/transport.h, 10.; ring.h, 3a.
  PolledPair pair;
  Endpoint &a = pair.a, &b = pair.b;
  ConnectionPtr c = pair.c, served = pair.served;
  {
    ConnectionSleep outside;  // not in a PollingSpin: nothing to sleep on
    CHECK_FALSE(outside.ok());
    PollingSpin spin;
    ConnectionSleep unpolled;  // in one, but no connection polled yet
    CHECK_FALSE(unpolled.ok());
  }
  using Clock = std::chrono::steady_clock;
  const auto me = std::this_thread::get_id();
  for (int round = 1; round <= 10; ++round) {
    CAPTURE(round);
    const TransportStats before = a.t->stats();
    auto arrived = [&] { return b.messages() == static_cast<size_t>(round); };
    CHECK(sleep_for_write(served, c, static_cast<uint64_t>(round), arrived) < 5s);
    CHECK(arrived());
    // The writer rang the sleeper's bell, woke no loop thread, and the
    // message was read and delivered here.
    CHECK(a.t->stats().ring_bells > before.ring_bells);
    CHECK(a.t->stats().ring_wakes == before.ring_wakes);
    std::lock_guard<std::mutex> lock(b.mu);
    CHECK(b.threads.back() == me);
  }
  {
    // Another thread of the process wakes it; with neither, the sleep ends at its bound.
    PollingSpin spin;
    served->poll_inline();
    ConnectionSleep sleep;
    REQUIRE(sleep.ok());
    woken_by_waker_then_bound(sleep);
    auto t0 = Clock::now();
    // The peer goes: its loop closes the connection, and the next wait
    // says it cannot sleep there any more.
    a.t->close();
    REQUIRE(b.wait([&] { return !b.closed.empty(); }, 5s));
    t0 = Clock::now();
    bool still = true;
    while (still && Clock::now() - t0 < 5s) still = sleep.wait(20ms, [] { return false; });
    CHECK_FALSE(still);
  }
}

TEST_CASE("tcp: a spinning thread reads its socket itself, and one asleep on it is woken") {
  // rpc/transport/uv/tcp_connection.h, 1. and 2.
  Endpoint a{tcp_transport()};
  Endpoint b{tcp_transport(), Limits{}, [](const Message& m) { return m.callee != "loop"; }};
  ConnectionPtr c = open(a, b, b.t->listen("127.0.0.1", 0));
  ConnectionPtr served;
  size_t base = 0;  // b.threads before b.got's first
  {
    std::lock_guard<std::mutex> lock(b.mu);
    served = b.peer;
    base = b.threads.size();
  }
  REQUIRE(served);
  using Clock = std::chrono::steady_clock;
  const auto me = std::this_thread::get_id();
  // A spin reads what comes, here; what it may not take goes to the loop
  // thread, in order. (It spins before the bytes come, as a waiting caller
  // does; the loop thread, woken for them too, may still win a few.)
  for (int i = 1; i <= 40; ++i) {
    CAPTURE(i);
    Message m = request(static_cast<uint64_t>(i));
    if (i % 10 == 5) m.callee = "loop";
    PollingSpin spin;
    served->poll_inline();
    std::thread sender([&] { c->send(encode(m)); });
    const auto t0 = Clock::now();
    while (b.messages() < static_cast<size_t>(i) && Clock::now() - t0 < 5s) served->poll_inline();
    sender.join();
  }
  {
    std::lock_guard<std::mutex> lock(b.mu);
    REQUIRE(b.got.size() == 40);
    int here = 0;
    for (size_t i = 0; i < b.got.size(); ++i) {
      CHECK(b.got[i].id == i + 1);
      if (b.got[i].callee == "loop") CHECK(b.threads[base + i] != me);
      here += b.threads[base + i] == me;
    }
    MESSAGE("tcp: a spinning thread read " << here << " of 40 frames itself");
    CHECK(here > 0);
  }
  {
    // A frame larger than a poller's gulp is the loop's to read, whole,
    // and the small one behind it comes after it.
    PollingSpin spin;
    served->poll_inline();
    const auto big = at::arange(1 << 20, at::kFloat);  // 4 MiB
    std::thread sender([&] {
      c->send(encode(request(41, {big})));
      c->send(encode(request(42)));
    });
    const auto t0 = Clock::now();
    while (b.messages() < 42 && Clock::now() - t0 < 5s) served->poll_inline();
    sender.join();
    std::lock_guard<std::mutex> lock(b.mu);
    REQUIRE(b.got.size() == 42);
    CHECK(b.got[40].id == 41);
    CHECK(at::equal(b.got[40].values.at(0).toTensor(), big));
    CHECK(b.threads[base + 40] != me);
    CHECK(b.got[41].id == 42);
  }
  int read_here = 0;  // rounds whose bytes the sleeper read itself
  for (int round = 1; round <= 10; ++round) {
    CAPTURE(round);
    const size_t before = b.messages();
    auto arrived = [&] { return b.messages() == before + 1; };
    // (the peer's bytes woke it, not the bound)
    CHECK(sleep_for_write(served, c, 100 + static_cast<uint64_t>(round), arrived) < 5s);
    // A sleep that ends unfinished leaves the bytes to the loop thread
    // (a sleeper not scheduled within kYieldFor): they come all the same.
    REQUIRE(b.wait([&] { return b.got.size() == before + 1; }, 5s));
    // Mostly it read them itself: the loop thread, woken too, left them to it.
    std::lock_guard<std::mutex> lock(b.mu);
    read_here += b.threads.back() == me;
  }
  MESSAGE("tcp: a sleeper read its own bytes in " << read_here << " of 10 rounds");
  CHECK(read_here >= 1);
  {
    // Another thread wakes it; with neither, the sleep ends at its bound;
    // the connection's end wakes it and it cannot sleep there any more.
    PollingSpin spin;
    served->poll_inline();
    ConnectionSleep sleep;
    REQUIRE(sleep.ok());
    woken_by_waker_then_bound(sleep);
    auto t0 = Clock::now();
    std::thread closer([&] {
      std::this_thread::sleep_for(5ms);
      c->close("");
    });
    t0 = Clock::now();
    bool still = true;
    while (still && Clock::now() - t0 < 5s) still = sleep.wait(10s, [] { return false; });
    closer.join();
    CHECK_FALSE(still);
    CHECK(Clock::now() - t0 < 5s);
    CHECK(b.wait([&] { return !b.closed.empty(); }, 5s));
    CHECK(b.closes_of(served->id()) == 1);
    CHECK_FALSE(served->poll_inline());
  }
  {
    ConnectionSleep outside;  // not in a PollingSpin: nothing to sleep on
    CHECK_FALSE(outside.ok());
  }
}

TEST_CASE("shm: connect_local tells another host from a dead endpoint") {
  Endpoint a(shm_transport()), b(shm_transport());
  b.t->listen("127.0.0.1", 0);
  const std::string e = b.t->local_endpoint();
  REQUIRE(e.rfind("shm:", 0) == 0);
  // Another boot id or network namespace: not this host, no error.
  CHECK(a.t->connect_local("shm:someone-else:net:[1]:tandem-00", 1s) == nullptr);
  // This host, but nobody listens there.
  const std::string dead = e.substr(0, e.rfind(':') + 1) + "tandem-nobody-here";
  CHECK_THROWS_WITH_AS(a.t->connect_local(dead, 1s), doctest::Contains("tandem-nobody-here"),
                       DisconnectedError);
  CHECK_THROWS_AS(a.t->connect_local("tcp:whatever", 1s), std::invalid_argument);
  // A TCP-only transport has no endpoint and dials none.
  Endpoint t(tcp_transport());
  t.t->listen("127.0.0.1", 0);
  CHECK(t.t->local_endpoint().empty());
  CHECK(t.t->connect_local(e, 1s) == nullptr);
}

// ---- shm: a hostile peer on the same host ---------------------------------------------

namespace {

// A raw client of a shm endpoint, which writes whatever bytes and
// descriptors it is given (after a proper greeting).
struct RawLocal {
  // `greet`: open as a peer without a ring ('N', then the greetings on the
  // socket); otherwise the caller writes the first byte.
  explicit RawLocal(const std::string& endpoint, bool greet = true) {
    const std::string name = endpoint.substr(endpoint.rfind(':') + 1);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr),
                      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())) ==
            0);
    if (!greet) return;
    write(std::string(1, kNoRingHello));  // no ring: frames follow on the socket
    Message hello;
    hello.kind = MessageKind::kHello;
    hello.hello_worker = "raw";
    for (uint8_t step : {1, 3}) {
      hello.hello_step = step;
      write(encode(hello).to_bytes());
    }
  }
  ~RawLocal() { ::close(fd); }
  void write(const std::string& bytes, const std::vector<int>& fds = {}) {
    iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(fds.size(), 1)));
    if (!fds.empty()) {
      msg.msg_control = control.data();
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    REQUIRE(::sendmsg(fd, &msg, MSG_NOSIGNAL) == ssize_t(bytes.size()));
  }
  int fd = -1;
};

constexpr uint64_t kRawTensorBytes = 64 << 10;

// A request whose one tensor (64 KiB of floats) the table places at `ref`.
std::string shared_frame(SharedRef ref) {
  OutFrame f = encode(request(7, {at::zeros({int64_t(kRawTensorBytes / 4)})}));
  Preamble pre = f.preamble;
  pre.flags = kFlagSharedTensors;
  pre.table_bytes = sizeof(SharedRef);
  pre.body_bytes = 0;
  std::string out(reinterpret_cast<const char*>(&pre), sizeof(pre));
  out.append(reinterpret_cast<const char*>(&ref), sizeof(ref));
  out.append(f.envelope.bytes(), f.envelope.byte_size());
  return out;
}

// A memfd of `size` bytes, sealed against shrinking unless `seal` is
// false, with a block as the shm backend writes it (segments.h, 3.) at
// offset 0: its tensor starts at 64.
int make_segment(size_t size, bool seal = true) {
  int fd = ::memfd_create("raw-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, static_cast<off_t>(size)) == 0);
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  REQUIRE(p != MAP_FAILED);
  struct Header {
    uint32_t magic, state;
    uint64_t bytes;
  } h{0x42485354, 1, kRawTensorBytes};
  std::memcpy(p, &h, sizeof(h));
  ::munmap(p, size);
  if (seal) REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
  return fd;
}

}  // namespace

TEST_CASE("shm: bad references and descriptors close that connection, not the transport") {
  Endpoint b(shm_transport());
  int port = b.t->listen("127.0.0.1", 0);
  const std::string endpoint = b.t->local_endpoint();
  std::string expect;
  auto closed_with = [&](RawLocal&) {
    REQUIRE(b.wait([&] { return b.closed.size() == 1; }, 5s));
    std::lock_guard<std::mutex> lock(b.mu);
    INFO(b.closed[0].second);
    CHECK(b.closed[0].second.rfind("protocol error", 0) == 0);
    CHECK(b.closed[0].second.find(expect) != std::string::npos);
  };
  SUBCASE("a segment never announced") {
    RawLocal raw(endpoint);
    expect = "names segment 0 of 0 announced";
    raw.write(shared_frame({0, 0, 64}));
    closed_with(raw);
  }
  SUBCASE("a descriptor that is no memfd") {
    RawLocal raw(endpoint);
    int pipe_fds[2];
    REQUIRE(::pipe(pipe_fds) == 0);
    expect = "not a memfd sealed against shrinking";
    raw.write(shared_frame({0, 0, 64}), {pipe_fds[0]});
    closed_with(raw);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
  }
  // One 1 MiB segment announced with a frame whose tensor it places at `ref`.
  auto one_segment = [&](SharedRef ref, const std::string& why, bool seal = true) {
    RawLocal raw(endpoint);
    int fd = make_segment(1 << 20, seal);
    expect = why;
    raw.write(shared_frame(ref), {fd});
    closed_with(raw);
    ::close(fd);
  };
  SUBCASE("a memfd that could shrink under the reader") {
    one_segment({0, 0, 64}, "not a memfd sealed against shrinking", /*seal=*/false);
  }
  SUBCASE("a block past the segment's end") {
    one_segment({0, 0, (1 << 20) - 64}, "do not fit its segment");
  }
  SUBCASE("an unaligned offset") { one_segment({0, 0, 100}, "do not fit its segment"); }
  SUBCASE("the same block twice") {
    RawLocal raw(endpoint);
    int fd = make_segment(1 << 20);
    raw.write(shared_frame({0, 0, 64}), {fd});
    REQUIRE(b.wait([&] { return b.got.size() == 3; }));  // two greetings, then the frame
    CHECK(received(b, 2).nbytes() == kRawTensorBytes);
    expect = "was not freshly sent";
    raw.write(shared_frame({0, 0, 64}));  // while the first tensor is held
    closed_with(raw);
    ::close(fd);
  }
  SUBCASE("a table naming a tensor the frame does not have") {
    one_segment({3, 0, 64}, "names tensor 3 of 1");
  }
  SUBCASE("more segments than allowed") {
    RawLocal raw(endpoint);
    std::vector<int> fds;
    for (uint32_t i = 0; i <= Limits{}.max_shared_segments; ++i) fds.push_back(make_segment(4096));
    expect = "more than " + std::to_string(Limits{}.max_shared_segments) + " shared segments";
    raw.write(shared_frame({0, 0, 64}), fds);
    closed_with(raw);
    for (int fd : fds) ::close(fd);
  }
  // The transport still serves a well-behaved peer.
  Endpoint a(shm_transport());
  auto good = open(a, b, port, /*local=*/true);
  good->send(encode(request(42, {at::arange(1 << 18, at::kFloat)})));
  REQUIRE(b.wait([&] { return !b.got.empty() && b.got.back().id == 42; }));
}

namespace {

// A ring as a hostile writer makes it: a memfd of a header page and
// `capacity` bytes, sealed unless `seal` is false, whose header says
// `magic` and `header_capacity`.
int make_ring(uint64_t capacity, bool seal = true, uint32_t magic = testing::RingLayout::kMagic,
              uint64_t header_capacity = 0) {
  using testing::RingLayout;
  int fd = ::memfd_create("raw-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, static_cast<off_t>(RingLayout::kHeaderBytes + capacity)) == 0);
  struct {
    uint32_t magic, version;
    uint64_t capacity;
  } h{magic, RingLayout::kVersion, header_capacity ? header_capacity : capacity};
  REQUIRE(::pwrite(fd, &h, sizeof(h), 0) == ssize_t(sizeof(h)));
  if (seal) REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0);
  return fd;
}

// A raw client of a shm endpoint that opens with its own ring ('R' and the
// descriptor) and then plays the ring's writer however a test likes.
struct RawRing {
  RawRing(const std::string& endpoint, int ring_fd, uint64_t capacity)
      : raw(endpoint, /*greet=*/false), capacity(capacity) {
    raw.write(std::string(1, kRingHello), {ring_fd});
    void* p = ::mmap(nullptr, testing::RingLayout::kHeaderBytes + capacity, PROT_READ | PROT_WRITE,
                     MAP_SHARED, ring_fd, 0);
    REQUIRE(p != MAP_FAILED);
    base = static_cast<char*>(p);
    ::close(ring_fd);
  }
  ~RawRing() { ::munmap(base, testing::RingLayout::kHeaderBytes + capacity); }
  std::atomic<uint64_t>& at(uint64_t offset) {
    return *reinterpret_cast<std::atomic<uint64_t>*>(base + offset);
  }
  // Copies `bytes` in at the head, publishes the head and wakes the reader
  // (unless `wake` is false).
  void write(const std::string& bytes, bool wake = true) {
    for (size_t i = 0; i < bytes.size(); ++i) {
      base[testing::RingLayout::kHeaderBytes + ((head + i) & (capacity - 1))] = bytes[i];
    }
    head += bytes.size();
    publish(head, wake);
  }
  void publish(uint64_t h, bool wake = true) {
    at(testing::RingLayout::head_offset()).store(h);
    if (wake) raw.write(std::string(1, kRingWake));
  }
  void greet() {
    Message hello;
    hello.kind = MessageKind::kHello;
    hello.hello_worker = "raw";
    for (uint8_t step : {1, 3}) {
      hello.hello_step = step;
      write(encode(hello).to_bytes());
    }
  }
  RawLocal raw;
  uint64_t capacity;
  char* base = nullptr;
  uint64_t head = 0;
};

}  // namespace

TEST_CASE("shm: a hostile ring or socket code closes that connection, not the transport") {
  // The ring's header and data are the peer's to scribble on (ring.h, 5.):
  // each lie below is caught where it is read and closes that connection.
  Limits limits;
  limits.max_ring_bytes = 1 << 20;
  Endpoint b(shm_transport(), limits);
  const int port = b.t->listen("127.0.0.1", 0);
  const std::string endpoint = b.t->local_endpoint();
  std::string expect;
  auto closed_with = [&] {
    REQUIRE(b.wait([&] { return b.closed.size() == 1; }, 5s));
    std::lock_guard<std::mutex> lock(b.mu);
    INFO(b.closed[0].second);
    CHECK(b.closed[0].second.rfind("protocol error", 0) == 0);
    CHECK(b.closed[0].second.find(expect) != std::string::npos);
  };
  const uint64_t cap = 64 << 10;
  // A ring the transport takes: greetings through it arrive.
  auto good_ring = [&] {
    auto r = std::make_unique<RawRing>(endpoint, make_ring(cap), cap);
    r->greet();
    REQUIRE(b.wait([&] { return b.got.size() == 2; }));
    return r;
  };
  SUBCASE("a ring that is no memfd") {
    int pipe_fds[2];
    REQUIRE(::pipe(pipe_fds) == 0);
    RawLocal raw(endpoint, /*greet=*/false);
    expect = "ring is not a memfd sealed against shrinking";
    raw.write(std::string(1, kRingHello), {pipe_fds[0]});
    closed_with();
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
  }
  SUBCASE("a ring that could shrink under the reader") {
    expect = "ring is not a memfd sealed against shrinking";
    RawRing r(endpoint, make_ring(cap, /*seal=*/false), cap);
    closed_with();
  }
  SUBCASE("a ring without its descriptor") {
    RawLocal raw(endpoint, /*greet=*/false);
    expect = "must open with its ring or 'N', not byte 82 with 0 descriptor(s)";
    raw.write(std::string(1, kRingHello));
    closed_with();
  }
  SUBCASE("an unknown first byte") {
    RawLocal raw(endpoint, /*greet=*/false);
    expect = "must open with its ring or 'N', not byte 88";
    raw.write("X");
    closed_with();
  }
  SUBCASE("a header with the wrong magic") {
    expect = "ring header is malformed";
    RawRing r(endpoint, make_ring(cap, true, 0xdeadbeef), cap);
    closed_with();
  }
  SUBCASE("a header whose capacity is not the memfd's") {
    expect = "ring header is malformed (magic, version or capacity 131072)";
    RawRing r(endpoint, make_ring(cap, true, testing::RingLayout::kMagic, 2 * cap), cap);
    closed_with();
  }
  SUBCASE("a capacity that is no power of two") {
    expect = "ring header is malformed";
    RawRing r(endpoint, make_ring(cap + 4096), cap + 4096);
    closed_with();
  }
  SUBCASE("a ring larger than the reader allows") {
    expect = "ring has an unusable size";
    RawRing r(endpoint, make_ring(2 << 20), 2 << 20);
    closed_with();
  }
  SUBCASE("a ring that does not start empty") {
    expect = "ring does not start empty";
    int fd = make_ring(cap);
    const uint64_t tail = 5;
    REQUIRE(::pwrite(fd, &tail, sizeof(tail), testing::RingLayout::tail_offset()) == 8);
    RawRing r(endpoint, fd, cap);
    closed_with();
  }
  SUBCASE("a head that runs backwards") {
    auto r = good_ring();
    expect = "ring head 10 outside";
    r->publish(10);
    closed_with();
  }
  SUBCASE("a head past a full ring") {
    auto r = good_ring();
    expect = "ring head " + std::to_string(r->head + cap + 1) + " outside";
    r->publish(r->head + cap + 1);
    closed_with();
  }
  SUBCASE("a frame's bytes that do not decode") {
    auto r = good_ring();
    expect = "protocol error";
    r->write(std::string(64, '\xff'));
    closed_with();
  }
  SUBCASE("segments announced in the ring whose descriptors never came") {
    auto r = good_ring();
    expect = "ring announced 1 segment descriptor(s); 0 came";
    r->at(testing::RingLayout::announced_offset()).store(1);
    r->write(encode(request(7, {})).to_bytes());
    closed_with();
  }
  SUBCASE("segments announced in the ring, then the socket ends") {
    // The end drains the ring, and no descriptor can come any more.
    auto r = good_ring();
    expect = "ring announced 1 segment descriptor(s); 0 came";
    r->at(testing::RingLayout::announced_offset()).store(1);
    r->write(encode(request(7, {})).to_bytes(), /*wake=*/false);
    REQUIRE(::shutdown(r->raw.fd, SHUT_WR) == 0);
    closed_with();
  }
  SUBCASE("frames in the ring when the socket ends are delivered first") {
    auto r = good_ring();
    r->write(encode(request(8, {at::arange(10, at::kFloat)})).to_bytes(), /*wake=*/false);
    REQUIRE(::shutdown(r->raw.fd, SHUT_WR) == 0);
    REQUIRE(b.wait([&] { return b.closed.size() == 1; }, 5s));
    std::lock_guard<std::mutex> lock(b.mu);
    REQUIRE(b.got.size() == 3);
    CHECK(b.got[2].id == 8);
    CHECK(b.closed[0].second.find("closed the connection") != std::string::npos);
  }
  SUBCASE("an unknown byte on the ring's socket") {
    auto r = good_ring();
    expect = "byte 88 on a ring's socket";
    r->raw.write("X");
    closed_with();
  }
  SUBCASE("a descriptor without its 'F'") {
    auto r = good_ring();
    expect = "descriptors without their 'F' byte";
    int fd = make_segment(1 << 20);
    r->raw.write(std::string(1, kRingWake), {fd});
    closed_with();
    ::close(fd);
  }
  SUBCASE("a well-formed ring carries a request") {
    auto r = good_ring();
    r->write(encode(request(9, {at::arange(100, at::kFloat)})).to_bytes());
    REQUIRE(b.wait([&] { return b.got.size() == 3; }));
    CHECK(at::equal(received(b, 2), at::arange(100, at::kFloat)));
    CHECK(b.closed.empty());
  }
  // The transport still serves a well-behaved peer, through rings.
  Endpoint a(shm_transport());
  auto good = open(a, b, port, /*local=*/true);
  good->send(encode(request(42, {at::arange(1 << 10, at::kFloat)})));
  REQUIRE(b.wait([&] { return !b.got.empty() && b.got.back().id == 42; }));
}

TEST_CASE("shm: a frame naming shared tensors is refused on a TCP connection") {
  Endpoint b(tcp_transport());
  int port = b.t->listen("127.0.0.1", 0);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  Message hello;
  hello.kind = MessageKind::kHello;
  std::string bytes;
  for (uint8_t step : {1, 3}) {
    hello.hello_step = step;
    bytes += encode(hello).to_bytes();
  }
  bytes += shared_frame({0, 0, 64});
  REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size()));
  REQUIRE(b.wait([&] { return b.closed.size() == 1; }));
  CHECK(b.closed[0].second.find("which this connection does not carry") != std::string::npos);
  ::close(fd);
}

TEST_CASE("transport: a peer's requests past the unanswered bound are held until answers go") {
  for_each_backend([](const Backend& be) {
    Limits limits;
    limits.max_unanswered_requests = 8;
    Endpoint a(be.make), b(be.make, limits);
    int port = b.t->listen("127.0.0.1", 0);
    auto c = open(a, b, port, be.local);
    for (int i = 1; i <= 100; ++i) c->send(encode(request(i)));
    c->send(encode(request(0)));  // one way: no answer owed, never counted
    REQUIRE(b.wait([&] { return b.got.size() == 8; }));
    std::this_thread::sleep_for(100ms);
    CHECK(b.messages() == 8);  // the rest is held
    CHECK(b.t->stats().read_pauses == 1);
    greet_back(b);
    auto answer = [&](size_t i) {
      Message r;
      r.kind = MessageKind::kResponse;
      {
        std::lock_guard<std::mutex> lock(b.mu);
        r.id = b.got.at(i).id;
      }
      b.peer->send(encode(r));
    };
    for (size_t i = 0; i < 3; ++i) answer(i);
    std::this_thread::sleep_for(100ms);
    CHECK(b.messages() == 8);  // 5 unanswered: more than half the bound
    answer(3);                 // 4: half, so the held ones come, up to the bound again
    REQUIRE(b.wait([&] { return b.got.size() == 12; }));
    // Answering each as it comes lets everything through, in order.
    for (size_t i = 4; i < 100; ++i) {
      REQUIRE(b.wait([&] { return b.got.size() > i; }));
      answer(i);
    }
    REQUIRE(b.wait([&] { return b.got.size() == 101; }));
    std::lock_guard<std::mutex> lock(b.mu);
    for (size_t i = 0; i < 100; ++i) CHECK(b.got[i].id == i + 1);
    CHECK(b.got[100].id == 0);
  });
}
