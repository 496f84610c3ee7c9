// Column- and row-parallel linear layers (parallel/linear.h) against one
// LibTorch process: the same initial numbers from the same seed, the same
// output, input gradient and parameter gradients, for tp 2 and 3, with and
// without sequence parallelism.
#include "test_util.h"

#include <ATen/ops/gelu.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sum.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <vector>

#include "ddp/ddp_support.h"
#include "tandem/checkpoint/placement.h"
#include "tandem/parallel/linear.h"

using namespace tandem;
namespace par = tandem::parallel;

namespace {

constexpr int64_t kHidden = 12, kFfn = 18, kBatch = 2, kSeq = 6;

struct Whole {
  torch::nn::Linear up{nullptr}, down{nullptr};
  at::Tensor x, w, y;  // input, loss weights, output
};

// One process: Linear(H, F), gelu, Linear(F, H) from `seed`, its loss
// sum(w * y) differentiated.
Whole one_process(uint64_t seed) {
  Whole o;
  at::manual_seed(seed);
  o.up = torch::nn::Linear(kHidden, kFfn);
  o.down = torch::nn::Linear(kFfn, kHidden);
  o.up->to(at::kDouble);
  o.down->to(at::kDouble);
  o.x = at::randn({kBatch, kSeq, kHidden}, at::kDouble).requires_grad_();
  o.w = at::randn({kBatch, kSeq, kHidden}, at::kDouble);
  o.y = o.down(at::gelu(o.up(o.x)));
  at::sum(o.w * o.y).backward();
  return o;
}

}  // namespace

TEST_CASE("parallel linear: a column- then row-parallel MLP equals one process's") {
  for (int n : {2, 3}) {
    for (bool sp : {false, true}) {
      CAPTURE(n);
      CAPTURE(sp);
      const Whole o = one_process(11);
      test::Groups g(n);
      // Each rank draws the whole layers from the same seed, as one process
      // does (in turn: the generator is the process's).
      std::vector<par::ColumnParallelLinear> up;
      std::vector<par::RowParallelLinear> down;
      for (int r = 0; r < n; ++r) {
        at::manual_seed(11);
        par::ColumnParallelOptions co;
        co.sequence_parallel = sp;
        par::RowParallelOptions ro;
        ro.sequence_parallel = sp;
        up.emplace_back(kHidden, kFfn, g.groups[r], co);
        down.emplace_back(kFfn, kHidden, g.groups[r], ro);
        up.back()->to(at::kDouble);
        down.back()->to(at::kDouble);
        // 3.: the slices of the whole layers' initial numbers.
        at::manual_seed(11);
        torch::nn::Linear first(kHidden, kFfn), second(kFfn, kHidden);
        CHECK(at::equal(up[r]->weight, par::piece_of(first->weight, 0, r, n).to(at::kDouble)));
        CHECK(at::equal(up[r]->bias, par::piece_of(first->bias, 0, r, n).to(at::kDouble)));
        CHECK(at::equal(down[r]->weight,
                        par::piece_of(second->weight, 1, r, n).to(at::kDouble)));
        CHECK(at::equal(down[r]->bias, second->bias.to(at::kDouble)));
      }
      std::vector<at::Tensor> ys(n), xgrads(n);
      test::on_ranks(n, [&](int r) {
        // The input: whole on every rank, or (sequence parallel) this
        // rank's piece of the sequence; so is the output.
        at::Tensor x = (sp ? par::piece_of(o.x.detach(), 1, r, n) : o.x.detach())
                           .clone()
                           .requires_grad_();
        at::Tensor y = down[r](at::gelu(up[r](x)));
        const at::Tensor w = sp ? par::piece_of(o.w, 1, r, n) : o.w;
        at::sum(w * y).backward();
        par::all_reduce_partial_grads(*down[r], g.groups[r]);
        ys[r] = y.detach();
        xgrads[r] = x.grad();
      });
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        const at::Tensor want_y = sp ? par::piece_of(o.y.detach(), 1, r, n) : o.y.detach();
        const at::Tensor want_xg = sp ? par::piece_of(o.x.grad(), 1, r, n) : o.x.grad();
        CHECK(at::allclose(ys[r], want_y));
        CHECK(at::allclose(xgrads[r], want_xg));
        CHECK(at::allclose(up[r]->weight.grad(), par::piece_of(o.up->weight.grad(), 0, r, n)));
        CHECK(at::allclose(up[r]->bias.grad(), par::piece_of(o.up->bias.grad(), 0, r, n)));
        CHECK(at::allclose(down[r]->weight.grad(),
                           par::piece_of(o.down->weight.grad(), 1, r, n)));
        // The replicated bias: the whole gradient on every rank (summed over
        // the sequence's pieces under sequence parallelism).
        CHECK(at::allclose(down[r]->bias.grad(), o.down->bias.grad()));
        CHECK(down[r]->partial_grad_parameters().size() == (sp ? 1u : 0u));
      }
    }
  }
}

