// Per-step fault tolerance (ft/manager.h), replicas as threads of this
// process meeting at a store of the test's own: the quorum, the vote, a
// replica that fails or vanishes, healing a newcomer, divergence, refusals.
// Every run is compared with a reference computed in one model the same way
// (a failed step dropped, each committed step's mean over its quorum's
// batches). Killing processes is examples/check_ft.sh's.
#include <ATen/ops/full.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <unistd.h>

#include <functional>
#include <sstream>

#include "ddp/ddp_support.h"
#include "tandem/ft/heartbeat.h"
#include "tandem/ft/manager.h"
#include "tandem/rpc/agent.h"
#include "test_util.h"

namespace tandem::test {
namespace {

constexpr int64_t kData = 40;
constexpr int64_t kBatch = 3;

struct Data {
  at::Tensor x, y;
  Data() {
    at::manual_seed(7);
    x = at::randn({kData, 4});
    y = at::randn({kData, 2});
  }
};

// (one at a time: the replicas' threads share the default generator)
torch::nn::Linear make_model(uint64_t seed, int64_t out = 2) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  at::manual_seed(seed);
  return torch::nn::Linear(4, out);
}

ft::ManagerOptions options(int id, int max, int port) {
  ft::ManagerOptions o;
  o.replica_id = id;
  o.max_replicas = max;
  o.connect = [port] { return c10::intrusive_ptr<c10d::Store>(support::store_client(port)); };
  o.job = "test";
  o.token = "secret";
  o.heartbeat_interval = std::chrono::milliseconds(40);
  o.heartbeat_timeout = std::chrono::milliseconds(400);
  o.join_timeout = std::chrono::milliseconds(1500);
  o.quorum_timeout = std::chrono::seconds(20);
  o.collective_timeout = std::chrono::seconds(20);
  o.dataset_size = kData;
  o.batch_size = kBatch;
  o.seed = 3;
  return o;
}

// One committed step as the replicas saw it: how many took part.
struct Record {
  std::mutex mu;
  std::map<int, std::vector<int>> participants;  // per replica: per committed step
  std::map<int, at::Tensor> final_weight;
};

// The reference: one model, each committed step over participants x kBatch
// samples of the stream in order (the mean over the quorum's batches).
at::Tensor reference(const Data& d, const std::vector<int>& participants) {
  auto model = make_model(1);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  int64_t cursor = 0;
  for (int k : participants) {
    opt.zero_grad();
    at::Tensor loss = at::zeros({});
    for (int r = 0; r < k; ++r) {
      auto idx = ft::sample_stream(kData, 3, true, cursor + r * kBatch, kBatch);
      auto i = at::tensor(idx, at::kLong);
      loss = loss + torch::nn::functional::mse_loss(model(d.x.index_select(0, i)),
                                                    d.y.index_select(0, i)) /
                        k;
    }
    loss.backward();
    opt.step();
    cursor += k * kBatch;
  }
  return model->weight.detach().clone();
}

// A replica's training loop; `hook(step_tried, manager)` runs after
// start_step and may fail the replica's step or end it (return false).
void train(int id, int max, int port, int steps, const Data& d, Record& rec,
           const std::function<bool(int, ft::Manager&, torch::nn::Linear&)>& hook = {},
           uint64_t init_seed = 1) {
  auto model = make_model(init_seed);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  ft::Manager manager(options(id, max, port), ft::module_state(*model, opt));
  int tried = 0;
  while (manager.step() < steps) {
    manager.start_step();
    if (hook && !hook(tried, manager, model)) return;
    ++tried;
    opt.zero_grad();
    auto i = at::tensor(manager.batch_indices(), at::kLong);
    auto loss =
        torch::nn::functional::mse_loss(model(d.x.index_select(0, i)), d.y.index_select(0, i));
    loss.backward();
    manager.allreduce_grads({model->weight.grad(), model->bias.grad()});
    const int k = manager.participants();
    if (manager.should_commit()) {
      opt.step();
      std::lock_guard<std::mutex> lock(rec.mu);
      rec.participants[id].push_back(k);
    }
  }
  std::lock_guard<std::mutex> lock(rec.mu);
  rec.final_weight[id] = model->weight.detach().clone();
}

void expect_reference(const Data& d, Record& rec, int survivor) {
  const at::Tensor want = reference(d, rec.participants[survivor]);
  const at::Tensor got = rec.final_weight[survivor];
  CHECK(at::allclose(got, want, 1e-5, 1e-6));
  for (auto& [id, w] : rec.final_weight) {
    INFO("replica " << id);
    CHECK(at::equal(w, got));  // bit for bit: the fingerprint would have said otherwise
  }
}

}  // namespace

