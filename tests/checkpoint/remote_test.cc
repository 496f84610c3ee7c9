// Parts written where the state lives (checkpoint/remote.h): RemoteModules'
// owners write their modules into parts of their own and read them back,
// also on other owners; with a process group, every rank's remote parts
// are numbered after the ranks'; what does not fit is refused by name with
// nothing loaded, and a failed remote write commits nothing.
#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "ddp/ddp_support.h"
#include "tandem/autograd/autograd.h"
#include "tandem/checkpoint/job.h"
#include "tandem/checkpoint/remote.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/optim/param_state.h"
#include "tandem/remote_module/remote_module.h"

using namespace tandem;
using test::error_of;
using test::Groups;
using test::on_ranks;
using test::TempDir;
using test::World;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

TEST_CASE("checkpoint: remote modules' owners write their parts, and load them on other owners") {
  World w(3);
  TempDir dir;
  at::manual_seed(3);
  nn::RemoteModule a(w[0], "rank:1/cpu", "Linear", {4, 3});
  nn::RemoteModule b(w[0], "rank:2/cpu", "Linear", {3, 2});
  torch::nn::Linear head(2, 2);
  std::string step_text = "5";
  checkpoint::JobState state;
  state.remote_module("a", a)
      .remote_module("b", b)
      .module("head", *head)
      .record("step", &step_text);
  checkpoint::save_job(dir.path, 5, state);

  auto found = checkpoint::latest(dir.path);
  REQUIRE(found);
  for (int part = 0; part < 3; ++part) {
    CHECK(fs::exists(found->path + "/part-" + std::to_string(part) + ".bin"));
  }
  checkpoint::Reader r(found->path);
  CHECK(r.world_size() == 3);
  CHECK(r.rank_of("head.weight") == 0);  // the caller's own part
  CHECK(r.rank_of("a.weight") == 1);     // each module's own
  CHECK(r.rank_of("b.bias") == 2);
  const auto sa = a.state_dict();
  CHECK(at::equal(r.tensor("a.weight"), sa.at("weight")));
  CHECK(at::equal(r.tensor("a.bias"), sa.at("bias")));

  // Other owners (swapped), other values: loaded back exactly.
  nn::RemoteModule a2(w[0], "rank:2/cpu", "Linear", {4, 3});
  nn::RemoteModule b2(w[0], "rank:1/cpu", "Linear", {3, 2});
  torch::nn::Linear head2(2, 2);
  std::string step2;
  checkpoint::JobState again;
  again.remote_module("a", a2).remote_module("b", b2).module("head", *head2).record("step", &step2);
  REQUIRE(checkpoint::load_latest_job(dir.path, again) == 5);
  CHECK(step2 == "5");
  for (const auto& [x, y] : {std::pair{&a, &a2}, std::pair{&b, &b2}}) {
    const auto want = x->state_dict();
    const auto got = y->state_dict();
    for (const auto& [name, t] : want) CHECK(at::equal(got.at(name), t));
  }
  CHECK(at::equal(head2->weight, head->weight));

  // A module of another shape, and a name the step lacks: refused by name,
  // nothing loaded (not even the pieces that would fit).
  nn::RemoteModule wide(w[0], "rank:1/cpu", "Linear", {5, 3});
  nn::RemoteModule fresh(w[0], "rank:2/cpu", "Linear", {3, 2});
  const auto fresh_before = fresh.state_dict();
  checkpoint::JobState wrong;
  wrong.remote_module("b", fresh).remote_module("a", wide);
  const std::string shape_error = error_of([&] { checkpoint::load_latest_job(dir.path, wrong); });
  CHECK(shape_error.find("'a.weight' is [3, 4] in the step, [3, 5] here") != std::string::npos);
  CHECK(shape_error.find(found->path) != std::string::npos);
  CHECK(at::equal(fresh.state_dict().at("weight"), fresh_before.at("weight")));
  checkpoint::JobState missing;
  missing.remote_module("c", fresh);
  CHECK(error_of([&] {
          checkpoint::load_latest_job(dir.path, missing);
        }).find("c.weight is missing; c.bias is missing") != std::string::npos);
}

