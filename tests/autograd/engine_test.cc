// The distributed backward engine alone, without an rpc::Agent: two or three
// Engines wired together in process by a fake EngineLink, over graphs built
// by hand (SendBackward / RecvBackward pairs, as recording makes them).
// Gradients equal local LibTorch's; a shared subgraph runs once; an
// unreached send is never waited for; a node's failure reaches the root
// naming its worker; a gradient the link drops fails backward at the
// timeout; gradients that overtake `run` wait for it; receives that run in
// a row send one message; a part's last gradients ride in its reply.
#include "test_util.h"

#include <ATen/ops/mm.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/tanh.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "tandem/autograd/context.h"
#include "tandem/autograd/engine.h"
#include "tandem/autograd/recording.h"
#include "tandem/rpc/errors.h"

using namespace tandem;
using namespace std::chrono_literals;
using autograd::variable_list;

namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

// Threads running posted functions in order of posting; stop() drops what
// is still queued and joins them.
class Executor {
 public:
  explicit Executor(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
  }
  ~Executor() { stop(); }

  void post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      queue_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }
  void stop() {
    std::deque<std::function<void()>> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
      dropped.swap(queue_);
    }
    cv_.notify_all();
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  bool on_this_thread() const {
    for (const auto& t : threads_) {
      if (t.get_id() == std::this_thread::get_id()) return true;
    }
    return false;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopped_ || !queue_.empty(); });
        if (stopped_) return;
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopped_ = false;
  std::vector<std::thread> threads_;
};

class Net;

// One worker: its contexts and engine, a delivery thread (its "loop") and a
// pool, as an agent has.
struct Worker {
  int rank = 0;
  std::string name;
  Executor loop{1};
  Executor pool{2};
  std::shared_ptr<autograd::Contexts> contexts;
  std::shared_ptr<autograd::Engine> engine;
};

// What the wire does to gradients: the receiver gets copies.
variable_list copied(const variable_list& grads) {
  variable_list out;
  for (const auto& g : grads) out.push_back(g.defined() ? g.clone() : at::Tensor());
  return out;
}

// What the wire does to an error: its kind and text travel, and the
// receiver names the worker it came from (rpc::Agent::reply, make_error).
std::exception_ptr over_wire(std::exception_ptr e, const std::string& worker) {
  auto [code, text] = rpc::describe_error(e);
  return rpc::make_error(code, worker, text);
}

// An in-process network of engines.
class Net {
 public:
  explicit Net(int n);
  ~Net() {
    for (auto& w : workers_) {
      w->loop.stop();
      w->pool.stop();
    }
  }
  Worker& operator[](int r) { return *workers_.at(r); }
  int size() const { return static_cast<int>(workers_.size()); }

  // Gradients for these autograd messages are lost on the way.
  std::set<uint64_t> drop;
  // `run` requests wait this long before they reach their worker.
  std::chrono::milliseconds run_delay{0};
  // Gradients sent, by autograd message id: in `grad` messages, or riding
  // in a `run` reply (riding()).
  std::map<uint64_t, int> grads_sent() {
    std::lock_guard<std::mutex> lock(mu_);
    return grads_sent_;
  }
  std::map<uint64_t, int> riding() {
    std::lock_guard<std::mutex> lock(mu_);
    return riding_;
  }
  // `grad` messages sent (each carries one or more messages' gradients).
  int grad_messages() {
    std::lock_guard<std::mutex> lock(mu_);
    return grad_messages_;
  }
  void count_message() {
    std::lock_guard<std::mutex> lock(mu_);
    ++grad_messages_;
  }
  void count_grad(uint64_t message, bool carried = false) {
    std::lock_guard<std::mutex> lock(mu_);
    ++grads_sent_[message];
    if (carried) ++riding_[message];
  }
  uint64_t next_message(int sender) {
    return last_message = autograd::make_id(sender, next_message_);
  }
  uint64_t last_message = 0;  // the id transfer() gave last

 private:
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex mu_;
  std::map<uint64_t, int> grads_sent_, riding_;
  int grad_messages_ = 0;
  std::atomic<uint64_t> next_message_{1};
};