TEST_CASE("ft: three replicas train as one model over the sample stream") {
  Data d;
  auto server = support::store_server();
  Record rec;
  on_ranks(3, [&](int id) { train(id, 3, server->getPort(), 6, d, rec); });
  CHECK(rec.participants[0] == std::vector<int>(6, 3));
  expect_reference(d, rec, 0);
}

TEST_CASE("ft: the sample stream covers every sample of an epoch once, in a seeded order") {
  auto a = ft::sample_stream(10, 5, true, 0, 10);
  std::set<int64_t> seen(a.begin(), a.end());
  CHECK(seen.size() == 10);
  CHECK(a == ft::sample_stream(10, 5, true, 0, 10));
  CHECK(a != ft::sample_stream(10, 6, true, 0, 10));
  CHECK(ft::sample_stream(10, 5, true, 10, 10) != a);  // the next epoch: another order
  CHECK(ft::sample_stream(4, 0, false, 2, 4) == std::vector<int64_t>{2, 3, 0, 1});
  CHECK_THROWS_AS(ft::sample_stream(0, 0, true, 0, 1), std::invalid_argument);
}

TEST_CASE("ft: a step with a replica's error is committed by none, and the replicas go on") {
  Data d;
  auto server = support::store_server();
  Record rec;
  std::atomic<int> failed_votes{0};
  on_ranks(3, [&](int id) {
    train(id, 3, server->getPort(), 5, d, rec, [&](int tried, ft::Manager& m, torch::nn::Linear&) {
      if (tried == 2 && id == 1) m.report_error("loss was NaN");
      if (tried == 3 && !m.last_error().empty()) ++failed_votes;
      if (tried == 3) CHECK(m.metrics().steps_failed == 1);
      return true;
    });
  });
  // Step 3 was tried twice: the first try was dropped everywhere.
  CHECK(rec.participants[0] == std::vector<int>(5, 3));
  expect_reference(d, rec, 0);
}

TEST_CASE("ft: a replica that vanishes mid-step fails the step; the survivors go on without it") {
  Data d;
  auto server = support::store_server();
  Record rec;
  on_ranks(3, [&](int id) {
    train(id, 3, server->getPort(), 6, d, rec, [&](int tried, ft::Manager&, torch::nn::Linear&) {
      return !(id == 2 && tried == 2);  // replica 2 leaves after starting step 3
    });
  });
  CHECK(rec.participants[0] == std::vector<int>({3, 3, 2, 2, 2, 2}));
  rec.final_weight.erase(2);
  expect_reference(d, rec, 0);
}

TEST_CASE("ft: a newcomer is healed from a peer's memory and trains in the next quorum") {
  Data d;
  auto server = support::store_server();
  Record rec;
  std::atomic<bool> leaver_gone{false};
  int64_t healed_bytes = 0, state_bytes = 0, heals = 0;
  on_ranks(4, [&](int thread) {
    if (thread < 3) {
      train(thread, 3, server->getPort(), 12, d, rec,
            [&](int tried, ft::Manager&, torch::nn::Linear&) {
              if (thread == 2 && tried == 2) {
                leaver_gone = true;
                return false;
              }
              std::this_thread::sleep_for(std::chrono::milliseconds(100));
              return true;
            });
      return;
    }
    // The newcomer: replica 2 again, from another initialisation.
    REQUIRE(eventually([&] { return leaver_gone.load(); }, std::chrono::seconds(20)));
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    auto model = make_model(99);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    ft::Manager manager(options(2, 3, server->getPort()), ft::module_state(*model, opt));
    while (manager.step() < 12) {
      manager.start_step();
      opt.zero_grad();
      auto i = at::tensor(manager.batch_indices(), at::kLong);
      torch::nn::functional::mse_loss(model(d.x.index_select(0, i)), d.y.index_select(0, i))
          .backward();
      manager.allreduce_grads({model->weight.grad(), model->bias.grad()});
      if (manager.should_commit()) opt.step();
    }
    heals = manager.metrics().heals;
    healed_bytes = manager.metrics().heal_bytes_received;
    state_bytes = manager.metrics().state_bytes;
    std::lock_guard<std::mutex> lock(rec.mu);
    rec.final_weight[2] = model->weight.detach().clone();
  });
  CHECK(heals == 1);
  CHECK(state_bytes > 0);
  CHECK(static_cast<double>(healed_bytes) <= 1.1 * static_cast<double>(state_bytes) + 4096);
  const auto& p = rec.participants[0];
  REQUIRE(p.size() == 12);
  CHECK(p.back() == 3);  // the newcomer took part in the last step
  expect_reference(d, rec, 0);
}

