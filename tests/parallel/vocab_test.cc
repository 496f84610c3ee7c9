// The vocabulary-parallel embedding and cross-entropy (parallel/vocab.h)
// against one LibTorch process, for tp 2 and 3 over a vocabulary of 10
// (which 3 does not divide), with and without sequence parallelism.
#include "test_util.h"

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sum.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <vector>

#include "ddp/ddp_support.h"
#include "tandem/parallel/vocab.h"

using namespace tandem;
namespace par = tandem::parallel;

namespace {
constexpr int64_t kVocab = 10, kDim = 4, kBatch = 2, kSeq = 6;
}  // namespace

TEST_CASE("parallel vocab: the words are shared out unevenly, the first ranks one more") {
  CHECK(par::range_of(10, 0, 3).start == 0);
  CHECK(par::range_of(10, 0, 3).length == 4);
  CHECK(par::range_of(10, 1, 3).start == 4);
  CHECK(par::range_of(10, 1, 3).length == 3);
  CHECK(par::range_of(10, 2, 3).start == 7);
  CHECK(par::range_of(10, 2, 3).end() == 10);
  CHECK(par::range_of(12, 2, 3).start == 8);
  CHECK(par::range_of(12, 2, 3).length == 4);
}

TEST_CASE("parallel vocab: the embedding, a head and the loss equal one process's") {
  for (int n : {2, 3}) {
    for (bool sp : {false, true}) {
      CAPTURE(n);
      CAPTURE(sp);
      // One process: Embedding(V, D), Linear(D, V), cross-entropy of each
      // position, weighted.
      at::manual_seed(3);
      torch::nn::Embedding emb(kVocab, kDim);
      torch::nn::Linear head(kDim, kVocab);
      const at::Tensor ids = at::randint(kVocab, {kBatch, kSeq});
      const at::Tensor targets = at::randint(kVocab, {kBatch, kSeq});
      const at::Tensor w = at::randn({kBatch, kSeq});
      const at::Tensor h = emb(ids);
      const at::Tensor logits = head(h);
      const at::Tensor want = at::cross_entropy_loss(logits.reshape({-1, kVocab}),
                                                     targets.reshape(-1), {}, at::Reduction::None)
                                  .view({kBatch, kSeq});
      at::sum(w * want).backward();
      test::Groups g(n);
      std::vector<par::VocabParallelEmbedding> embs;
      std::vector<std::shared_ptr<par::ColumnParallelLinearImpl>> heads;
      for (int r = 0; r < n; ++r) {
        par::VocabParallelOptions vo;
        vo.sequence_parallel = sp;
        embs.emplace_back(par::VocabParallelEmbeddingImpl(emb, g.groups[r], vo));
        par::ColumnParallelOptions co;
        co.sequence_parallel = sp;
        heads.push_back(par::ColumnParallelLinearImpl::from_whole(head, g.groups[r], co));
      }
      std::vector<at::Tensor> hs(n), losses(n);
      test::on_ranks(n, [&](int r) {
        at::Tensor hr = embs[r](ids);  // whole, or this rank's piece of the sequence
        at::Tensor lr = heads[r]->forward(hr);  // this rank's words, the whole sequence
        at::Tensor loss = par::vocab_parallel_cross_entropy(lr, targets, kVocab, g.groups[r]);
        // (a loss of the replicated region: every rank's the same, counted once)
        at::sum(w * loss).backward();
        hs[r] = hr.detach();
        losses[r] = loss.detach();
      });
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        const par::Range words = par::range_of(kVocab, r, n);
        CHECK(embs[r]->words().start == words.start);
        CHECK(at::allclose(hs[r], sp ? par::piece_of(h.detach(), 1, r, n) : h.detach(), 1e-5,
                           1e-6));
        CHECK(at::allclose(losses[r], want.detach(), 1e-5, 1e-6));
        CHECK(at::allclose(embs[r]->weight.grad(),
                           emb->weight.grad().narrow(0, words.start, words.length), 1e-5, 1e-6));
        CHECK(at::allclose(heads[r]->weight.grad(),
                           head->weight.grad().narrow(0, words.start, words.length), 1e-5, 1e-6));
        CHECK(at::allclose(heads[r]->bias.grad(),
                           head->bias.grad().narrow(0, words.start, words.length), 1e-5, 1e-6));
      }
    }
  }
}

TEST_CASE("parallel vocab: ids, targets and logits that do not fit are refused, naming them") {
  test::Groups g(2);
  par::VocabParallelEmbedding emb(kVocab, kDim, g.groups[0]);
  CHECK_THROWS_WITH_AS(emb(at::full({2}, kVocab, at::kLong)),
                       "VocabParallelEmbedding: id 10 is outside [0, 10)", std::invalid_argument);
  const at::Tensor targets = at::zeros({3}, at::kLong);
  CHECK_THROWS_WITH_AS(par::vocab_parallel_cross_entropy(at::randn({3, 4}), targets, kVocab,
                                                         g.groups[0]),
                       doctest::Contains("rank 0 holds 5 of 10 words, so its logits are"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(par::vocab_parallel_cross_entropy(at::randn({3, 5}),
                                                         at::full({3}, -1, at::kLong), kVocab,
                                                         g.groups[0]),
                       "vocab_parallel_cross_entropy: target -1 is outside [0, 10)",
                       std::invalid_argument);
}