// The engine's messages between the workers of a Net.
class FakeLink final : public autograd::EngineLink {
 public:
  FakeLink(Net& net, int me) : net_(net), me_(me) {}

  rpc::RawFuture run(int worker, const autograd::RunRequest& request) override {
    auto out = rpc::make_raw_future();
    Worker& to = net_[worker];
    auto delay = net_.run_delay;
    to.pool.post([&to, request, out, delay, &net = net_] {
      std::this_thread::sleep_for(delay);
      try {
        to.engine->run_part(request)->addCallback(
            [out, name = to.name, &net](c10::ivalue::Future& f) {
              if (f.hasError()) return out->setError(over_wire(f.exception_ptr(), name));
              if (f.value().isNone()) return out->markCompleted(c10::IValue());
              // The part's last gradients, riding in its reply (copies, or lost).
              std::vector<autograd::MessageGrads> sent;
              for (auto& g : autograd::MessageGrads::parse(
                       f.value().toTupleRef().elements().vec(), 0, "a reply")) {
                net.count_grad(g.message, /*carried=*/true);
                if (!net.drop.count(g.message)) sent.push_back({g.message, copied(g.grads)});
              }
              if (sent.empty()) return out->markCompleted(c10::IValue());
              std::vector<c10::IValue> items;
              autograd::MessageGrads::append(items, std::move(sent));
              out->markCompleted(c10::ivalue::Tuple::create(std::move(items)));
            });
      } catch (...) {
        out->setError(over_wire(std::current_exception(), to.name));
      }
    });
    return out;
  }

  void send_grads(int worker, uint64_t context, uint64_t task,
                  std::vector<autograd::MessageGrads> grads) override {
    std::vector<autograd::MessageGrads> sent;
    for (auto& g : grads) {
      net_.count_grad(g.message);
      if (!net_.drop.count(g.message)) sent.push_back({g.message, copied(g.grads)});
    }
    net_.count_message();
    if (sent.empty()) return;
    Worker& to = net_[worker];
    to.loop.post([&to, context, task, sent = std::move(sent)]() mutable {
      to.engine->on_grad_from_loop(context, task, std::move(sent));
    });
  }

  void abort(int worker, uint64_t context, uint64_t task) noexcept override {
    Worker& to = net_[worker];
    to.pool.post([&to, context, task] { to.engine->on_abort(context, task); });
  }

  void tell_root(int root, uint64_t context, uint64_t task,
                 std::exception_ptr error) noexcept override {
    Worker& to = net_[root];
    auto e = over_wire(error, net_[me_].name);
    to.pool.post([&to, context, task, e] { to.engine->on_failure(context, task, e); });
  }

  void post(std::function<void()> fn) override { net_[me_].pool.post(std::move(fn)); }
  std::chrono::milliseconds default_timeout() const override { return 10s; }
  std::chrono::microseconds spin() const override { return 50us; }
  bool on_loop_thread() const override { return net_[me_].loop.on_this_thread(); }

 private:
  Net& net_;
  const int me_;
};

Net::Net(int n) {
  for (int r = 0; r < n; ++r) {
    auto w = std::make_unique<Worker>();
    w->rank = r;
    w->name = "worker" + std::to_string(r);
    // A release goes on to the workers that took part, as over the agent.
    w->contexts =
        std::make_shared<autograd::Contexts>(r, w->name, [this, r](int worker, uint64_t id) {
          auto out = rpc::make_raw_future();
          Worker& to = (*this)[worker];
          to.pool.post([&to, id, r, out] {
            to.contexts->release(id, r)->addCallback(
                [out](c10::ivalue::Future&) { out->markCompleted(c10::IValue()); });
          });
          return out;
        });
    w->engine =
        std::make_shared<autograd::Engine>(w->contexts, std::make_shared<FakeLink>(*this, r));
    workers_.push_back(std::move(w));
  }
}

