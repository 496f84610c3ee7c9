// Optimizer state cut again for another placement of the parameters
// (optim/reshard.h): a checkpoint of two owners continues on another two,
// holding the parameters in another split and order, exactly as one LibTorch
// optimizer over them all does; every mismatch is refused by name.
#include "test_util.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/randn.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <map>
#include <sstream>

#include "tandem/optim/owner/local_optimizer.h"
#include "tandem/optim/reshard.h"

using namespace tandem;
using test::error_of;

namespace {

using Named = std::map<std::string, at::Tensor>;

// The same gradient for `name` at `step` wherever it is stepped.
at::Tensor grad_of(const std::string& name, const at::Tensor& p, int step) {
  const double k = static_cast<double>(name.size()) + 0.5 * step;
  return (at::arange(p.numel(), at::kFloat).view(p.sizes()) * 0.1 - k).sin();
}

// An owner: its parameters (in order) and its LibTorch optimizer.
struct Owner {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> opt;
};

Owner make_owner(optim::Kind kind, const optim::Options& o, const Named& values,
                 std::vector<std::string> names) {
  Owner w;
  w.names = std::move(names);
  for (const auto& n : w.names) w.params.push_back(values.at(n).clone().set_requires_grad(true));
  w.opt = optim::owner::make_optimizer(kind, w.params, o);
  return w;
}

void step(Owner& w, int k) {
  for (size_t i = 0; i < w.params.size(); ++i) {
    w.params[i].mutable_grad() = grad_of(w.names[i], w.params[i], k);
  }
  w.opt->step();
}

optim::OwnerLayout layout_of(const Owner& w, int rank) {
  optim::OwnerLayout l;
  l.rank = rank;
  l.worker = "worker" + std::to_string(rank);
  l.names = w.names;
  for (const auto& p : w.params) l.shapes.push_back(p.sizes().vec());
  return l;
}

optim::OptimizerState state_of(optim::Kind kind, double lr, std::vector<Owner*> owners) {
  optim::OptimizerState s;
  s.kind = kind;
  s.lr = lr;
  int rank = 0;
  for (Owner* w : owners) {
    torch::serialize::OutputArchive a;
    w->opt->save(a);
    std::ostringstream bytes;
    a.save_to(bytes);
    s.parts.push_back({rank, "worker" + std::to_string(rank),
                       static_cast<int64_t>(w->params.size()), bytes.str()});
    ++rank;
  }
  return s;
}

void load(Owner& w, const optim::OptimizerState::Part& part) {
  torch::serialize::InputArchive a;
  a.load_from(part.bytes.data(), part.bytes.size());
  w.opt->load(a);
}

Named current(const std::vector<Owner*>& owners) {
  Named out;
  for (Owner* w : owners) {
    for (size_t i = 0; i < w->params.size(); ++i) out[w->names[i]] = w->params[i].detach();
  }
  return out;
}

}  // namespace

TEST_CASE("reshard: a checkpoint of two owners continues on another split, as one optimizer does") {
  for (optim::Kind kind : {optim::Kind::kAdam, optim::Kind::kSGD, optim::Kind::kRMSprop}) {
    CAPTURE(optim::kind_name(kind));
    optim::Options o;
    o.lr = 0.05;
    o.momentum = 0.9;
    at::manual_seed(7);
    const Named init = {
        {"a.w", at::randn({3, 4})}, {"a.b", at::randn({4})}, {"c.w", at::randn({2, 2})}};
    // The reference: one LibTorch optimizer over everything.
    Owner whole = make_owner(kind, o, init, {"a.w", "a.b", "c.w"});
    // Saved: two owners.
    Owner x = make_owner(kind, o, init, {"a.w", "a.b"});
    Owner y = make_owner(kind, o, init, {"c.w"});
    for (int k = 0; k < 3; ++k) {
      step(whole, k);
      step(x, k);
      step(y, k);
    }
    const optim::OptimizerState saved = state_of(kind, o.lr, {&x, &y});
    // Now: another split and order.
    const Named values = current({&x, &y});
    Owner p = make_owner(kind, o, values, {"c.w", "a.w"});
    Owner q = make_owner(kind, o, values, {"a.b"});
    const optim::OptimizerState now = optim::reshard_state(
        saved, {layout_of(x, 0), layout_of(y, 1)}, {layout_of(p, 5), layout_of(q, 6)}, o);
    REQUIRE(now.parts.size() == 2);
    CHECK(now.parts[0].rank == 5);
    CHECK(now.parts[0].worker == "worker5");
    CHECK(now.parts[0].num_params == 2);
    CHECK(now.parts[1].num_params == 1);
    CHECK(now.lr == saved.lr);
    load(p, now.parts[0]);
    load(q, now.parts[1]);
    for (int k = 3; k < 6; ++k) {
      step(whole, k);
      step(p, k);
      step(q, k);
    }
    const Named got = current({&p, &q});
    const Named want = current({&whole});
    for (const auto& [name, t] : want) {
      CAPTURE(name);
      CHECK(at::allclose(got.at(name), t, 1e-6, 1e-7));
    }
  }
}