TEST_CASE("checkpoint: with a process group, each rank's remote parts come after the ranks'") {
  World w(3);
  Groups g(2);
  TempDir dir;
  nn::RemoteModule a(w[0], "rank:1/cpu", "Linear", {4, 3});
  nn::RemoteModule b(w[1], "rank:2/cpu", "Linear", {3, 2});
  on_ranks(2, [&](int rank) {
    checkpoint::JobState s(rank);
    torch::nn::Linear own(2, 2);
    s.module("own" + std::to_string(rank), *own);
    s.remote_module(rank == 0 ? "a" : "b", rank == 0 ? a : b);
    checkpoint::SaveOptions o;
    o.group = g.groups[rank];
    checkpoint::save_job(dir.path, 7, s, o);
  });
  checkpoint::Reader r(checkpoint::latest(dir.path)->path);
  CHECK(r.world_size() == 4);
  CHECK(r.rank_of("own0.weight") == 0);
  CHECK(r.rank_of("own1.weight") == 1);
  CHECK(r.rank_of("a.weight") == 2);
  CHECK(r.rank_of("b.weight") == 3);
}

TEST_CASE("checkpoint: a remote part that cannot be written fails the save, committing nothing") {
  World w(2);
  TempDir dir;
  nn::RemoteModule a(w[0], "rank:1/cpu", "Linear", {4, 3});
  checkpoint::Part mine;
  mine.add("x", at::randn({2}));
  const std::string error = error_of([&] {
    checkpoint::save_parts(dir.path, 3, mine, {[&](const std::string& d, int64_t step, int) {
                             return checkpoint::save_module_part(a, d, step, -1, "a");
                           }});
  });
  // (the owner's writer failed; it holds nothing for anyone: the case's
  // leak check at the end says so)
  CHECK(error.find("checkpoint::write_part: a negative part") != std::string::npos);
  CHECK(!checkpoint::latest(dir.path));
  // commit() itself refuses a part missing or given twice.
  const std::string index = checkpoint::write_part(dir.path, 4, 0, mine);
  CHECK(error_of([&] {
          checkpoint::commit(dir.path, 4, 2, {index});
        }).find("no part of rank 1 (of 2)") != std::string::npos);
  CHECK(error_of([&] {
          checkpoint::commit(dir.path, 4, 1, {index, index});
        }).find("is negative or given twice") != std::string::npos);
  CHECK(!checkpoint::latest(dir.path));
  checkpoint::commit(dir.path, 4, 1, {index});
  CHECK(checkpoint::latest(dir.path)->step == 4);
}

TEST_CASE("checkpoint: AsyncSaver with remote parts: copied in the step, written meanwhile") {
  World w(2);
  TempDir dir;
  nn::RemoteModule a(w[0], "rank:1/cpu", "Linear", {4, 3});
  const auto before = a.state_dict();
  checkpoint::AsyncSaver saver(dir.path);
  checkpoint::Part mine;
  mine.add("x", at::ones({2}));
  saver.save(1, std::move(mine), {checkpoint::module_writer(a, "a")});
  // Training goes on: the owner's values change after the copy was made.
  nn::RemoteModule::StateDict zeros;
  for (const auto& [name, t] : before) zeros[name] = at::zeros_like(t);
  a.load_state_dict(zeros);
  saver.wait();
  checkpoint::Reader r(checkpoint::latest(dir.path)->path);
  CHECK(r.world_size() == 2);
  CHECK(at::equal(r.tensor("a.weight"), before.at("weight")));
  CHECK(at::equal(r.tensor("a.bias"), before.at("bias")));
}