// What recording does for one message: `tensors` (which require grad) go
// from `from` to `to` in context `ctx`. The sender keeps a SendBackward
// under a new message id; the receiver gets copies whose grad_fn is one
// RecvBackward holding the message's reach.
std::vector<at::Tensor> transfer(Net& net, uint64_t ctx, int from, int to,
                                 const std::vector<at::Tensor>& tensors) {
  const uint64_t message = net.next_message(from);
  torch::autograd::edge_list edges;
  for (const auto& t : tensors) edges.push_back(torch::autograd::impl::gradient_edge(t));
  auto send = std::make_shared<autograd::SendBackward>(ctx, message, to, std::move(edges));
  for (const auto& t : tensors) send->add_input_metadata(t);
  auto src = net[from].contexts->get_or_create(ctx);
  {
    std::lock_guard<std::mutex> lock(src->mu);
    src->sends.emplace(message, send);
    src->known_workers.insert(to);
  }
  auto dst = net[to].contexts->get_or_create(ctx);
  {
    std::lock_guard<std::mutex> lock(dst->mu);
    ++dst->recvs;
  }
  auto recv =
      std::make_shared<autograd::RecvBackward>(ctx, message, from, autograd::reach_of(tensors));
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) {
    at::Tensor copy = t.detach().clone();
    torch::autograd::set_history(copy, recv);
    out.push_back(copy);
  }
  return out;
}
at::Tensor transfer(Net& net, uint64_t ctx, int from, int to, const at::Tensor& t) {
  return transfer(net, ctx, from, to, std::vector<at::Tensor>{t}).front();
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  INFO(what);
  REQUIRE(got.defined());
  REQUIRE(got.sizes() == want.sizes());
  const double scale = std::max(1.0, want.abs().max().item<double>());
  CHECK((got - want).abs().max().item<double>() <= 1e-9 * scale);
}

at::Tensor grad_on(Net& net, int worker, uint64_t ctx, const at::Tensor& leaf) {
  auto grads = net[worker].contexts->gradients(ctx);
  auto it = grads.find(leaf);
  REQUIRE(it != grads.end());
  return it->value();
}

// Releases `ctx` from the root and checks that no worker keeps anything.
void release_everywhere(Net& net, uint64_t ctx) {
  CHECK(rpc::wait_raw(net[0].contexts->release(ctx), 5s));
  for (int r = 0; r < net.size(); ++r) {
    INFO("worker" << r);
    CHECK(net[r].contexts->live() == 0);
  }
}

}  // namespace

TEST_CASE("engine: a chain over three engines equals local autograd") {
  {
    Net net(3);
    auto x = at::randn({4, 8}, kF64).requires_grad_();
    auto w1 = at::randn({8, 6}, kF64).requires_grad_();
    auto w2 = at::randn({6, 3}, kF64).requires_grad_();
    const uint64_t ctx = net[0].contexts->new_context();
    // worker0 -> worker1 -> worker2 -> worker0, and worker0 sends to itself.
    auto a = transfer(net, ctx, 0, 1, x * 2);
    auto h = transfer(net, ctx, 1, 2, at::tanh(at::mm(a, w1)));
    auto y = transfer(net, ctx, 2, 0, at::sigmoid(at::mm(h, w2)));
    auto self = transfer(net, ctx, 0, 0, x);
    auto loss = (y * y).sum() + (self * 3).sum();
    net[0].engine->backward(ctx, {loss}, false, 5s);

    auto yl = at::sigmoid(at::mm(at::tanh(at::mm(x * 2, w1)), w2));
    auto want = torch::autograd::grad({(yl * yl).sum() + (x * 3).sum()}, {x, w1, w2});
    expect_close(grad_on(net, 0, ctx, x), want[0], "x on worker0");
    expect_close(grad_on(net, 1, ctx, w1), want[1], "w1 on worker1");
    expect_close(grad_on(net, 2, ctx, w2), want[2], "w2 on worker2");
    CHECK(!x.grad().defined());
    release_everywhere(net, ctx);
  }
}

