// A transformer block split over tp ranks (parallel/transformer.h) against
// the whole block in one LibTorch process, tp 2 and 3, with and without
// sequence parallelism: output, input gradient and every parameter's.
#include "test_util.h"

#include <ATen/ops/gelu.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/ddp_support.h"
#include "tandem/parallel/random.h"
#include "tandem/parallel/recompute.h"
#include "tandem/parallel/transformer.h"

using namespace tandem;
namespace par = tandem::parallel;
namespace tnn = torch::nn;

namespace {

constexpr int64_t kWidth = 24, kHeads = 6, kBatch = 2, kSeq = 6;

// gpt's block, written out: x + attention(ln1(x)), then + mlp(ln2(x)).
struct Whole {
  tnn::LayerNorm ln1{tnn::LayerNormOptions({kWidth})}, ln2{tnn::LayerNormOptions({kWidth})};
  tnn::Linear qkv{kWidth, 3 * kWidth}, proj{kWidth, kWidth}, fc{kWidth, 4 * kWidth},
      out{4 * kWidth, kWidth};
  Whole() {
    for (tnn::Module* m : std::vector<tnn::Module*>{ln1.get(), ln2.get(), qkv.get(), proj.get(),
                                                    fc.get(), out.get()}) {
      m->to(at::kDouble);
    }
    // LayerNorms that are not the identity, so their gradients mean something.
    at::NoGradGuard no_grad;
    ln1->weight.normal_(1, 0.1);
    ln1->bias.normal_(0, 0.1);
    ln2->weight.normal_(1, 0.1);
    ln2->bias.normal_(0, 0.1);
  }
  at::Tensor forward(at::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / kHeads;
    at::Tensor p = qkv(ln1(x)).view({B, T, 3, kHeads, hd}).permute({2, 0, 3, 1, 4});
    at::Tensor att = at::matmul(p[0], p[1].transpose(-2, -1)) / std::sqrt(double(hd));
    const at::Tensor future = at::ones({T, T}, x.options().dtype(at::kBool)).triu(1);
    att = at::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
    at::Tensor y = at::matmul(att, p[2]).transpose(1, 2).reshape({B, T, C});
    x = x + proj(y);
    return x + out(at::gelu(fc(ln2(x))));
  }
};

// Rank r's rows of a [q; k; v] parameter: its piece of each third.
at::Tensor strided_rows(const at::Tensor& t, int r, int n) {
  std::vector<int64_t> blocks = t.sizes().vec();
  blocks[0] /= 3;
  blocks.insert(blocks.begin(), 3);
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] /= n;
  return par::piece_of(t.reshape(blocks), 1, r, n).reshape(shape);
}

}  // namespace