namespace {

// One Adam step of the two-stage model a -> b on batch `k`.
void train_step(World& w, const nn::RemoteModule& a, const nn::RemoteModule& b,
                optim::DistributedOptimizer& opt, int k) {
  at::manual_seed(500 + k);
  const at::Tensor x = at::randn({6, 4});
  autograd::Context ctx(w[0]);
  const at::Tensor y = b.forward(a.forward(x));
  autograd::backward(w[0], ctx.id(), {y.pow(2).sum()});
  opt.step(ctx.id());
}

// Each pair's modules hold the same values (to float rounding).
void check_same(std::vector<std::pair<const nn::RemoteModule*, const nn::RemoteModule*>> pairs) {
  for (const auto& [want_of, got_of] : pairs) {
    const auto want = want_of->state_dict();
    const auto got = got_of->state_dict();
    for (const auto& [name, t] : want) {
      CAPTURE(name);
      CHECK(at::allclose(got.at(name), t, 1e-6, 1e-7));
    }
  }
}

std::vector<rpc::RRef<at::Tensor>> params_of(const nn::RemoteModule& a, const nn::RemoteModule& b) {
  auto out = a.remote_parameters();
  for (auto& p : b.remote_parameters()) out.push_back(p);
  return out;
}

}  // namespace

TEST_CASE(
    "checkpoint: a DistributedOptimizer's owners write its state by names; it goes on elsewhere") {
  World w(3);
  TempDir dir;
  at::manual_seed(8);
  nn::RemoteModule a(w[0], "rank:1/cpu", "Linear", {4, 3});
  nn::RemoteModule b(w[0], "rank:2/cpu", "Linear", {3, 2});
  const std::vector<std::string> names = {"a.weight", "a.bias", "b.weight", "b.bias"};
  optim::Options o;
  o.lr = 0.05;
  optim::DistributedOptimizer opt(w[0], optim::Kind::kAdam, params_of(a, b), o);
  for (int k = 0; k < 3; ++k) train_step(w, a, b, opt, k);
  checkpoint::JobState state;
  state.remote_module("model", a, /*first_layer=*/-1).remote_module("model2", b);
  state.distributed_optimizer("adam", opt, names);
  checkpoint::save_job(dir.path, 3, state);
  checkpoint::Reader r(checkpoint::latest(dir.path)->path);
  CHECK(r.world_size() == 5);  // the caller's, two modules', two owners'
  CHECK(r.rank_of("adam/a.weight") == 3);
  CHECK(r.rank_of("adam/b.bias") == 4);

  // Elsewhere: both stages on worker 1, one owner for the optimizer.
  nn::RemoteModule a2(w[0], "rank:1/cpu", "Linear", {4, 3});
  nn::RemoteModule b2(w[0], "rank:1/cpu", "Linear", {3, 2});
  optim::DistributedOptimizer opt2(w[0], optim::Kind::kAdam, params_of(a2, b2), o);
  checkpoint::JobState again;
  again.remote_module("model", a2).remote_module("model2", b2);
  again.distributed_optimizer("adam", opt2, names);
  REQUIRE(checkpoint::load_latest_job(dir.path, again) == 3);
  // Both go on: the same steps give the same parameters, Adam's moments and
  // step counts included.
  for (int k = 3; k < 5; ++k) {
    train_step(w, a, b, opt, k);
    train_step(w, a2, b2, opt2, k);
  }
  check_same({{&a, &a2}, {&b, &b2}});
  // The names must cover the parameters; a step without the state is refused by name.
  checkpoint::JobState short_names;
  CHECK(error_of([&] {
          short_names.distributed_optimizer("adam", opt2, {"a.weight"});
        }).find("1 names for the optimizer 'adam''s parameters") != std::string::npos);
  checkpoint::JobState other;
  other.distributed_optimizer("sgd", opt2, names);
  CHECK(error_of([&] {
          checkpoint::load_latest_job(dir.path, other);
        }).find("holds no sgd/a.weight, sgd/a.bias, sgd/b.weight, sgd/b.bias") !=
        std::string::npos);
}

