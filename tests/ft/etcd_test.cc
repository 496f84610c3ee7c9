// The quorum kept in a real etcd cluster (ft/etcd_store.h): three members
// on loopback, started here from Debian's etcd-server. The store's calls,
// replicas that train on through the loss of an etcd member, and a clear
// error, nothing applied, when the whole cluster is gone.
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <fcntl.h>
#include <spawn.h>

#include "ddp/ddp_support.h"
#include "tandem/ft/etcd_store.h"
#include "tandem/ft/manager.h"
#include "tandem/rpc/rendezvous/etcd_client.h"
#include "test_util.h"

extern char** environ;

namespace tandem::test {
namespace {

std::string etcd_binary() {
  for (const char* p : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return {};
}

// Three etcd members on loopback, their data in a scratch folder (on
// /dev/shm when there is one: etcd syncs every write). Killed and reaped
// when it goes.
struct EtcdCluster {
  std::vector<pid_t> pids;
  std::vector<int> client_ports;
  std::string dir;

  EtcdCluster() {
    char tmpl[] = "/dev/shm/tandem-etcd-XXXXXX";
    char tmpl2[] = "/tmp/tandem-etcd-XXXXXX";
    const char* made = ::mkdtemp(tmpl);
    if (!made) made = ::mkdtemp(tmpl2);
    REQUIRE(made != nullptr);
    dir = made;
    std::vector<int> peer_ports;
    for (int i = 0; i < 3; ++i) {
      client_ports.push_back(support::free_port());
      peer_ports.push_back(support::free_port());
    }
    std::string cluster;
    for (int i = 0; i < 3; ++i) {
      cluster += (i ? "," : "") + std::string("m") + std::to_string(i) +
                 "=http://127.0.0.1:" + std::to_string(peer_ports[static_cast<size_t>(i)]);
    }
    for (int i = 0; i < 3; ++i) {
      const std::string client =
          "http://127.0.0.1:" + std::to_string(client_ports[static_cast<size_t>(i)]);
      const std::string peer =
          "http://127.0.0.1:" + std::to_string(peer_ports[static_cast<size_t>(i)]);
      std::vector<std::string> args = {etcd_binary(),
                                       "--name",
                                       "m" + std::to_string(i),
                                       "--data-dir",
                                       dir + "/m" + std::to_string(i),
                                       "--listen-client-urls",
                                       client,
                                       "--advertise-client-urls",
                                       client,
                                       "--listen-peer-urls",
                                       peer,
                                       "--initial-advertise-peer-urls",
                                       peer,
                                       "--initial-cluster",
                                       cluster,
                                       "--initial-cluster-state",
                                       "new",
                                       "--initial-cluster-token",
                                       "tandem-test",
                                       "--logger",
                                       "zap",
                                       "--log-outputs",
                                       dir + "/m" + std::to_string(i) + ".log"};
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      posix_spawn_file_actions_t fa;
      posix_spawn_file_actions_init(&fa);
      posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
      posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
      pid_t pid = -1;
      REQUIRE(::posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ) == 0);
      posix_spawn_file_actions_destroy(&fa);
      pids.push_back(pid);
    }
    // Ready once a write goes through (the members have elected a leader).
    rpc::EtcdClient probe(endpoints(), std::chrono::milliseconds(1000));
    const bool ready = eventually(
        [&] {
          try {
            probe.put("ready", "1");
            return true;
          } catch (const std::exception&) {
            return false;
          }
        },
        std::chrono::seconds(20));
    if (!ready) {
      std::string log;
      std::ifstream in(dir + "/m0.log");
      for (std::string line; std::getline(in, line);) log = line;
      for (size_t i = 0; i < pids.size(); ++i) kill_member(i);
      FAIL("the etcd cluster did not come up; member 0's last line: " << log);
    }
  }
  ~EtcdCluster() {
    for (size_t i = 0; i < pids.size(); ++i) kill_member(i);
    std::filesystem::remove_all(dir);
  }
  void kill_member(size_t i) {
    if (pids[i] <= 0) return;
    ::kill(pids[i], SIGKILL);
    ::waitpid(pids[i], nullptr, 0);
    pids[i] = -1;
  }
  std::string endpoints() const {
    std::string s;
    for (int p : client_ports)
      s += (s.empty() ? "" : ",") + std::string("127.0.0.1:") + std::to_string(p);
    return s;
  }
};

bool etcd_or_skip() {
  if (!etcd_binary().empty()) return true;
  MESSAGE("skipped: no etcd here (apt-get install etcd-server)");
  return false;
}

}  // namespace

TEST_CASE("ft: the etcd store does what c10d's stores do, on any member") {
  if (!etcd_or_skip()) return;
  EtcdCluster etcd;
  auto store = ft::etcd_store(etcd.endpoints(), "t/", std::chrono::milliseconds(300));
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  store->set("a", bytes("one"));
  CHECK(store->get("a") == bytes("one"));
  CHECK(store->add("n", 5) == 5);
  CHECK(store->add("n", -2) == 3);
  CHECK(store->compareSet("c", {}, bytes("x")) == bytes("x"));
  CHECK(store->compareSet("c", bytes("y"), bytes("z")) == bytes("x"));  // not swapped
  CHECK(store->compareSet("c", bytes("x"), bytes("z")) == bytes("z"));
  CHECK(store->check({"a", "n"}));
  CHECK_FALSE(store->check({"a", "missing"}));
  CHECK(store->getNumKeys() == 3);
  CHECK(store->deleteKey("a"));
  CHECK_FALSE(store->deleteKey("a"));
  CHECK_THROWS_WITH(store->get("missing"), doctest::Contains("timed out after 300 ms"));
  // Binary values survive base64 both ways.
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  store->set("bin", bytes(all));
  CHECK(store->get("bin") == bytes(all));
  // Adds from several clients at once lose nothing.
  on_ranks(3, [&](int) {
    auto mine = ft::etcd_store(etcd.endpoints(), "t/");
    for (int i = 0; i < 10; ++i) mine->add("counter", 1);
  });
  CHECK(store->add("counter", 0) == 30);
  // Another member answers once the one in use is gone.
  etcd.kill_member(0);
  store->set("after", bytes("1"));
  CHECK(store->get("after") == bytes("1"));
  CHECK_THROWS_AS(rpc::EtcdClient("nothing"), std::invalid_argument);
}

TEST_CASE("ft: replicas keep their quorum in etcd and train on through the loss of a member") {
  if (!etcd_or_skip()) return;
  EtcdCluster etcd;
  at::manual_seed(5);
  const at::Tensor x = at::randn({24, 4}), y = at::randn({24, 2});
  std::atomic<int> committed{0};
  std::vector<at::Tensor> final(3);
  std::vector<std::string> errors(3);
  on_ranks(3, [&](int id) {
    torch::nn::Linear model(nullptr);
    {
      static std::mutex mu;
      std::lock_guard<std::mutex> lock(mu);
      at::manual_seed(1);
      model = torch::nn::Linear(4, 2);
    }
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    ft::ManagerOptions o;
    o.replica_id = id;
    o.max_replicas = 3;
    o.connect = [&] { return ft::etcd_store(etcd.endpoints(), "job1/"); };
    o.token = "secret";
    o.heartbeat_timeout = std::chrono::milliseconds(1500);
    o.dataset_size = 24;
    o.batch_size = 2;
    ft::Manager m(o, ft::module_state(*model, opt));
    while (m.step() < 12) {
      m.start_step();
      if (id == 0 && m.step() == 5) etcd.kill_member(0);  // one of three: the cluster stays
      opt.zero_grad();
      auto i = at::tensor(m.batch_indices(), at::kLong);
      torch::nn::functional::mse_loss(model(x.index_select(0, i)), y.index_select(0, i)).backward();
      m.allreduce_grads({model->weight.grad(), model->bias.grad()});
      if (m.should_commit()) {
        opt.step();
        if (id == 0) ++committed;
      }
    }
    final[static_cast<size_t>(id)] = model->weight.detach().clone();
  });
  CHECK(committed == 12);
  CHECK(at::equal(final[0], final[1]));
  CHECK(at::equal(final[0], final[2]));
}

TEST_CASE(
    "ft: with the whole etcd cluster gone, a vote fails with a clear error and applies nothing") {
  if (!etcd_or_skip()) return;
  auto etcd = std::make_unique<EtcdCluster>();
  at::manual_seed(1);
  torch::nn::Linear model(4, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  ft::ManagerOptions o;
  o.replica_id = 0;
  o.max_replicas = 1;
  const std::string endpoints = etcd->endpoints();
  o.connect = [endpoints] {
    return ft::etcd_store(endpoints, "job2/", std::chrono::seconds(5),
                          std::chrono::milliseconds(500));
  };
  o.token = "secret";
  ft::Manager m(o, ft::module_state(*model, opt));
  m.start_step();
  CHECK(m.should_commit());
  m.start_step();
  const at::Tensor before = model->weight.detach().clone();
  etcd.reset();  // every member gone
  std::string error;
  try {
    if (m.should_commit()) opt.step();
  } catch (const ft::QuorumError& e) {
    error = e.what();
  }
  CHECK(error.find("no member of the cluster answers") != std::string::npos);
  CHECK(at::equal(model->weight, before));
  CHECK(m.step() == 1);
}

}  // namespace tandem::test
