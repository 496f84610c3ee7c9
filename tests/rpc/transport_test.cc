// The transport contract (rpc/transport.h), checked against every backend:
// TCP, and the fault-injecting decorator over TCP with no faults planned
// (a shared-memory backend joins the list when it lands). Then the
// decorator's own faults, one by one.
#include "test_util.h"

#include <ATen/ops/full.h>

#include <condition_variable>
#include <mutex>

#include "tandem/rpc/transport.h"
#include "tandem/rpc/transport/faulty/faulty_transport.h"

using namespace tandem::rpc;
using namespace std::chrono_literals;

namespace {

struct Backend {
  std::string name;
  TransportFactory make;
};

std::vector<Backend> backends() {
  return {{"tcp", tcp_transport()},
          {"faulty(tcp), no faults", faulty_transport(std::make_shared<FaultPlan>())}};
}

// One transport and what its callbacks saw.
struct Endpoint {
  explicit Endpoint(const TransportFactory& make) {
    Transport::Callbacks cb;
    cb.on_message = [this](const ConnectionPtr& c, Message&& m) {
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
    t = make(Limits{}, std::move(cb));
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
// accepted connection writes two handshake frames first: rpc/auth.h) and
// seen by `b`, which then forgets the greeting: b.got holds what follows.
ConnectionPtr open(Endpoint& a, Endpoint& b, int port) {
  auto c = a.t->connect("127.0.0.1", port, 5s);
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

// Runs `body(name, factory)` for every backend, each as its own subcase.
template <class F>
void for_each_backend(F body) {
  for (const auto& b : backends()) {
    SUBCASE(b.name.c_str()) { body(b.make); }
  }
}

}  // namespace

TEST_CASE("transport: empty, large and many-tensor messages arrive intact and in order") {
  for_each_backend([](const TransportFactory& make) {
    Endpoint a(make), b(make);
    int port = b.t->listen("127.0.0.1", 0);
    auto c = open(a, b, port);
    c->send(encode(request(1)));  // no values at all
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
  for_each_backend([](const TransportFactory& make) {
    Endpoint a(make), b(make);
    int port = b.t->listen("127.0.0.1", 0);
    SUBCASE("the connecting side closes") {
      auto c = open(a, b, port);
      c->close("");
      REQUIRE(a.wait([&] { return !a.closed.empty(); }));
      REQUIRE(b.wait([&] { return !b.closed.empty(); }));
      CHECK(a.closed.at(0).second.empty());  // an orderly close by this side
      CHECK(c->closed());
      CHECK_THROWS_AS(c->send(encode(request(9))), DisconnectedError);
      c->close("again");  // idempotent
    }
    SUBCASE("the accepting side closes") {
      auto c = open(a, b, port);
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
  for_each_backend([](const TransportFactory& make) {
    Endpoint a(make), b(make);
    int port = b.t->listen("127.0.0.1", 0);
    auto c = open(a, b, port);
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
  for_each_backend([](const TransportFactory& make) {
    Endpoint a(make), b(make);
    int port = b.t->listen("127.0.0.1", 0);
    auto c = open(a, b, port);
    c->send(encode(request(1)));
    c->close("");  // on_closed must not run inside close()
    {
      std::lock_guard<std::mutex> lock(a.mu);
      CHECK(a.closed.empty());  // (the report comes later, from the loop)
    }
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
  for_each_backend([](const TransportFactory& make) {
    Endpoint a(make);
    auto b = std::make_unique<Endpoint>(make);
    int port = b->t->listen("127.0.0.1", 0);
    auto c = open(a, *b, port);
    b.reset();  // the whole peer goes, its listener too
    REQUIRE(a.wait([&] { return a.closed.size() == 1; }));
    CHECK_FALSE(a.closed.at(0).second.empty());
    CHECK_THROWS_AS(c->send(encode(request(1))), DisconnectedError);
    CHECK_THROWS_AS(a.t->connect("127.0.0.1", port, 1s), DisconnectedError);
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