TEST_CASE("checkpoint: pipeline stages saved by the model's layer indices load into another cut") {
  World w(3);
  TempDir dir;
  auto linear = [](int64_t i, int64_t o) { return nn::spec("Linear", {i, o}); };
  // Layers 0..2 cut 1 + 2, then loaded cut 2 + 1.
  nn::RemoteModule first(w[0], "rank:1/cpu", "Sequential", {nn::list({linear(4, 5)})});
  nn::RemoteModule second(w[0], "rank:2/cpu", "Sequential",
                          {nn::list({linear(5, 6), linear(6, 3)})});
  checkpoint::JobState state;
  state.remote_module("model", first, 0).remote_module("model", second, 1);
  checkpoint::save_job(dir.path, 1, state);
  checkpoint::Reader r(checkpoint::latest(dir.path)->path);
  CHECK(r.rank_of("model.0.weight") == 1);
  CHECK(r.rank_of("model.2.bias") == 2);
  CHECK(at::equal(r.tensor("model.2.weight"), second.state_dict().at("1.weight")));

  nn::RemoteModule head(w[0], "rank:2/cpu", "Sequential", {nn::list({linear(4, 5), linear(5, 6)})});
  nn::RemoteModule tail(w[0], "rank:1/cpu", "Sequential", {nn::list({linear(6, 3)})});
  checkpoint::JobState again;
  again.remote_module("model", head, 0).remote_module("model", tail, 2);
  checkpoint::load_latest_job(dir.path, again);
  CHECK(at::equal(head.state_dict().at("0.weight"), first.state_dict().at("0.weight")));
  CHECK(at::equal(head.state_dict().at("1.bias"), second.state_dict().at("0.bias")));
  CHECK(at::equal(tail.state_dict().at("0.weight"), second.state_dict().at("1.weight")));
  // A module whose names have no leading index cannot be shifted.
  nn::RemoteModule plain(w[0], "rank:1/cpu", "Linear", {4, 5});
  checkpoint::JobState wrong;
  wrong.remote_module("model", plain, 0);
  CHECK(error_of([&] {
          checkpoint::save_job(dir.path, 2, wrong);
        }).find("'weight' of Linear has no leading layer index") != std::string::npos);
}

// Another client training `a` meanwhile: steps of `opt` on sum(a(ones)),
// one after another on a thread of its own, until stop().
class Stepping {
 public:
  Stepping(rpc::Agent& agent, nn::RemoteModule& a, optim::DistributedOptimizer& opt, int64_t inputs)
      : thread_([this, &agent, &a, &opt, inputs] {
          const at::Tensor x = at::ones({1, inputs});
          while (!done_.load()) {
            autograd::Context ctx(agent);
            autograd::backward(agent, ctx.id(), {a.forward(x).sum()});
            opt.step(ctx.id());
            steps_.fetch_add(1);
          }
        }) {}
  ~Stepping() { stop(); }
  int steps() const { return steps_.load(); }
  void stop() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::atomic<int> steps_{0};
  std::thread thread_;  // (last: started once the counters exist)
};

// A writer of one part on "worker" (written here), its moments scripted:
// the k-th time it is asked answers moments[min(k, size - 1)], and writes
// the number of that try as "<name>".
checkpoint::RemotePartWriter scripted(const std::string& name, const std::string& worker,
                                      std::vector<int64_t> moments, std::shared_ptr<int> tries) {
  return [=](const std::string& dir, int64_t step, int part) {
    const int k = (*tries)++;
    checkpoint::Part p;
    p.add(name, at::full({1}, static_cast<double>(k), at::kDouble));
    const std::string index = checkpoint::write_part(dir, step, part, p);
    const int64_t moment = moments.at(std::min<size_t>(k, moments.size() - 1));
    return checkpoint::RemotePart{[] {}, [index] { return index; }, worker,
                                  [moment] { return moment; }};
  };
}

