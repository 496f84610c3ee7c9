// The collectives the sharded layers are built on (ddp/collectives.cc):
// reduce-scatter with equal and uneven pieces, all-gather into given
// tensors, gather, bytes of any length, and the same-lines check.
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include "ddp/ddp_support.h"

using namespace tandem;
using test::error_of;
using test::Groups;
using test::on_ranks;

TEST_CASE("collectives: reduce-scatter sums or averages each rank's piece, equal or uneven") {
  for (int n : {2, 3}) {
    Groups g(n);
    // Equal pieces of 4: rank r's input is arange(4n) * (r + 1).
    on_ranks(n, [&](int r) {
      at::Tensor in = at::arange(4 * n, at::kFloat) * static_cast<float>(r + 1);
      at::Tensor out = at::zeros({4});
      g[r].reduce_scatter_async(in, out).wait();
      const float scale = static_cast<float>(n * (n + 1) / 2);
      at::Tensor want = at::arange(4 * r, 4 * r + 4, at::kFloat) * scale;
      CHECK(at::equal(out, want));
      at::Tensor avg = at::zeros({4});
      g[r].reduce_scatter_async(in, avg, ddp::ReduceOp::kAvg).wait();
      CHECK(at::allclose(avg, want / static_cast<float>(n)));
    });
    // Uneven pieces, one of them empty: rank r's piece has counts[r] elements.
    std::vector<int64_t> counts =
        n == 2 ? std::vector<int64_t>{3, 0} : std::vector<int64_t>{1, 5, 2};
    on_ranks(n, [&](int r) {
      int64_t total = 0, start = 0;
      for (int k = 0; k < n; ++k) {
        if (k < r) start += counts[static_cast<size_t>(k)];
        total += counts[static_cast<size_t>(k)];
      }
      at::Tensor in = at::arange(total, at::kDouble) + 100.0 * r;
      at::Tensor out = at::zeros({counts[static_cast<size_t>(r)]}, at::kDouble);
      g[r].reduce_scatter_async(in, out, ddp::ReduceOp::kSum, counts).wait();
      // sum over ranks k of (arange + 100 k) = n * arange + 100 * n(n-1)/2
      at::Tensor want = at::arange(start, start + counts[static_cast<size_t>(r)], at::kDouble) * n +
                        100.0 * n * (n - 1) / 2;
      CHECK(at::equal(out, want));
    });
  }
}

TEST_CASE("collectives: reduce-scatter refuses pieces that do not add up, before any traffic") {
  Groups g(2);
  on_ranks(2, [&](int r) {
    at::Tensor out = at::zeros({2});
    CHECK(error_of([&] {
            g[r].reduce_scatter_async(at::zeros({5}), out);
          }).find("do not split into 2 equal pieces") != std::string::npos);
    CHECK(error_of([&] {
            g[r].reduce_scatter_async(at::zeros({4}), out, ddp::ReduceOp::kSum, {1, 2});
          }).find("counts do not add up") != std::string::npos);
    CHECK(error_of([&] {
            g[r].reduce_scatter_async(at::zeros({4}), out, ddp::ReduceOp::kMax);
          }).find("sums or averages, not max") != std::string::npos);
    CHECK(error_of([&] {
            g[r].reduce_scatter_async(at::zeros({4}, at::kDouble), out);
          }).find("one dtype") != std::string::npos);
  });
}

TEST_CASE("collectives: all-gather into views of one buffer, gather to one rank, bytes") {
  Groups g(3);
  on_ranks(3, [&](int r) {
    at::Tensor buffer = at::zeros({3, 2});
    std::vector<at::Tensor> views{buffer[0], buffer[1], buffer[2]};
    g[r].all_gather_async(at::full({2}, static_cast<float>(r)), views).wait();
    CHECK(at::equal(buffer, at::arange(3, at::kFloat).repeat_interleave(2).view({3, 2})));
    CHECK(error_of([&] {
            g[r].all_gather_async(at::zeros({2}), {at::zeros({2})});
          }).find("1 output tensors for a group of 3") != std::string::npos);

    auto got = g[r].gather(at::full({1}, static_cast<float>(10 * r)), 1);
    if (r == 1) {
      REQUIRE(got.size() == 3);
      CHECK(got[2].item<float>() == 20.f);
    } else {
      CHECK(got.empty());
    }
    // Lengths differ, one is empty, bytes are not text.
    std::string mine(static_cast<size_t>(r * 3), static_cast<char>(r));
    auto all = g[r].all_gather_bytes(mine);
    REQUIRE(all.size() == 3);
    CHECK(all[0].empty());
    CHECK(all[2] == std::string(6, '\2'));
    auto at2 = g[r].gather_bytes(mine, 2);
    CHECK(at2.size() == (r == 2 ? 3u : 0u));
    if (r == 2) CHECK(at2[1] == std::string(3, '\1'));
  });
}

TEST_CASE("collectives: the same-lines check names the first line that differs on every rank") {
  Groups g(3);
  std::vector<std::string> errors(3);
  on_ranks(3, [&](int r) {
    std::vector<std::string> lines{"a [2] Float", r == 2 ? "b [4] Float" : "b [3] Float"};
    errors[static_cast<size_t>(r)] = error_of([&] {
      g[r].expect_same_lines(lines, "Thing", "models", "parameter", "build the same one");
    });
  });
  for (const auto& e : errors) {
    CHECK(e ==
          "Thing: the ranks' models differ at parameter #1: rank 0 has b [3] Float, rank 2 "
          "has b [4] Float (build the same one)");
  }
  on_ranks(3, [&](int r) {
    CHECK(error_of([&] {
            g[r].expect_same_lines(std::vector<std::string>(r == 0 ? 1 : 2, "x"), "T", "m", "p",
                                   "h");
          }).find("rank 0 has no entry #1 (1 in all)") != std::string::npos);
  });
}