TEST_CASE("ft: a newcomer with another model is refused by name, and the quorum goes on") {
  Data d;
  auto server = support::store_server();
  Record rec;
  std::string refusal;
  on_ranks(3, [&](int thread) {
    if (thread < 2) {
      train(thread, 3, server->getPort(), 8, d, rec, [&](int, ft::Manager&, torch::nn::Linear&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        return true;
      });
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto model = make_model(1, 3);  // three outputs, not two
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto o = options(2, 3, server->getPort());
    try {
      ft::Manager manager(o, ft::module_state(*model, opt));
      manager.start_step();
    } catch (const std::invalid_argument& e) {
      refusal = e.what();
    }
  });
  CHECK(refusal.find("refused") != std::string::npos);
  CHECK(refusal.find("param/weight") != std::string::npos);
  expect_reference(d, rec, 0);
}

TEST_CASE("ft: replicas whose parameters differ fail the step on every member, naming them") {
  Data d;
  auto server = support::store_server();
  std::vector<std::string> errors(3);
  on_ranks(3, [&](int id) {
    auto model = make_model(1);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    ft::Manager manager(options(id, 3, server->getPort()), ft::module_state(*model, opt));
    try {
      for (int s = 0; s < 3; ++s) {
        manager.start_step();
        if (s == 1 && id == 2) {
          at::NoGradGuard g;
          model->bias.add_(1e-3);
        }
        opt.zero_grad();
        auto i = at::tensor(manager.batch_indices(), at::kLong);
        torch::nn::functional::mse_loss(model(d.x.index_select(0, i)), d.y.index_select(0, i))
            .backward();
        manager.allreduce_grads({model->weight.grad(), model->bias.grad()});
        if (manager.should_commit()) opt.step();
      }
    } catch (const ft::DivergenceError& e) {
      errors[static_cast<size_t>(id)] = e.what();
    }
  });
  for (const std::string& e : errors) {
    CHECK(e.find("replicas 0, 1 hold") != std::string::npos);
    CHECK(e.find("replica 2 holds") != std::string::npos);
  }
}

TEST_CASE("ft: a forged join is refused and a quorum it cannot form times out") {
  auto server = support::store_server();
  auto model = make_model(1);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  // A join for replica 1 written by something without the token.
  auto client = support::store_client(server->getPort());
  const std::string forged = "0 0\nreplicas 2\nnot-a-proof";
  client->set("tandem/ft/test/run.0/q/1/join/1",
              std::vector<uint8_t>(forged.begin(), forged.end()));
  auto o = options(0, 2, server->getPort());
  o.min_replicas = 2;
  o.quorum_timeout = std::chrono::milliseconds(2500);
  ft::Manager manager(o, ft::module_state(*model, opt));
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(manager.start_step(), doctest::Contains("found no quorum of 2"),
                       ft::QuorumError);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(6));
}

TEST_CASE("ft: members whose gradient lists differ fail the step on every member, named") {
  Data d;
  auto server = support::store_server();
  std::vector<std::string> errors(3);
  std::vector<int> committed(3, -1), reduced(3, -1);
  const auto t0 = std::chrono::steady_clock::now();
  on_ranks(3, [&](int id) {
    auto model = make_model(1);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    ft::Manager manager(options(id, 3, server->getPort()), ft::module_state(*model, opt));
    manager.start_step();
    opt.zero_grad();
    auto i = at::tensor(manager.batch_indices(), at::kLong);
    torch::nn::functional::mse_loss(model(d.x.index_select(0, i)), d.y.index_select(0, i))
        .backward();
    // Replica 1 leaves the bias out: its buffer would be shorter than the others'.
    std::vector<at::Tensor> grads{model->weight.grad()};
    if (id != 1) grads.push_back(model->bias.grad());
    reduced[static_cast<size_t>(id)] = manager.allreduce_grads(grads) ? 1 : 0;
    committed[static_cast<size_t>(id)] = manager.should_commit() ? 1 : 0;
    errors[static_cast<size_t>(id)] = manager.last_error();
  });
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(15));
  for (int id = 0; id < 3; ++id) {
    INFO("replica " << id);
    CHECK(reduced[static_cast<size_t>(id)] == 0);
    CHECK(committed[static_cast<size_t>(id)] == 0);
    CHECK(errors[static_cast<size_t>(id)].find("differ in layout") != std::string::npos);
  }
}