TEST_CASE(
    "checkpoint: a worker's parts copied at several moments are made again until they agree") {
  TempDir dir;
  checkpoint::Part mine;
  mine.add("x", at::ones({1}));
  auto ta = std::make_shared<int>(0), tb = std::make_shared<int>(0), tc = std::make_shared<int>(0);
  // a and b on one worker: a step fell between them twice; c alone on another.
  checkpoint::save_parts(dir.path, 1, mine,
                         {scripted("a", "w1", {5, 7, 9}, ta), scripted("b", "w1", {6, 8, 9}, tb),
                          scripted("c", "w2", {3, 4}, tc)});
  CHECK(*ta == 3);
  CHECK(*tb == 3);
  CHECK(*tc == 1);  // (one part: nothing to agree with)
  checkpoint::Reader r(checkpoint::latest(dir.path)->path);
  CHECK(r.tensor("a").item<double>() == 2);  // the parts of the third try
  CHECK(r.tensor("b").item<double>() == 2);
  CHECK(r.tensor("c").item<double>() == 0);

  // Moments that never agree: the save fails by name, committing nothing.
  auto tx = std::make_shared<int>(0), ty = std::make_shared<int>(0);
  const std::string error = error_of([&] {
    checkpoint::save_parts(dir.path, 2, mine,
                           {scripted("x", "w3", {1, 3, 5, 7, 9, 11, 13, 15, 17}, tx),
                            scripted("y", "w3", {2, 4, 6, 8, 10, 12, 14, 16, 18}, ty)});
  });
  CAPTURE(error);
  CHECK(error.find("steps on w3 kept falling between the copies of its parts of step 2 (8 tries, "
                   "last at its steps 15 to 16)") != std::string::npos);
  CHECK(*tx == 8);
  CHECK(*ty == 8);
  CHECK(checkpoint::latest(dir.path)->step == 1);
}

TEST_CASE(
    "checkpoint: a module and its optimizer's state are of one moment while another client "
    "steps") {
  // Adam on a constant gradient moves every weight by lr each step (its
  // bias-corrected update is g / |g|): the saved weights tell how many steps
  // the module's copy saw, the saved state's step count how many the
  // optimizer state's copy saw. A step between the two copies would make
  // them differ by one.
  World w(2);
  TempDir dir;
  nn::RemoteModule a(w[0], "rank:1/cpu", "Linear", {512, 1024});  // (2 MiB of weight)
  const at::Tensor first = a.state_dict().at("weight");
  optim::Options o;
  o.lr = 1e-3;
  optim::DistributedOptimizer opt(w[0], optim::Kind::kAdam, a.remote_parameters(), o);
  Stepping trainer(w[0], a, opt, 512);
  int saves = 0;
  for (; saves < 30 || trainer.steps() < 10; ++saves) {
    checkpoint::JobState state;
    state.remote_module("a", a).distributed_optimizer("adam", opt, {"weight", "bias"});
    checkpoint::save_job(dir.path, saves + 1, state);
    checkpoint::Reader r(checkpoint::latest(dir.path)->path);
    const double moved = (first - r.tensor("a.weight")).mean().item<double>() / o.lr;
    at::Tensor stand_in = at::zeros({1024, 512}).requires_grad_();
    torch::optim::Adam adam({stand_in}, torch::optim::AdamOptions(o.lr));
    optim::load_param_state(adam, stand_in, r.bytes("adam/weight"));
    const int64_t state_steps =
        adam.state().empty()
            ? 0
            : static_cast<torch::optim::AdamParamState&>(*adam.state().begin()->second).step();
    CAPTURE(saves);
    CHECK(std::abs(moved - static_cast<double>(state_steps)) < 0.25);
    if (saves > 200) break;
  }
  trainer.stop();
  MESSAGE(saves << " saves beside " << trainer.steps() << " steps");
}

