// NonFiniteGuard: a step whose loss or gradient norm is not finite is
// skipped (counted) or stops the job naming it, alike on every rank.
#include "test_util.h"

#include <cmath>
#include <limits>

#include "ddp/ddp_support.h"
#include "tandem/optim/nonfinite.h"

using namespace tandem;
using optim::NonFinite;
using optim::NonFiniteError;
using optim::NonFiniteGuard;

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
}  // namespace

TEST_CASE("nonfinite: skip counts the steps it skips; stop names the step and what") {
  NonFiniteGuard skip(NonFinite::kSkip);
  CHECK(skip.check(1, 2.5, 0.7));
  CHECK_FALSE(skip.check(2, kNaN, 0.7));
  CHECK_FALSE(skip.check(3, 2.5, kInf));
  CHECK_FALSE(skip.check(4, -kInf, kNaN));
  CHECK(skip.check(5, 0.0, 0.0));
  CHECK(skip.checked() == 5);
  CHECK(skip.skipped() == 3);
  CHECK(skip.skipped_steps() == std::vector<int64_t>{2, 3, 4});

  NonFiniteGuard stop;  // the default: stop
  CHECK(stop.policy() == NonFinite::kStop);
  CHECK(stop.check(1, 2.5, 0.7));
  for (const auto& [loss, norm, message] : std::vector<std::tuple<double, double, std::string>>{
           {kNaN, 1.0, "step 7: the loss is nan"},
           {1.0, kInf, "step 7: the gradient norm is inf"},
           {kNaN, kNaN, "step 7: the loss (nan) and the gradient norm (nan) are not finite"}}) {
    CAPTURE(message);
    try {
      stop.check(7, loss, norm);
      FAIL("no error");
    } catch (const NonFiniteError& e) {
      CHECK(e.step() == 7);
      CHECK(std::string(e.what()).find(message) != std::string::npos);
      CHECK(std::string(e.what()).find("the non-finite policy is 'stop'") != std::string::npos);
    }
  }
  CHECK(stop.skipped() == 0);

  CHECK(optim::non_finite_from_string("skip") == NonFinite::kSkip);
  CHECK(optim::non_finite_from_string("stop") == NonFinite::kStop);
  CHECK(std::string(optim::to_string(NonFinite::kSkip)) == "skip");
  CHECK_THROWS_WITH_AS(optim::non_finite_from_string("ignore"),
                       doctest::Contains("'ignore' is neither skip nor stop"),
                       std::invalid_argument);
}

TEST_CASE("nonfinite: ranks that agree over a group skip together, whoever saw the NaN") {
  test::Groups g(3);
  std::vector<std::vector<bool>> taken(3);
  std::vector<std::string> stopped(3);
  test::on_ranks(3, [&](int r) {
    NonFiniteGuard skip(NonFinite::kSkip, g.groups[r]);
    // Step 2: only rank 1's loss is NaN; step 3: only rank 2's norm.
    for (int64_t step = 1; step <= 4; ++step) {
      const double loss = step == 2 && r == 1 ? kNaN : 1.0;
      const double norm = step == 3 && r == 2 ? kInf : 1.0;
      taken[r].push_back(skip.check(step, loss, norm));
    }
    NonFiniteGuard stop(NonFinite::kStop, g.groups[r]);
    stopped[r] = test::error_of([&] { stop.check(9, r == 0 ? kNaN : 1.0, 1.0); });
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(taken[r] == std::vector<bool>{true, false, false, true});
    CHECK(stopped[r].find("step 9: ") != std::string::npos);
  }
  CHECK(stopped[0].find("the loss is nan") != std::string::npos);
  CHECK(stopped[1].find("not finite on another rank") != std::string::npos);
}