namespace {

// A store client that can be cut off: every call throws once `cut` is set.
class CutStore : public c10d::Store {
 public:
  CutStore(c10::intrusive_ptr<c10d::Store> inner, std::atomic<bool>& cut)
      : inner_(std::move(inner)), cut_(cut) {}
  void set(const std::string& k, const std::vector<uint8_t>& v) override {
    check_cut();
    inner_->set(k, v);
  }
  std::vector<uint8_t> compareSet(const std::string& k, const std::vector<uint8_t>& e,
                                  const std::vector<uint8_t>& d) override {
    check_cut();
    return inner_->compareSet(k, e, d);
  }
  std::vector<uint8_t> get(const std::string& k) override {
    check_cut();
    return inner_->get(k);
  }
  int64_t add(const std::string& k, int64_t v) override {
    check_cut();
    return inner_->add(k, v);
  }
  bool deleteKey(const std::string& k) override {
    check_cut();
    return inner_->deleteKey(k);
  }
  bool check(const std::vector<std::string>& k) override {
    check_cut();
    return inner_->check(k);
  }
  int64_t getNumKeys() override {
    check_cut();
    return inner_->getNumKeys();
  }
  void wait(const std::vector<std::string>& k) override {
    check_cut();
    inner_->wait(k);
  }
  void wait(const std::vector<std::string>& k, const std::chrono::milliseconds& t) override {
    check_cut();
    inner_->wait(k, t);
  }

 private:
  void check_cut() {
    if (cut_) throw std::runtime_error("cut off");
  }
  c10::intrusive_ptr<c10d::Store> inner_;
  std::atomic<bool>& cut_;
};

// Replicas 0 and 1 train `steps` steps (each calling `hook`) while replica 2
// runs `silent(port, cut, done)`: it joins and falls silent somewhere on
// the way (`cut` set), and returns once both others are `done`. They must
// finish within `limit` as the reference of two: replica 2 never committed.
void outlast_a_silent_member(
    int steps, std::chrono::seconds limit,
    const std::function<bool(int, ft::Manager&, torch::nn::Linear&)>& hook,
    const std::function<void(int, std::atomic<bool>&, std::atomic<int>&, Record&)>& silent) {
  Data d;
  auto server = support::store_server();
  Record rec;
  std::atomic<bool> cut{false};
  std::atomic<int> done{0};
  std::vector<std::chrono::steady_clock::duration> took(2);
  on_ranks(3, [&](int id) {
    if (id < 2) {
      const auto t0 = std::chrono::steady_clock::now();
      train(id, 3, server->getPort(), steps, d, rec, hook);
      took[static_cast<size_t>(id)] = std::chrono::steady_clock::now() - t0;
      ++done;
      return;
    }
    silent(server->getPort(), cut, done, rec);
  });
  CHECK(took[0] < limit);
  CHECK(took[1] < limit);
  const auto& p = rec.participants[0];
  REQUIRE(p.size() == static_cast<size_t>(steps));
  CHECK(std::all_of(p.begin(), p.end(), [](int k) { return k == 2; }));
  expect_reference(d, rec, 0);
}

// Waits for both others to be done, then gives up as `what`.
template <typename Error>
[[noreturn]] void release_when(const std::atomic<int>& done, const char* what) {
  while (done < 2) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  throw Error(what);
}

}  // namespace

TEST_CASE("ft: a member lost between its quorum's decision and the group's meeting holds nobody") {
  // Without the group's watch they would have waited collective_timeout (20 s).
  outlast_a_silent_member(
      6, std::chrono::seconds(10), {},
      [](int port, std::atomic<bool>& cut, std::atomic<int>& done, Record&) {
        // Replica 2 joins the first quorum, then goes silent as its group is
        // made: its heartbeat's client is cut off, and the group's never comes.
        auto model = make_model(1);
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        auto o = options(2, 3, port);
        int calls = 0;
        o.connect = [&, port]() -> c10::intrusive_ptr<c10d::Store> {
          ++calls;
          if (calls == 2) {  // the heartbeat thread's
            return c10::make_intrusive<CutStore>(support::store_client(port), cut);
          }
          if (calls >= 3) {  // the quorum's group's: lost here
            cut = true;
            release_when<std::runtime_error>(done, "released");
          }
          return support::store_client(port);
        };
        ft::Manager manager(o, ft::module_state(*model, opt));
        CHECK_THROWS(manager.start_step());
      });
}