TEST_CASE(
    "checkpoint: an owner's optimizer state is copied in the step; steps after it do not leak in") {
  World w(2);
  TempDir dir;
  at::manual_seed(9);
  optim::Options o;
  o.lr = 0.05;
  const std::vector<std::string> names = {"a.weight", "a.bias", "b.weight", "b.bias"};
  // The run that saves, and a twin that trains the same steps and never saves.
  nn::RemoteModule a(w[0], "rank:1/cpu", "Linear", {4, 3}), b(w[0], "rank:1/cpu", "Linear", {3, 2});
  nn::RemoteModule ta(w[0], "rank:1/cpu", "Linear", {4, 3}),
      tb(w[0], "rank:1/cpu", "Linear", {3, 2});
  ta.load_state_dict(a.state_dict());
  tb.load_state_dict(b.state_dict());
  optim::DistributedOptimizer opt(w[0], optim::Kind::kAdam, params_of(a, b), o);
  optim::DistributedOptimizer twin(w[0], optim::Kind::kAdam, params_of(ta, tb), o);
  for (int k = 0; k < 2; ++k) {
    train_step(w, a, b, opt, k);
    train_step(w, ta, tb, twin, k);
  }
  checkpoint::AsyncSaver saver(dir.path);
  checkpoint::JobState state;
  state.remote_module("a", a).remote_module("b", b).distributed_optimizer("adam", opt, names);
  saver.save(2, state.part(), state.remote_writers());
  train_step(w, a, b, opt, 7);  // moves the state on while the parts may still be written
  saver.wait();

  nn::RemoteModule a2(w[0], "rank:1/cpu", "Linear", {4, 3}),
      b2(w[0], "rank:1/cpu", "Linear", {3, 2});
  optim::DistributedOptimizer opt2(w[0], optim::Kind::kAdam, params_of(a2, b2), o);
  checkpoint::JobState again;
  again.remote_module("a", a2).remote_module("b", b2).distributed_optimizer("adam", opt2, names);
  checkpoint::load_latest_job(dir.path, again);
  train_step(w, a2, b2, opt2, 2);
  train_step(w, ta, tb, twin, 2);
  check_same({{&ta, &a2}, {&tb, &b2}});
}

TEST_CASE("checkpoint: a parameter's state snapshot holds its moment's state, not a later one's") {
  at::manual_seed(4);
  at::Tensor w = at::randn({3, 2}).requires_grad_();
  torch::optim::Adam adam({w}, torch::optim::AdamOptions(0.1));
  auto step = [&] {
    adam.zero_grad();
    (w * w).sum().backward();
    adam.step();
  };
  step();
  REQUIRE(adam.state().size() == 1);
  auto& live = static_cast<torch::optim::AdamParamState&>(*adam.state().begin()->second);
  const at::Tensor avg = live.exp_avg().clone();
  auto snapshot = optim::param_state_snapshot(adam, w);
  step();  // in place: the live state moves on
  step();
  REQUIRE_FALSE(at::equal(live.exp_avg(), avg));
  at::Tensor w2 = at::zeros({3, 2}).requires_grad_();
  torch::optim::Adam other({w2}, torch::optim::AdamOptions(0.1));
  optim::load_param_state(other, w2, snapshot());
  REQUIRE(other.state().size() == 1);
  const auto& loaded = static_cast<torch::optim::AdamParamState&>(*other.state().begin()->second);
  CHECK(at::equal(loaded.exp_avg(), avg));
  CHECK(loaded.step() == 1);
}

TEST_CASE("checkpoint: a module's copy is one moment's values while its optimizer steps") {
  // An SGD step of lr 1 on sum(a(ones)) takes the batch size off every
  // weight at once, in place on the owner; a second client saves the module
  // meanwhile. Each saved weight, less the first one, must be one uniform
  // multiple of the step (a copy made across a step would mix two).
  World w(2);
  TempDir dir;
  nn::RemoteModule a(w[0], "rank:1/cpu", "Linear", {1024, 2048});  // (8 MiB of weight)
  const at::Tensor first = a.state_dict().at("weight");
  optim::Options o;
  o.lr = 1.0;
  optim::DistributedOptimizer opt(w[0], optim::Kind::kSGD, a.remote_parameters(), o);
  Stepping trainer(w[0], a, opt, 1024);
  int saves = 0;
  for (; saves < 40 || trainer.steps() < 10; ++saves) {
    checkpoint::JobState state;
    state.remote_module("a", a);
    checkpoint::save_job(dir.path, saves + 1, state);
    checkpoint::Reader r(checkpoint::latest(dir.path)->path);
    const at::Tensor moved = r.tensor("a.weight") - first;  // -k everywhere
    const double lo = moved.min().item<double>(), hi = moved.max().item<double>();
    CAPTURE(saves);
    CHECK(hi - lo < 0.5);
    if (saves > 200) break;
  }
  trainer.stop();
  MESSAGE(saves << " saves beside " << trainer.steps() << " steps");
}
