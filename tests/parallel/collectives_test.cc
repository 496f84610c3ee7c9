// The differentiable collectives (parallel/collectives.h) against one
// process: each rank's result and its input's gradient equal what local
// autograd gives for the whole computation written out on every rank's
// values at once, for groups of 2 and 3 and along each dimension.
#include "test_util.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sum.h>

#include <functional>
#include <string>
#include <vector>

#include "ddp/ddp_support.h"
#include "tandem/parallel/collectives.h"

using namespace tandem;
namespace par = tandem::parallel;

namespace {

const auto kF64 = at::TensorOptions().dtype(at::kDouble);

// How a collective's result on rank r is made from every rank's input, in
// one process: what the distributed result must equal.
using Whole = std::function<at::Tensor(const std::vector<at::Tensor>& xs, int r)>;
using Op = std::function<at::Tensor(const at::Tensor& x, const par::Group& g)>;

struct Case {
  std::string name;
  Op op;
  Whole whole;
  // The input is one tensor replicated on every rank (the region before it
  // holds the same values everywhere): one leaf in the reference.
  bool replicated_input = false;
  // The output is a replicated region's: every rank's loss weights are the
  // same, and the reference counts that loss once.
  bool replicated_output = false;
};

std::vector<Case> cases(int64_t dim, int n) {
  auto piece = [dim, n](const at::Tensor& t, int r) { return par::piece_of(t, dim, r, n); };
  auto sum_all = [](const std::vector<at::Tensor>& xs) {
    at::Tensor s = xs[0];
    for (size_t i = 1; i < xs.size(); ++i) s = s + xs[i];
    return s;
  };
  return {
      {"all_reduce", [](const at::Tensor& x, const par::Group& g) { return par::all_reduce(x, g); },
       [sum_all](const std::vector<at::Tensor>& xs, int) { return sum_all(xs); }},
      {"all_gather",
       [dim](const at::Tensor& x, const par::Group& g) { return par::all_gather(x, dim, g); },
       [dim](const std::vector<at::Tensor>& xs, int) { return at::cat(xs, dim); }},
      {"reduce_scatter",
       [dim](const at::Tensor& x, const par::Group& g) { return par::reduce_scatter(x, dim, g); },
       [sum_all, piece](const std::vector<at::Tensor>& xs, int r) { return piece(sum_all(xs), r); }},
      {"copy_to_region",
       [](const at::Tensor& x, const par::Group& g) { return par::copy_to_region(x, g); },
       [](const std::vector<at::Tensor>& xs, int) { return xs[0] * 1; }, true, false},
      {"reduce_from_region",
       [](const at::Tensor& x, const par::Group& g) { return par::reduce_from_region(x, g); },
       [sum_all](const std::vector<at::Tensor>& xs, int) { return sum_all(xs); }, false, true},
      {"gather_from_region",
       [dim](const at::Tensor& x, const par::Group& g) {
         return par::gather_from_region(x, dim, g);
       },
       [dim](const std::vector<at::Tensor>& xs, int) { return at::cat(xs, dim); }, false, true},
      {"scatter_to_region",
       [dim](const at::Tensor& x, const par::Group& g) {
         return par::scatter_to_region(x, dim, g);
       },
       [piece](const std::vector<at::Tensor>& xs, int r) { return piece(xs[0], r); }, true, false},
  };
}

}  // namespace

TEST_CASE("parallel collectives: results and gradients equal one process's, tp 2 and 3") {
  for (int n : {2, 3}) {
    test::Groups g(n);
    for (int64_t dim : {0, 1, -1}) {
      for (const Case& c : cases(dim, n)) {
        CAPTURE(n);
        CAPTURE(dim);
        CAPTURE(c.name);
        // Every rank's input and loss weights, made here, the same on each
        // thread; replicated ones are the same for every rank.
        at::manual_seed(7);
        std::vector<at::Tensor> xs;
        for (int r = 0; r < n; ++r) {
          xs.push_back(c.replicated_input && r > 0 ? xs[0] : at::randn({6, 12}, kF64));
        }
        std::vector<at::Tensor> ws;
        for (int r = 0; r < n; ++r) {
          const at::Tensor y = c.whole(xs, r);
          ws.push_back(c.replicated_output && r > 0 ? ws[0] : at::randn(y.sizes(), kF64));
        }
        // One process: the whole computation, each rank's loss counted once
        // (a replicated region's once in all).
        std::vector<at::Tensor> leaves;
        for (int r = 0; r < n; ++r) {
          leaves.push_back(c.replicated_input && r > 0 ? leaves[0]
                                                       : xs[r].clone().requires_grad_());
        }
        std::vector<at::Tensor> want_y;
        at::Tensor loss = at::zeros({}, kF64);
        for (int r = 0; r < n; ++r) {
          const at::Tensor y = c.whole(leaves, r);
          want_y.push_back(y.detach());
          if (!c.replicated_output || r == 0) loss = loss + at::sum(ws[r] * y);
        }
        loss.backward();
        // The group, a thread a rank.
        std::vector<at::Tensor> got_y(n), got_grad(n);
        test::on_ranks(n, [&](int r) {
          at::Tensor x = xs[r].clone().requires_grad_();
          at::Tensor y = c.op(x, g.groups[r]);
          at::sum(ws[r] * y).backward();
          got_y[r] = y.detach();
          got_grad[r] = x.grad();
        });
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          CHECK(at::allclose(got_y[r], want_y[r]));
          REQUIRE(got_grad[r].defined());
          CHECK(at::allclose(got_grad[r], leaves[c.replicated_input ? 0 : r].grad()));
        }
      }
    }
  }
}

TEST_CASE("parallel collectives: a group of one is the identity; no gradient wanted, none made") {
  test::Groups one(1);
  at::Tensor x = at::randn({4, 6}, kF64).requires_grad_();
  for (const Case& c : cases(1, 1)) {
    CAPTURE(c.name);
    at::Tensor y = c.op(x, one.groups[0]);
    CHECK(y.data_ptr() == x.data_ptr());
  }
  test::Groups g(2);
  test::on_ranks(2, [&](int r) {
    at::Tensor plain = at::randn({4, 6}, kF64);  // requires no grad
    at::Tensor y = par::all_reduce(plain, g.groups[r]);
    CHECK_FALSE(y.requires_grad());
    CHECK_FALSE(y.grad_fn());
  });
}

TEST_CASE("parallel collectives: bad input is refused, naming it") {
  test::Groups g(2);
  const at::Tensor x = at::randn({5, 4}, kF64);
  CHECK_THROWS_WITH_AS(par::reduce_scatter(x, 0, g.groups[0]),
                       "reduce_scatter: dimension 0 of size 5 does not split into 2 equal pieces "
                       "(the group's size)",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(par::scatter_to_region(x, 0, g.groups[0]),
                       doctest::Contains("scatter_to_region: dimension 0 of size 5"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(par::all_gather(x, 2, g.groups[0]),
                       "all_gather: dimension 2 is out of range for a tensor of 2 dimension(s)",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(par::all_reduce(x, nullptr), "all_reduce: no process group",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(par::copy_to_region(at::Tensor(), g.groups[0]),
                       "copy_to_region: the tensor is undefined", std::invalid_argument);
}