TEST_CASE("parallel transformer: a block split over tp ranks equals the whole block") {
  // (mode 2: sequence parallelism with the partial gradients summed inside
  // backward, sum_partial_grads, no all_reduce_partial_grads after it)
  for (int n : {2, 3}) {
    for (int mode : {0, 1, 2}) {
      const bool sp = mode > 0, in_backward = mode == 2;
      CAPTURE(n);
      CAPTURE(mode);
      at::manual_seed(21);
      Whole whole;
      const at::Tensor x0 = at::randn({kBatch, kSeq, kWidth}, at::kDouble);
      const at::Tensor w = at::randn({kBatch, kSeq, kWidth}, at::kDouble);
      const at::Tensor xw = x0.clone().requires_grad_();
      const at::Tensor want = whole.forward(xw);
      at::sum(w * want).backward();

      test::Groups g(n);
      std::vector<par::ParallelBlock> blocks;
      for (int r = 0; r < n; ++r) {
        par::BlockOptions o;
        o.sequence_parallel = sp;
        o.sum_partial_grads = in_backward;
        blocks.emplace_back(whole.ln1, whole.qkv, whole.proj, whole.ln2, whole.fc, whole.out,
                            kHeads, g.groups[r], o);
        CHECK(blocks.back()->partial_grad_parameters().size() == (mode == 1 ? 4u : 0u));
      }
      std::vector<at::Tensor> ys(n), xgrads(n);
      test::on_ranks(n, [&](int r) {
        at::Tensor x = (sp ? par::piece_of(x0, 1, r, n) : x0).clone().requires_grad_();
        at::Tensor y = blocks[r](x);
        at::sum((sp ? par::piece_of(w, 1, r, n) : w) * y).backward();
        if (!in_backward) par::all_reduce_partial_grads(*blocks[r], g.groups[r]);
        ys[r] = y.detach();
        xgrads[r] = x.grad();
      });
      const double rt = 1e-6, at_ = 1e-9;
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        auto& b = blocks[r];
        CHECK(at::allclose(ys[r], sp ? par::piece_of(want.detach(), 1, r, n) : want.detach(), rt,
                           at_));
        CHECK(at::allclose(xgrads[r], sp ? par::piece_of(xw.grad(), 1, r, n) : xw.grad(), rt, at_));
        CHECK(at::allclose(b->qkv->weight.grad(), strided_rows(whole.qkv->weight.grad(), r, n), rt,
                           at_));
        CHECK(at::allclose(b->qkv->bias.grad(), strided_rows(whole.qkv->bias.grad(), r, n), rt,
                           at_));
        CHECK(at::allclose(b->proj->weight.grad(), par::piece_of(whole.proj->weight.grad(), 1, r, n),
                           rt, at_));
        CHECK(at::allclose(b->proj->bias.grad(), whole.proj->bias.grad(), rt, at_));
        CHECK(at::allclose(b->fc->weight.grad(), par::piece_of(whole.fc->weight.grad(), 0, r, n),
                           rt, at_));
        CHECK(at::allclose(b->fc->bias.grad(), par::piece_of(whole.fc->bias.grad(), 0, r, n), rt,
                           at_));
        CHECK(at::allclose(b->out->weight.grad(), par::piece_of(whole.out->weight.grad(), 1, r, n),
                           rt, at_));
        CHECK(at::allclose(b->out->bias.grad(), whole.out->bias.grad(), rt, at_));
        CHECK(at::allclose(b->ln1->weight.grad(), whole.ln1->weight.grad(), rt, at_));
        CHECK(at::allclose(b->ln1->bias.grad(), whole.ln1->bias.grad(), rt, at_));
        CHECK(at::allclose(b->ln2->weight.grad(), whole.ln2->weight.grad(), rt, at_));
        CHECK(at::allclose(b->ln2->bias.grad(), whole.ln2->bias.grad(), rt, at_));
      }
      // The whole block's names, and where each piece lies.
      auto names = blocks[0]->named_parameters();
      for (const char* name : {"ln1.weight", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias",
                               "ln2.bias", "fc.weight", "out.weight"}) {
        CHECK(names.contains(name));
      }
      CHECK(blocks[0]->split_dim("qkv.weight") == 0);
      CHECK(blocks[0]->split_dim("proj.weight") == 1);
      CHECK(blocks[0]->split_dim("ln1.weight") == -1);
    }
  }
}