TEST_CASE("parallel linear: a gathered column-parallel output and a scattered row-parallel input") {
  const int n = 3;
  at::manual_seed(5);
  torch::nn::Linear a(kHidden, kFfn), b(kFfn, kHidden);
  const at::Tensor x = at::randn({kBatch, kSeq, kHidden});
  const at::Tensor h = x.clone().requires_grad_();
  const at::Tensor want_mid = a(h);
  const at::Tensor want = b(want_mid);
  at::sum(want).backward();
  test::Groups g(n);
  std::vector<at::Tensor> mids(n), outs(n), grads(n);
  std::vector<std::shared_ptr<par::ColumnParallelLinearImpl>> cols;
  std::vector<std::shared_ptr<par::RowParallelLinearImpl>> rows;
  for (int r = 0; r < n; ++r) {
    par::ColumnParallelOptions co;
    co.gather_output = true;
    par::RowParallelOptions ro;
    ro.input_is_parallel = false;
    cols.push_back(par::ColumnParallelLinearImpl::from_whole(a, g.groups[r], co));
    rows.push_back(par::RowParallelLinearImpl::from_whole(b, g.groups[r], ro));
  }
  test::on_ranks(n, [&](int r) {
    at::Tensor xr = x.clone().requires_grad_();
    at::Tensor mid = cols[r]->forward(xr);  // whole on every rank
    at::Tensor out = rows[r]->forward(mid);  // split here, summed over the group
    at::sum(out).backward();
    mids[r] = mid.detach();
    outs[r] = out.detach();
    grads[r] = xr.grad();
  });
  for (int r = 0; r < n; ++r) {
    CHECK(at::allclose(mids[r], want_mid.detach(), 1e-5, 1e-6));
    CHECK(at::allclose(outs[r], want.detach(), 1e-5, 1e-6));
    CHECK(at::allclose(grads[r], h.grad(), 1e-5, 1e-6));
    CHECK(at::allclose(cols[r]->weight.grad(), par::piece_of(a->weight.grad(), 0, r, n), 1e-5,
                       1e-6));
    CHECK(at::allclose(rows[r]->weight.grad(), par::piece_of(b->weight.grad(), 1, r, n), 1e-5,
                       1e-6));
  }
}

TEST_CASE("parallel linear: sizes that do not split, and no group, are refused") {
  test::Groups g(2);
  par::ColumnParallelOptions gathered;
  gathered.gather_output = true;
  CHECK_THROWS_WITH_AS(par::ColumnParallelLinear(4, 5, g.groups[0], gathered),
                       "ColumnParallelLinear: out_features 5 does not split into 2 equal pieces "
                       "(the tensor-parallel group's size)",
                       std::invalid_argument);
  // Left split, it may hold one row more than its peers (a vocabulary's head).
  CHECK(par::ColumnParallelLinear(4, 5, g.groups[0])->weight.size(0) == 3);
  CHECK(par::ColumnParallelLinear(4, 5, g.groups[1])->weight.size(0) == 2);
  CHECK_THROWS_WITH_AS(par::ColumnParallelLinear(4, 1, g.groups[0]),
                       "ColumnParallelLinear: out_features 1 is fewer than the tensor-parallel "
                       "group's 2 ranks",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(par::RowParallelLinear(7, 4, g.groups[0]),
                       "RowParallelLinear: in_features 7 does not split into 2 equal pieces (the "
                       "tensor-parallel group's size)",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(par::ColumnParallelLinear(4, 4, nullptr),
                       "ColumnParallelLinear: no process group", std::invalid_argument);
  // Parameters keep Linear's names; the split dimensions say where they lie.
  par::ColumnParallelLinear col(4, 6, g.groups[0]);
  par::RowParallelLinear row(6, 4, g.groups[0]);
  CHECK(col->named_parameters().contains("weight"));
  CHECK(col->named_parameters().contains("bias"));
  CHECK(col->split_dim("weight") == 0);
  CHECK(col->split_dim("bias") == 0);
  CHECK(row->split_dim("weight") == 1);
  CHECK(row->split_dim("bias") == -1);
  // mark_replicated: whatever is whole on every rank, buffers too, is this
  // rank's copy (a checkpoint writes copy 0's); the split pieces are not.
  torch::nn::Sequential model(par::ColumnParallelLinear(4, 6, g.groups[1]),
                              torch::nn::BatchNorm1d(6));
  par::mark_replicated(*model, g.groups[1]);
  for (const auto& p : model->named_parameters()) {
    CAPTURE(p.key());
    CHECK(checkpoint::replica_of(p.value()) == (p.key().rfind("0.", 0) == 0 ? 0 : 1));
  }
  for (const auto& b : model->named_buffers()) {
    CAPTURE(b.key());
    CHECK(checkpoint::replica_of(b.value()) == 1);
  }
}