TEST_CASE("engine: a shared subgraph runs once, after every gradient that will reach it") {
  Net net(2);
  auto x = at::randn({3, 4}, kF64).requires_grad_();
  auto w = at::randn({4, 4}, kF64).requires_grad_();
  const uint64_t ctx = net[0].contexts->new_context();
  auto xb = transfer(net, ctx, 0, 1, x);
  auto s = at::mm(xb, w);  // shared by both results below
  int runs = 0;
  s.register_hook([&runs](at::Tensor g) {
    ++runs;
    return g;
  });
  // Two messages back, so two gradients come to worker1 for s.
  auto y1 = transfer(net, ctx, 1, 0, s * 3);
  auto y2 = transfer(net, ctx, 1, 0, at::sin(s));
  net[0].engine->backward(ctx, {y1.sum() + y2.sum()}, false, 5s);
  CHECK(runs == 1);

  auto sl = at::mm(x, w);
  auto want = torch::autograd::grad({(sl * 3).sum() + at::sin(sl).sum()}, {x, w});
  expect_close(grad_on(net, 0, ctx, x), want[0], "x");
  expect_close(grad_on(net, 1, ctx, w), want[1], "w");
  // One gradient message per message that carried tensors back: x's send
  // got one, summed on worker1, not one per use.
  auto sent = net.grads_sent();
  CHECK(sent.size() == 3);
  for (const auto& [message, n] : sent) CHECK(n == 1);
  release_everywhere(net, ctx);
}

TEST_CASE("engine: a send whose result is never used is not waited for") {
  Net net(3);
  auto x = at::randn({5}, kF64).requires_grad_();
  const uint64_t ctx = net[0].contexts->new_context();
  auto used = transfer(net, ctx, 0, 1, x);
  auto unused = transfer(net, ctx, 0, 1, x * 2);  // its result goes nowhere
  auto y = transfer(net, ctx, 1, 0, used * 3);
  transfer(net, ctx, 1, 0, unused * 5);  // comes back, but the loss ignores it
  transfer(net, ctx, 1, 2, used * 7);    // on to worker2, unused there
  auto t0 = std::chrono::steady_clock::now();
  net[0].engine->backward(ctx, {y.sum()}, false, 5s);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  expect_close(grad_on(net, 0, ctx, x), at::full_like(x, 3), "x");
  CHECK(net.grads_sent().size() == 2);  // y's and used's gradients, nothing else
  release_everywhere(net, ctx);
}

TEST_CASE("engine: an exception in a node reaches the root, naming its worker") {
  Net net(3);
  auto x = at::randn({4}, kF64).requires_grad_();
  const uint64_t ctx = net[0].contexts->new_context();
  auto a = transfer(net, ctx, 0, 1, x);
  auto bad = a * 3;
  bad.register_hook([](at::Tensor) -> at::Tensor { throw std::runtime_error("boom in backward"); });
  auto y1 = transfer(net, ctx, 1, 0, bad);
  auto y2 = transfer(net, ctx, 2, 0, transfer(net, ctx, 0, 2, x) * 2);
  try {
    net[0].engine->backward(ctx, {y1.sum() + y2.sum()}, false, 5s);
    FAIL("backward did not throw");
  } catch (const rpc::RemoteError& e) {
    CHECK(e.worker() == "worker1");
    CHECK(std::string(e.what()).find("boom in backward") != std::string::npos);
  }
  release_everywhere(net, ctx);
}

TEST_CASE("engine: a gradient lost on the way fails backward at the timeout") {
  {
    Net net(2);
    auto x = at::randn({4}, kF64).requires_grad_();
    const uint64_t ctx = net[0].contexts->new_context();
    auto xb = transfer(net, ctx, 0, 1, x);
    auto y = transfer(net, ctx, 1, 0, xb * 2);
    const uint64_t back = net.last_message;
    net.drop.insert(back);  // worker0's gradient for y never reaches worker1
    auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(net[0].engine->backward(ctx, {y.sum()}, false, 300ms), rpc::TimeoutError);
    auto took = std::chrono::steady_clock::now() - t0;
    CHECK(took >= 300ms);
    CHECK(took < 2s);
    CHECK(net.grads_sent().count(back) == 1);
    release_everywhere(net, ctx);
  }
}