TEST_CASE(
    "ft: a newcomer that falls silent as it is healed holds its source only until it is found "
    "gone") {
  // Without the watch on the heal's transfers, replica 0 (the source) would
  // have waited collective_timeout (20 s) in its send.
  outlast_a_silent_member(
      30, std::chrono::seconds(12),
      [](int, ft::Manager&, torch::nn::Linear&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(40));
        return true;
      },
      [](int port, std::atomic<bool>& cut, std::atomic<int>& done, Record& rec) {
        // Replica 2 comes once the others train, and stops (its heartbeat
        // silent) in its quorum's set-up, before it receives anything: its
        // source's first send waits for a receiver that does not come.
        REQUIRE(eventually([&] { return !rec.participants[0].empty(); }, std::chrono::seconds(20)));
        auto model = make_model(5);
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        auto o = options(2, 3, port);
        int calls = 0;
        o.connect = [&, port]() -> c10::intrusive_ptr<c10d::Store> {
          if (++calls == 2) {  // the heartbeat thread's
            return c10::make_intrusive<CutStore>(support::store_client(port), cut);
          }
          return support::store_client(port);
        };
        o.on_quorum = [&](ft::Manager&) {
          cut = true;
          release_when<std::logic_error>(done, "released");
        };
        ft::Manager manager(o, ft::module_state(*model, opt));
        CHECK_THROWS_WITH(manager.start_step(), "released");
      });
}

TEST_CASE("ft: a replica that comes after the job's replicas finished is told so") {
  Data d;
  auto server = support::store_server();
  Record rec;
  on_ranks(2, [&](int id) { train(id, 3, server->getPort(), 4, d, rec); });
  // Replica 2 (a replacement started as the job ended) finds nobody to join.
  auto model = make_model(1);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  ft::Manager late(options(2, 3, server->getPort()), ft::module_state(*model, opt));
  const auto t0 = std::chrono::steady_clock::now();
  int64_t finished_at = -1;
  try {
    late.start_step();
  } catch (const ft::JobFinished& e) {
    finished_at = e.step();
    CHECK(std::string(e.what()).find("finished at step 4") != std::string::npos);
  }
  CHECK(finished_at == 4);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  expect_reference(d, rec, 0);
}

TEST_CASE("ft: liveness is a process's: a new process under a member's id does not keep it alive") {
  auto server = support::store_server();
  auto client = [&] {
    return c10::intrusive_ptr<c10d::Store>(support::store_client(server->getPort()));
  };
  const auto interval = std::chrono::milliseconds(30);
  const auto timeout = std::chrono::milliseconds(3000);
  ft::Heartbeat one(client(), 1, 2, interval, timeout);
  ft::Heartbeat zero(client(), 0, 2, interval, timeout);
  REQUIRE(eventually([&] { return zero.alive(1); }, std::chrono::seconds(5)));
  // Replica 1 is a quorum's member as this process.
  std::istringstream me(one.me());
  ft::Heartbeat::Process member;
  member.id = 1;
  me >> member.pid >> member.start >> member.host;
  zero.members({member});
  CHECK(zero.why_gone(1).empty());
  CHECK(zero.alive_as(1, member.host, member.pid, member.start));
  CHECK_FALSE(zero.gone_for_good(1, member.host, member.pid, member.start));
  // Another process takes id 1 (as a replacement does: who/1, then a new
  // incarnation of its counter), while this one's heartbeat goes on.
  auto store = client();
  const std::string who = "elsewhere\n4242\n777";
  store->set("who/1", std::vector<uint8_t>(who.begin(), who.end()));
  const int64_t now = store->add("hb/1", 0);
  store->add("hb/1", (((now >> 32) + 1) << 32) - now);
  REQUIRE(eventually([&] { return !zero.why_gone(1).empty(); }, std::chrono::seconds(5)));
  CHECK(zero.why_gone(1).find("was replaced by process 4242 on elsewhere") != std::string::npos);
  CHECK_FALSE(zero.alive_as(1, member.host, member.pid, member.start));
  CHECK(zero.gone_for_good(1, member.host, member.pid, member.start));
  CHECK(zero.alive_as(1, "elsewhere", 4242, "777"));  // the new process is alive
  CHECK_FALSE(zero.gone_for_good(1, "elsewhere", 4242, "777"));
}

