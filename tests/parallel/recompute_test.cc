// Activation recomputation (parallel/recompute.h): the same outputs and
// gradients, bit for bit, as running the function plainly, with dropout
// (the same masks), inside a tensor-parallel block's ranks and inside a
// distributed autograd context run by Tandem's engine.
#include "test_util.h"

#include <ATen/ops/dropout.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sum.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <vector>

#include "ddp/ddp_support.h"
#include "tandem/autograd/autograd.h"
#include "tandem/parallel/recompute.h"
#include "tandem/parallel/transformer.h"

using namespace tandem;
namespace tnn = torch::nn;
namespace dist = tandem::autograd;

namespace {

// A small MLP with dropout: what recomputation must reproduce exactly.
struct Mlp {
  tnn::Linear a{8, 16}, b{16, 8};
  at::Tensor operator()(const at::Tensor& x) {
    return b->forward(at::dropout(at::gelu(a->forward(x)), 0.5, /*train=*/true));
  }
  std::vector<at::Tensor> params() const {
    std::vector<at::Tensor> p = a->parameters();
    for (const auto& t : b->parameters()) p.push_back(t);
    return p;
  }
  void zero_grad() {
    a->zero_grad();
    b->zero_grad();
  }
};

struct Run {
  at::Tensor y, x_grad, next_draw;
  std::vector<at::Tensor> grads;
};

Run run(Mlp& mlp, const at::Tensor& x0, bool recompute) {
  mlp.zero_grad();
  at::manual_seed(99);
  Run r;
  at::Tensor x = x0.clone().requires_grad_();
  auto fn = [&](const at::Tensor& h) { return mlp(h); };
  r.y = recompute ? nn::recompute(fn, x, mlp.params()) : fn(x);
  at::sum(r.y * r.y).backward();
  r.x_grad = x.grad();
  for (const auto& p : mlp.params()) r.grads.push_back(p.grad().clone());
  r.next_draw = at::rand({4});  // the generator as a plain run leaves it
  return r;
}

}  // namespace

TEST_CASE("recompute: the same outputs and gradients as a plain run, dropout masks included") {
  at::manual_seed(1);
  Mlp mlp;
  const at::Tensor x0 = at::randn({5, 8});
  const Run plain = run(mlp, x0, false);
  const Run again = run(mlp, x0, true);
  CHECK(at::equal(plain.y, again.y));
  CHECK(at::equal(plain.x_grad, again.x_grad));
  REQUIRE(plain.grads.size() == again.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i) CHECK(at::equal(plain.grads[i], again.grads[i]));
  // The generator comes back as the plain run leaves it.
  CHECK(at::equal(plain.next_draw, again.next_draw));
  // The output holds one node, not the function's graph.
  at::Tensor x = x0.clone().requires_grad_();
  at::Tensor y = nn::recompute([&](const at::Tensor& h) { return mlp(h); }, x, mlp.params());
  CHECK(y.grad_fn()->name() == "tandem::nn::RecomputeBackward");
  CHECK(y.grad_fn()->next_edges().size() == 1 + mlp.params().size());
  // Nothing to differentiate: a plain call.
  at::NoGradGuard no_grad;
  CHECK_FALSE(nn::recompute([&](const at::Tensor& h) { return mlp(h); }, x0, mlp.params())
                  .requires_grad());
}

TEST_CASE("recompute: a tensor-parallel block recomputed on every rank gives the same gradients") {
  constexpr int64_t kWidth = 12, kHeads = 4;
  for (bool sp : {false, true}) {
    CAPTURE(sp);
    at::manual_seed(4);
    tnn::LayerNorm ln1(tnn::LayerNormOptions({kWidth})), ln2(tnn::LayerNormOptions({kWidth}));
    tnn::Linear qkv(kWidth, 3 * kWidth), proj(kWidth, kWidth), fc(kWidth, 4 * kWidth),
        out(4 * kWidth, kWidth);
    const at::Tensor x0 = at::randn({2, 4, kWidth});
    test::Groups g(2);
    std::vector<std::vector<at::Tensor>> grads[2];
    for (bool again : {false, true}) {
      std::vector<tandem::parallel::ParallelBlock> blocks;
      tandem::parallel::BlockOptions o;
      o.sequence_parallel = sp;
      for (int r = 0; r < 2; ++r) {
        blocks.emplace_back(ln1, qkv, proj, ln2, fc, out, kHeads, g.groups[r], o);
      }
      grads[again].resize(2);
      test::on_ranks(2, [&](int r) {
        at::Tensor x =
            (sp ? tandem::parallel::piece_of(x0, 1, r, 2) : x0).clone().requires_grad_();
        auto fn = [&](const at::Tensor& h) { return blocks[r](h); };
        at::Tensor y = again ? nn::recompute(fn, x, blocks[r]->parameters()) : fn(x);
        at::sum(y * y).backward();
        tandem::parallel::all_reduce_partial_grads(*blocks[r], g.groups[r]);
        grads[again][r].push_back(x.grad());
        for (const auto& p : blocks[r]->parameters()) grads[again][r].push_back(p.grad());
      });
    }
    for (int r = 0; r < 2; ++r) {
      REQUIRE(grads[0][r].size() == grads[1][r].size());
      for (size_t i = 0; i < grads[0][r].size(); ++i) {
        CAPTURE(i);
        CHECK(at::equal(grads[0][r][i], grads[1][r][i]));
      }
    }
  }
}

TEST_CASE("recompute: inside a distributed autograd context, Tandem's engine runs it") {
  // worker1 runs the MLP for worker0's input, recomputed or not; the
  // context collects the same parameter gradients either way.
  at::manual_seed(8);
  static Mlp* mlp = nullptr;
  Mlp owned;
  mlp = &owned;
  auto define = [](rpc::Registry& r) {
    r.def("mlp", [](at::Tensor x, bool again) {
      at::manual_seed(5);  // the same dropout masks for both runs
      auto fn = [](const at::Tensor& h) { return (*mlp)(h); };
      return again ? nn::recompute(fn, x, mlp->params()) : fn(x);
    });
  };
  test::World w(2, define);
  const at::Tensor x0 = at::randn({3, 8});
  std::vector<at::Tensor> got[2];
  for (bool again : {false, true}) {
    dist::Context ctx(w[0]);
    at::Tensor x = x0.clone().requires_grad_();
    at::Tensor y = w[0].rpc_sync<at::Tensor>("worker1", "mlp", x, again);
    dist::backward(ctx.id(), {at::sum(y * y)});
    got[again].push_back(dist::get_gradients(ctx.id()).at(x));
    const auto on_owner = dist::get_gradients(w[1], ctx.id());
    for (const auto& p : mlp->params()) got[again].push_back(on_owner.at(p));
  }
  REQUIRE(got[0].size() == got[1].size());
  for (size_t i = 0; i < got[0].size(); ++i) CHECK(at::equal(got[0][i], got[1][i]));
  CHECK_FALSE(mlp->params()[0].grad().defined());  // .grad is never touched
  w.shutdown();
  mlp = nullptr;
}