TEST_CASE("engine: gradients that overtake `run` wait for it") {
  Net net(2);
  net.run_delay = 100ms;  // worker0's gradients reach worker1 before its `run`
  auto x = at::randn({4}, kF64).requires_grad_();
  auto w = at::randn({4}, kF64).requires_grad_();
  const uint64_t ctx = net[0].contexts->new_context();
  auto xb = transfer(net, ctx, 0, 1, x);
  auto y1 = transfer(net, ctx, 1, 0, xb * w);
  auto y2 = transfer(net, ctx, 1, 0, at::sin(xb));
  net[0].engine->backward(ctx, {(y1 * y1).sum() + y2.sum()}, false, 5s);
  auto want = torch::autograd::grad({(x * w * x * w).sum() + at::sin(x).sum()}, {x, w});
  expect_close(grad_on(net, 0, ctx, x), want[0], "x");
  expect_close(grad_on(net, 1, ctx, w), want[1], "w");
  CHECK(net.grads_sent().size() == 3);
  CHECK(net.riding().size() == 1);  // x's, in worker1's reply
  release_everywhere(net, ctx);
}

TEST_CASE("engine: gradients that RecvBackwards leave in a row travel as one message") {
  Net net(2);
  auto x = at::randn({3}, kF64).requires_grad_();
  const uint64_t ctx = net[0].contexts->new_context();
  auto xb = transfer(net, ctx, 0, 1, x);
  auto y1 = transfer(net, ctx, 1, 0, xb * 2);
  auto y2 = transfer(net, ctx, 1, 0, xb * 3);
  // Both receives are ready at once on worker0, below y1 + y2.
  net[0].engine->backward(ctx, {(y1 + y2).sum()}, false, 5s);
  expect_close(grad_on(net, 0, ctx, x), at::full_like(x, 5), "x");
  CHECK(net.grads_sent().size() == 3);
  CHECK(net.grad_messages() == 1);  // y1's and y2's together; x's rode in the reply
  CHECK(net.riding().size() == 1);
  release_everywhere(net, ctx);
}

TEST_CASE("engine: a part's last gradients ride in its `run` reply") {
  Net net(2);
  auto x = at::randn({3}, kF64).requires_grad_();
  auto w = at::randn({3}, kF64).requires_grad_();
  const uint64_t ctx = net[0].contexts->new_context();
  auto xb = transfer(net, ctx, 0, 1, x);
  const uint64_t there = net.last_message;
  auto y = transfer(net, ctx, 1, 0, at::tanh(xb * w));
  const uint64_t back = net.last_message;
  net[0].engine->backward(ctx, {y.sum()}, false, 5s);
  auto want = torch::autograd::grad({at::tanh(x * w).sum()}, {x, w});
  expect_close(grad_on(net, 0, ctx, x), want[0], "x");
  expect_close(grad_on(net, 1, ctx, w), want[1], "w");
  // y's gradient went in a `grad` message, x's rode in worker1's reply.
  CHECK(net.grads_sent() == std::map<uint64_t, int>{{there, 1}, {back, 1}});
  CHECK(net.riding() == std::map<uint64_t, int>{{there, 1}});
  CHECK(net.grad_messages() == 1);

  // Two hops there and back: the gradients between the first and the last
  // go on their own, and the result is the same as local autograd's.
  auto a = transfer(net, ctx, 0, 1, x);
  auto b = transfer(net, ctx, 1, 0, a * w);
  auto c = transfer(net, ctx, 0, 1, at::sin(b));
  auto d = transfer(net, ctx, 1, 0, c * w);
  net[0].contexts->get(ctx)->grads.clear();
  net[1].contexts->get(ctx)->grads.clear();
  const auto before = net.grads_sent().size();
  net[0].engine->backward(ctx, {d.sum()}, false, 5s);
  auto want2 = torch::autograd::grad({(at::sin(x * w) * w).sum()}, {x, w});
  expect_close(grad_on(net, 0, ctx, x), want2[0], "x, two hops");
  expect_close(grad_on(net, 1, ctx, w), want2[1], "w, two hops");
  CHECK(net.grads_sent().size() == before + 4);
  CHECK(net.riding().size() == 2);  // a's of the four new ones
  CHECK(net.grad_messages() == 4);
  release_everywhere(net, ctx);
}