namespace {

// A replica of two processes holding one model between them, ZeRO-style:
// rank 0 owns and steps the weight, rank 1 the bias; each step the owners
// broadcast them over the replica's group, each rank takes its part of the
// replica's batch, the gradients are summed over the replica's group, and
// each owner's gradient is averaged over the quorum's replicas (group():
// the rank-r processes) before it steps. `hook(tried, manager)` may end the
// process (return false).
void train_sharded(int id, int rank, int port, int steps, const Data& d, Record& rec,
                   const std::function<bool(int, ft::Manager&)>& hook = {}, uint64_t init_seed = 1,
                   int64_t* heals = nullptr, bool* late = nullptr) {
  auto model = make_model(init_seed);
  at::Tensor owned = rank == 0 ? model->weight : model->bias;
  torch::nn::Module shard;
  shard.register_parameter("p", owned);
  torch::optim::SGD opt({owned}, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto o = options(id, 2, port);
  o.replica_size = 2;
  o.replica_rank = rank;
  ft::Manager manager(o, ft::module_state(shard, opt));
  CHECK(manager.replica_id() == id);
  int tried = 0;
  while (manager.step() < steps) {
    try {
      manager.start_step();
    } catch (const ft::JobFinished&) {
      if (!late) throw;
      *late = true;  // (as ft_mlp does: the Manager ends with no exception in flight)
      return;
    }
    if (hook && !hook(tried, manager)) return;
    ++tried;
    for (auto& p : model->parameters()) p.mutable_grad() = at::zeros_like(p);
    try {
      auto g = manager.replica_group();
      REQUIRE(g);
      CHECK(g->size() == 2);
      {
        at::NoGradGuard no_grad;
        at::Tensor w = model->weight.detach(), b = model->bias.detach();
        g->broadcast(w, 0, std::chrono::seconds(20));
        g->broadcast(b, 1, std::chrono::seconds(20));
      }
      // This rank's part of the replica's batch, weighted so that the sum
      // over the replica is the batch's mean.
      const auto batch = manager.batch_indices();
      const size_t half = batch.size() / 2;
      std::vector<int64_t> mine(batch.begin() + (rank == 0 ? 0 : static_cast<long>(half)),
                                rank == 0 ? batch.begin() + static_cast<long>(half) : batch.end());
      auto i = at::tensor(mine, at::kLong);
      auto loss =
          torch::nn::functional::mse_loss(model(d.x.index_select(0, i)), d.y.index_select(0, i)) *
          (static_cast<double>(mine.size()) / static_cast<double>(batch.size()));
      loss.backward();
      at::Tensor wg = model->weight.grad(), bg = model->bias.grad();
      g->all_reduce(wg, ddp::ReduceOp::kSum, std::chrono::seconds(20));
      g->all_reduce(bg, ddp::ReduceOp::kSum, std::chrono::seconds(20));
    } catch (const std::exception& e) {
      // (a partner of this replica gone: the step fails everywhere)
      manager.report_error(e.what());
    }
    manager.allreduce_grads({owned.grad()});
    const int k = manager.participants();
    if (manager.should_commit()) {
      opt.step();
      if (rank == 0) {
        std::lock_guard<std::mutex> lock(rec.mu);
        rec.participants[id].push_back(k);
      }
    }
  }
  // The model whole again, for the comparison.
  auto g = manager.replica_group();
  REQUIRE(g);
  at::Tensor w = model->weight.detach(), b = model->bias.detach();
  g->broadcast(w, 0, std::chrono::seconds(20));
  g->broadcast(b, 1, std::chrono::seconds(20));
  if (heals) *heals = manager.metrics().heals;
  std::lock_guard<std::mutex> lock(rec.mu);
  rec.final_weight[id * 2 + rank] = model->weight.detach().clone();
}

}  // namespace

TEST_CASE(
    "ft: replicas of two processes: a lost rank takes its replica out; both ranks rejoin healed") {
  Data d;
  auto server = support::store_server();
  Record rec;
  std::atomic<bool> gone{false};
  int64_t heals[4] = {0, 0, 0, 0};
  on_ranks(5, [&](int thread) {
    const int port = server->getPort();
    if (thread < 4) {
      const int id = thread / 2, rank = thread % 2;
      train_sharded(
          id, rank, port, 14, d, rec,
          [&](int tried, ft::Manager& m) {
            CHECK(m.replica_rank() == rank);
            if (id == 1 && rank == 1 && tried == 3) {
              gone = true;  // replica 1's rank 1 leaves mid-step
              return false;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(60));
            return true;
          },
          1, &heals[thread]);
      return;
    }
    // Its replacement, from another initialisation, once replica 0 has
    // gone on alone for a while.
    REQUIRE(eventually([&] { return gone.load(); }, std::chrono::seconds(20)));
    std::this_thread::sleep_for(std::chrono::milliseconds(900));
    int64_t healed = 0;
    train_sharded(1, 1, port, 14, d, rec, {}, 99, &healed);
    CHECK(healed == 1);
  });
  const auto& p = rec.participants[0];
  REQUIRE(p.size() == 14);
  CHECK(p.front() == 2);
  CHECK(std::find(p.begin(), p.end(), 1) != p.end());  // replica 0 alone for a while
  CHECK(p.back() == 2);                                // replica 1 back, whole
  // Replica 1's rank 0 stayed alive but fell behind: healed again (a first
  // quorum heals every replica but its first, as DDP's broadcast does).
  CHECK(heals[2] == 2);
  CHECK(heals[0] == 0);
  CHECK(heals[1] == 0);
  CHECK(rec.participants[1].back() == 2);
  expect_reference(d, rec, 0);
}

// Replica `id` (of 2)'s process `rank` of `size`, holding model 1's weight
// (rank 1) or bias, trained on gradients of ones for `steps` committed
// steps, `on_quorum` set up in each quorum it joins.
void train_piece(int id, int rank, int size, int port, int64_t steps,
                 std::function<void(ft::Manager&)> on_quorum) {
  auto model = make_model(1);
  torch::nn::Module shard;
  shard.register_parameter("p", rank == 1 ? model->weight : model->bias);
  torch::optim::SGD opt(shard.parameters(), torch::optim::SGDOptions(0.1));
  auto o = options(id, 2, port);
  o.replica_size = size;
  o.replica_rank = rank;
  o.on_quorum = std::move(on_quorum);
  ft::Manager manager(o, ft::module_state(shard, opt));
  CHECK_THROWS_AS(manager.replica_store("rpc"), std::logic_error);  // (outside a quorum)
  CHECK_THROWS_AS(manager.replica_subgroup("pair", {rank}), std::logic_error);
  while (manager.step() < steps) {
    manager.start_step();
    for (auto& p : shard.parameters()) p.mutable_grad() = at::ones_like(p);
    manager.allreduce_grads({shard.parameters()[0].grad()});
    if (manager.should_commit()) opt.step();
  }
}

TEST_CASE(
    "ft: a replica's processes meet over keys of their own in each quorum: an RPC agent per "
    "quorum") {
  // Two replicas of two processes; each quorum, every process makes an RPC
  // agent with its partner alone over Manager::replica_store (as a pipeline
  // row does). Replica 1 leaves after 3 steps: replica 0 forms a quorum
  // alone, and its processes meet again over fresh keys.
  auto server = support::store_server();
  const int port = server->getPort();
  std::atomic<int> quorums_of_0{0};
  on_ranks(4, [&](int t) {
    const int id = t / 2, rank = t % 2;
    train_piece(id, rank, 2, port, id == 0 ? 6 : 3, [&, id, rank](ft::Manager& m) {
      CHECK_THROWS_AS(m.replica_store("a/b"), std::invalid_argument);
      auto registry = std::make_shared<rpc::Registry>();
      registry->def("whoami", [id, rank] { return static_cast<int64_t>(id * 10 + rank); });
      rpc::AgentOptions ao;
      ao.name = "p" + std::to_string(rank);
      ao.rank = rank;
      ao.world_size = 2;
      ao.init_timeout = std::chrono::seconds(20);
      auto agent = rpc::Agent::create(ao, registry, m.replica_store("rpc"));
      // (the partner is this replica's, not the other's, which meets under the same names)
      CHECK(agent->rpc_sync<int64_t>("p" + std::to_string(1 - rank), "whoami") ==
            id * 10 + 1 - rank);
      agent->shutdown(true);
      if (id == 0 && rank == 0) ++quorums_of_0;
    });
  });
  CHECK(quorums_of_0 >= 2);
}

TEST_CASE(
    "ft: a group of some of a replica's processes is made in each quorum (a stage's tp group)") {
  // Two replicas of three processes: in each quorum ranks 2 and 0 of a
  // replica meet in a group of their own (ranked in that order), rank 1
  // alone in another; a sum over the pair is its replica's own. Replica 1
  // leaves after 3 steps, and replica 0's pair meets again.
  auto server = support::store_server();
  const int port = server->getPort();
  std::atomic<int> pairs_of_0{0};
  on_ranks(6, [&](int t) {
    const int id = t / 3, rank = t % 3;
    train_piece(id, rank, 3, port, id == 0 ? 6 : 3, [&, id, rank](ft::Manager& m) {
      CHECK_THROWS_WITH_AS(m.replica_subgroup("tp", {0, 3}), doctest::Contains("rank 3 is not"),
                           std::invalid_argument);
      CHECK_THROWS_WITH_AS(m.replica_subgroup("tp", {rank, rank}), doctest::Contains("given twice"),
                           std::invalid_argument);
      CHECK_THROWS_WITH_AS(m.replica_subgroup("tp", {(rank + 1) % 3}),
                           doctest::Contains("is not among them"), std::invalid_argument);
      CHECK_THROWS_AS(m.replica_subgroup("a/b", {rank}), std::invalid_argument);
      const std::vector<int> ranks = rank == 1 ? std::vector<int>{1} : std::vector<int>{2, 0};
      auto g = m.replica_subgroup(rank == 1 ? "one" : "pair", ranks);
      CHECK(g->size() == static_cast<int>(ranks.size()));
      CHECK(g->rank() == (rank == 2 ? 0 : rank == 0 ? 1 : 0));
      at::Tensor x = at::full({1}, static_cast<double>(id * 10 + rank), at::kDouble);
      g->all_reduce(x);
      CHECK(x.item<double>() == (rank == 1 ? id * 10 + 1 : id * 20 + 2));
      if (id == 0 && rank == 0) ++pairs_of_0;
    });
  });
  CHECK(pairs_of_0 >= 2);
}

TEST_CASE("ft: a replica's process told the job finished does not move the finished mark back") {
  Data d;
  auto server = support::store_server();
  Record rec;
  bool late = false;
  on_ranks(4, [&](int thread) {
    const int id = thread / 2, rank = thread % 2;
    // Replica 1's rank 1 leaves after two steps; its rank 0 waits to rejoin
    // while replica 0 trains on alone to the end.
    train_sharded(
        id, rank, server->getPort(), 8, d, rec,
        [&](int tried, ft::Manager&) {
          std::this_thread::sleep_for(std::chrono::milliseconds(60));
          return !(id == 1 && rank == 1 && tried == 2);
        },
        1, nullptr, id == 1 && rank == 0 ? &late : nullptr);
  });
  CHECK(late);
  // A replacement of replica 1's rank 1, after all that, is told the job
  // finished at step 8 (not that the newest state is lost).
  auto model = make_model(1);
  torch::nn::Module shard;
  shard.register_parameter("p", model->bias);
  torch::optim::SGD opt({model->bias}, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto o = options(1, 2, server->getPort());
  o.replica_size = 2;
  o.replica_rank = 1;
  ft::Manager replacement(o, ft::module_state(shard, opt));
  int64_t finished_at = -1;
  try {
    replacement.start_step();
  } catch (const ft::JobFinished& e) {
    finished_at = e.step();
  }
  CHECK(finished_at == 8);
  expect_reference(d, rec, 0);
}

TEST_CASE("ft: bad options are refused by name") {
  auto server = support::store_server();
  auto model = make_model(1);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto state = ft::module_state(*model, opt);
  auto o = options(3, 3, server->getPort());
  CHECK_THROWS_WITH_AS(ft::Manager(o, state), doctest::Contains("replica_id 3"),
                       std::invalid_argument);
  o = options(0, 3, server->getPort());
  o.min_replicas = 4;
  CHECK_THROWS_WITH_AS(ft::Manager(o, state), doctest::Contains("min_replicas 4"),
                       std::invalid_argument);
  o = options(0, 3, server->getPort());
  o.batch_size = 0;
  CHECK_THROWS_WITH_AS(ft::Manager(o, state), doctest::Contains("go together"),
                       std::invalid_argument);
  o = options(0, 3, server->getPort());
  o.heartbeat_timeout = o.heartbeat_interval;
  CHECK_THROWS_WITH_AS(ft::Manager(o, state), doctest::Contains("heartbeat_timeout"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(ft::Manager(options(0, 3, server->getPort()), ft::State{}),
                       doctest::Contains("save and load"), std::invalid_argument);
  o = options(0, 3, server->getPort());
  o.replica_size = 2;
  o.replica_rank = 2;
  CHECK_THROWS_WITH_AS(ft::Manager(o, state), doctest::Contains("replica_rank 2"),
                       std::invalid_argument);
  o.replica_size = 0;
  CHECK_THROWS_WITH_AS(ft::Manager(o, state), doctest::Contains("replica_size 0"),
                       std::invalid_argument);
}

}  // namespace tandem::test

namespace tandem::test {
// (no worker processes: examples/check_ft.sh starts real ones)
int worker_main(const std::string& mode) {
  std::fprintf(stderr, "test_ft has no worker mode '%s'\n", mode.c_str());
  return 2;
}
}  // namespace tandem::test