TEST_CASE("reshard: mismatched layouts are refused, naming the parameter or the part") {
  optim::Options o;
  o.lr = 0.1;
  const Named init = {{"a", at::ones({2, 3})}, {"b", at::ones({4})}};
  Owner x = make_owner(optim::Kind::kAdam, o, init, {"a", "b"});
  step(x, 0);
  const auto saved = state_of(optim::Kind::kAdam, o.lr, {&x});
  const optim::OwnerLayout from = layout_of(x, 0);
  auto layout = [](std::vector<std::string> names, std::vector<std::vector<int64_t>> shapes) {
    optim::OwnerLayout l;
    l.rank = 0;
    l.names = std::move(names);
    l.shapes = std::move(shapes);
    return l;
  };
  CHECK(error_of([&] {
          optim::reshard_state(saved, {from}, {layout({"a", "c"}, {{2, 3}, {4}})}, o);
        }).find("holds 'c', which the checkpoint has no state for") != std::string::npos);
  CHECK(error_of([&] {
          optim::reshard_state(saved, {from}, {layout({"a"}, {{2, 3}})}, o);
        }).find("'b' (the saved layout's part 0 (rank 0, worker0)) has no place") !=
        std::string::npos);
  CHECK(error_of([&] {
          optim::reshard_state(saved, {from}, {layout({"a", "b"}, {{3, 2}, {4}})}, o);
        }).find("'a' is [3, 2] in the new layout's part 0 (rank 0), [2, 3] in the checkpoint") !=
        std::string::npos);
  CHECK(error_of([&] {
          optim::reshard_state(saved, {from},
                               {layout({"a", "b"}, {{2, 3}, {4}}), layout({"b"}, {{4}})}, o);
        }).find("'b' is named twice in the new layout") != std::string::npos);
  CHECK(error_of([&] {
          optim::reshard_state(saved, {from, from}, {from}, o);
        }).find("the checkpoint has 1 parts, the saved layout names 2") != std::string::npos);
  CHECK(error_of([&] {
          optim::reshard_state(saved, {layout({"a"}, {{2, 3}})}, {from}, o);
        }).find("names 1 parameters, the checkpoint's part 0 steps 2") != std::string::npos);
  CHECK(error_of([&] {
          optim::reshard_state(saved, {layout({"a", "b"}, {{2, 3}})}, {from}, o);
        }).find("gives 2 names but 1 shapes") != std::string::npos);
  auto other_rank = from;
  other_rank.rank = 4;
  CHECK(error_of([&] { optim::reshard_state(saved, {other_rank}, {from}, o); })
            .find("the checkpoint's part 0 is rank 0's, the saved layout's part 0 (rank 4, "
                  "worker0) is another's") != std::string::npos);
  auto garbage = saved;
  garbage.parts[0].bytes = "not an archive";
  CHECK(error_of([&] {
          optim::reshard_state(garbage, {from}, {from}, o);
        }).find("the checkpoint's part 0 is not the state of Adam") != std::string::npos);
}