TEST_CASE("parallel transformer: heads that do not split over the group are refused") {
  test::Groups g(4);
  Whole whole;
  CHECK_THROWS_WITH_AS(par::ParallelBlock(whole.ln1, whole.qkv, whole.proj, whole.ln2, whole.fc,
                                          whole.out, kHeads, g.groups[0]),
                       "ParallelBlock: 6 heads do not split over the tensor-parallel group's 4 "
                       "ranks",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(par::ParallelBlock(whole.ln1, whole.qkv, whole.proj, whole.ln2, whole.fc,
                                          whole.out, 5, g.groups[0]),
                       "ParallelBlock: the width 24 is not a multiple of 5 heads",
                       std::invalid_argument);
}

namespace {

// The output and every gradient of a block split over n ranks (threads),
// each with a tracker of its own seeded alike, and recomputed or not:
// rank r's output, input gradient and parameters' gradients by name.
struct RankResult {
  at::Tensor y, xgrad;
  std::map<std::string, at::Tensor> grads;
};
std::vector<RankResult> run_split(Whole& whole, int n, par::BlockOptions o, bool again,
                                  const at::Tensor& x0, const at::Tensor& w, bool train = true) {
  test::Groups g(n);
  std::vector<par::RngTracker> trackers(static_cast<size_t>(n));
  std::vector<par::ParallelBlock> blocks;
  for (int r = 0; r < n; ++r) {
    trackers[r].seed(7);
    par::BlockOptions mine = o;
    mine.tracker = &trackers[r];
    blocks.emplace_back(whole.ln1, whole.qkv, whole.proj, whole.ln2, whole.fc, whole.out, kHeads,
                        g.groups[r], mine);
    blocks.back()->train(train);
  }
  std::vector<RankResult> out(static_cast<size_t>(n));
  test::on_ranks(n, [&](int r) {
    const bool sp = o.sequence_parallel;
    at::Tensor x = (sp ? par::piece_of(x0, 1, r, n) : x0).clone().requires_grad_();
    auto fn = [&](const at::Tensor& h) { return blocks[r](h); };
    at::Tensor y = again ? tandem::nn::recompute(fn, x, blocks[r]->parameters(), {&trackers[r]})
                         : fn(x);
    at::sum((sp ? par::piece_of(w, 1, r, n) : w) * y).backward();
    par::all_reduce_partial_grads(*blocks[r], g.groups[r]);
    out[r].y = y.detach();
    out[r].xgrad = x.grad();
    for (const auto& p : blocks[r]->named_parameters()) out[r].grads[p.key()] = p.value().grad();
  });
  return out;
}

}  // namespace

TEST_CASE("parallel transformer: dropout draws one process's masks on any split, recomputed too") {
  at::manual_seed(23);
  Whole whole;
  const at::Tensor x0 = at::randn({kBatch, kSeq, kWidth}, at::kDouble);
  const at::Tensor w = at::randn({kBatch, kSeq, kWidth}, at::kDouble);
  par::BlockOptions o;
  o.attention_dropout = 0.3;
  o.residual_dropout = 0.2;
  const RankResult one = run_split(whole, 1, o, false, x0, w).at(0);
  // The masks did something: the block without dropout differs.
  par::BlockOptions plain;
  const RankResult none = run_split(whole, 1, plain, false, x0, w).at(0);
  CHECK_FALSE(at::allclose(one.y, none.y));
  // In eval mode dropout is the identity.
  CHECK(at::allclose(run_split(whole, 1, o, false, x0, w, /*train=*/false).at(0).y, none.y));
  for (int n : {2, 3}) {
    for (bool sp : {false, true}) {
      for (bool again : {false, true}) {
        CAPTURE(n);
        CAPTURE(sp);
        CAPTURE(again);
        par::BlockOptions split = o;
        split.sequence_parallel = sp;
        const auto got = run_split(whole, n, split, again, x0, w);
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          const RankResult& g = got[static_cast<size_t>(r)];
          CHECK(at::allclose(g.y, sp ? par::piece_of(one.y, 1, r, n) : one.y, 1e-6, 1e-9));
          CHECK(at::allclose(g.xgrad, sp ? par::piece_of(one.xgrad, 1, r, n) : one.xgrad, 1e-6,
                             1e-9));
          CHECK(at::allclose(g.grads.at("qkv.weight"),
                             strided_rows(one.grads.at("qkv.weight"), r, n), 1e-6, 1e-9));
          CHECK(at::allclose(g.grads.at("out.weight"),
                             par::piece_of(one.grads.at("out.weight"), 1, r, n), 1e-6, 1e-9));
          CHECK(at::allclose(g.grads.at("ln2.weight"), one.grads.at("ln2.weight"), 1e-6, 1e-9));
        }
      }
    }
  }
  // Megatron's draws: each rank its own attention mask, so not one
  // process's; the output is still replicated, the same on both ranks.
  par::BlockOptions megatron = o;
  megatron.masks_like_one_process = false;
  const auto mine = run_split(whole, 2, megatron, false, x0, w);
  CHECK(at::equal(mine[0].y, mine[1].y));
  CHECK_FALSE(at::allclose(mine[0].y, one.y));
  CHECK(at::isfinite(mine[0].y).all().item<bool>());
  // Recomputed, Megatron's draws are the same as without.
  const auto again = run_split(whole, 2, megatron, true, x0, w);
  CHECK(at::equal(again[0].y, mine[0].y));
  CHECK(at::allclose(again[1].grads.at("qkv.weight"), mine[1].grads.at("qkv.weight"), 0, 0));

  test::Groups g(2);
  par::BlockOptions bad;
  bad.attention_dropout = 1.0;
  CHECK_THROWS_WITH_AS(par::ParallelBlock(whole.ln1, whole.qkv, whole.proj, whole.ln2, whole.fc,
                                          whole.out, kHeads, g.groups[0], bad),
                       "ParallelBlock: a dropout probability must be in [0, 1), got 1.000000",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(par::dropout(x0, -0.5, true, par::rng_tracker().get("x")),
                       "parallel::dropout: p must be in [0, 1), got -0.500000",
                       std::invalid_argument);
}

TEST_CASE("KeepDefaultRng puts the default generator back when its scope ends, thrown or not") {
  at::manual_seed(7);
  const at::Tensor expected = at::rand({4}, at::kDouble);
  at::manual_seed(7);
  {
    par::KeepDefaultRng keep;
    (void)at::rand({100}, at::kDouble);  // (draws that must leave no trace)
  }
  CHECK(at::equal(at::rand({4}, at::kDouble), expected));
  at::manual_seed(7);
  try {
    par::KeepDefaultRng keep;
    (void)at::rand({3}, at::kDouble);
    throw std::runtime_error("made half");
  } catch (const std::runtime_error&) {
  }
  CHECK(at::equal(at::rand({4}, at::kDouble), expected));
  // Without the guard the stream moves on (the check above can fail).
  at::manual_seed(7);
  (void)at::rand({100}, at::kDouble);
  CHECK_FALSE(at::equal(at::rand({4}, at::kDouble), expected));
}
