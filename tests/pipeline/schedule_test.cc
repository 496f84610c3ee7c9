// Pipeline schedules: every plan runs each pass once in an order that can
// finish; 1F1B's order and stash bound, GPipe's stash, the bubbles the
// simulator measures against the closed forms; bad plans named.
#include "test_util.h"

#include "tandem/pipeline/schedule.h"

using namespace tandem;
using pipeline::Action;

namespace {

std::string listing(const std::vector<Action>& actions) {
  std::string out;
  for (const auto& a : actions) out += (out.empty() ? "" : " ") + pipeline::to_string(a);
  return out;
}

}  // namespace

TEST_CASE("pipeline schedules: every plan runs each pass once, in an order that can finish") {
  for (const char* name : {"gpipe", "1f1b", "zero-bubble", "interleaved", "interleaved:3"}) {
    auto schedule = pipeline::make_schedule(name);
    const int v = schedule->stages_per_worker();
    for (int workers = 1; workers <= 4; ++workers) {
      for (int chunks = 1; chunks <= 12; ++chunks) {
        if (v > 1 && chunks % workers != 0) continue;
        CAPTURE(name);
        CAPTURE(workers);
        CAPTURE(chunks);
        pipeline::Plan plan = schedule->plan(workers, chunks);
        CHECK(plan.stages == workers * v);
        CHECK_NOTHROW(pipeline::check(plan));
      }
    }
  }
}

TEST_CASE("pipeline schedules: 1F1B's order, and what each schedule stashes") {
  pipeline::Plan plan = pipeline::OneFOneB().plan(2, 4);
  CHECK(listing(plan.actions[0]) == "F0@0 F1@0 B0@0 F2@0 B1@0 F3@0 B2@0 B3@0");
  CHECK(listing(plan.actions[1]) == "F0@1 B0@1 F1@1 B1@1 F2@1 B2@1 F3@1 B3@1");
  for (int workers : {2, 3, 4}) {
    for (int chunks : {1, 3, 8}) {
      CAPTURE(workers);
      CAPTURE(chunks);
      auto gpipe = pipeline::simulate(pipeline::GPipe().plan(workers, chunks));
      auto ofob = pipeline::simulate(pipeline::OneFOneB().plan(workers, chunks));
      for (int w = 0; w < workers; ++w) {
        CHECK(gpipe.peak_stash[w] == chunks);
        // 1F1B: never more than the stages after this one need, so at most `workers`.
        CHECK(ofob.peak_stash[w] == std::min(workers - w, chunks));
      }
    }
  }
}

TEST_CASE("pipeline schedules: the simulated bubbles match the closed forms") {
  const double f = 1, b = 2;
  for (int workers : {2, 3, 4}) {
    for (int chunks : {2 * workers, 4 * workers}) {  // interleaving needs multiples
      CAPTURE(workers);
      CAPTURE(chunks);
      // GPipe and 1F1B: (chunks + workers - 1) slots of f + b.
      const double ideal = (chunks + workers - 1) * (f + b);
      auto gpipe = pipeline::simulate(pipeline::GPipe().plan(workers, chunks), f, b);
      auto ofob = pipeline::simulate(pipeline::OneFOneB().plan(workers, chunks), f, b);
      CHECK(gpipe.makespan == doctest::Approx(ideal));
      CHECK(ofob.makespan == doctest::Approx(ideal));
      for (int w = 0; w < workers; ++w) {
        CHECK(ofob.bubble[w] == doctest::Approx((workers - 1.0) / (chunks + workers - 1)));
      }
      // Interleaved with 2 stages per worker, each half the work: the
      // bubble's (workers - 1) slots shrink to half.
      auto inter =
          pipeline::simulate(pipeline::Interleaved1F1B(2).plan(workers, chunks), f / 2, b / 2);
      CHECK(inter.makespan == doctest::Approx(chunks * (f + b) + (workers - 1) * (f + b) / 2));
      CHECK(inter.makespan < ofob.makespan);
    }
  }
}

TEST_CASE("pipeline schedules: bad counts and bad plans are refused, naming the problem") {
  CHECK(test::error_of([] { pipeline::make_schedule("chimera"); })
            .find("unknown pipeline schedule 'chimera' (gpipe, 1f1b, zero-bubble, interleaved or "
                  "interleaved:N)") != std::string::npos);
  CHECK(test::error_of([] {
          pipeline::make_schedule("interleaved:x");
        }).find("unknown pipeline schedule") != std::string::npos);
  CHECK(test::error_of([] {
          pipeline::make_schedule("interleaved:0");
        }).find("stages per worker must be at least 1, got 0") != std::string::npos);
  CHECK(test::error_of([] {
          pipeline::GPipe().plan(0, 4);
        }).find("gpipe: the pipeline needs at least 1 worker, got 0") != std::string::npos);
  CHECK(test::error_of([] {
          pipeline::OneFOneB().plan(2, 0);
        }).find("1f1b: chunks (micro-batches) must be at least 1, got 0") != std::string::npos);
  CHECK(test::error_of([] {
          pipeline::Interleaved1F1B(2).plan(2, 3);
        }).find("interleaved:2: chunks (3) must be a multiple of the workers (2)") !=
        std::string::npos);

  pipeline::Plan plan = pipeline::GPipe().plan(2, 2);
  auto broken = [&](auto edit) {
    pipeline::Plan p = plan;
    edit(p);
    return test::error_of([&] { pipeline::check(p); });
  };
  CHECK(broken([](pipeline::Plan& p) { p.actions[1].pop_back(); }).find("no worker runs B1@1") !=
        std::string::npos);
  CHECK(broken([](pipeline::Plan& p) {
          p.actions[0][1] = p.actions[0][0];
        }).find("F0@0 is listed twice") != std::string::npos);
  CHECK(broken([](pipeline::Plan& p) {
          std::swap(p.actions[0][0], p.actions[1][0]);
        }).find("worker 0 lists F0@1, whose stage lives on worker 1") != std::string::npos);
  CHECK(broken([](pipeline::Plan& p) {
          p.actions[0][0].chunk = 5;
        }).find("outside 2 stages and 2 chunks") != std::string::npos);
  // Worker 1 runs B0 before the F0 whose loss it needs; worker 0 waits on it.
  const std::string stuck = broken([](pipeline::Plan& p) {
    std::rotate(p.actions[1].begin(), p.actions[1].begin() + 2, p.actions[1].end());
  });
  CHECK(stuck.find("the plan cannot finish") != std::string::npos);
  CHECK(stuck.find("worker 0 at B0@0 (action 2 of its list), worker 1 at B0@1 (action 0 of its "
                   "list)") != std::string::npos);
}

namespace {

// A schedule of a user's own: GPipe with the backwards in reverse order.
class ReverseGPipe final : public pipeline::Schedule {
 public:
  std::string name() const override { return "reverse-gpipe"; }
  pipeline::Plan plan(int workers, int chunks) const override {
    pipeline::Plan p = pipeline::GPipe().plan(workers, chunks);
    for (auto& list : p.actions) std::reverse(list.begin() + chunks, list.end());
    return p;
  }
};

}  // namespace

TEST_CASE("pipeline schedules: a schedule of the user's plugs in") {
  ReverseGPipe schedule;
  pipeline::Plan plan = schedule.plan(3, 4);
  CHECK(listing(plan.actions[2]) == "F0@2 F1@2 F2@2 F3@2 B3@2 B2@2 B1@2 B0@2");
  auto sim = pipeline::simulate(plan);
  CHECK(sim.makespan == doctest::Approx((4 + 3 - 1) * 3.0));
  CHECK(sim.peak_stash == std::vector<int>{4, 4, 4});
}

TEST_CASE(
    "pipeline schedules: zero-bubble splits each backward, keeps 1F1B's memory, and "
    "shrinks the bubble") {
  pipeline::Plan plan = pipeline::ZeroBubble().plan(2, 4);
  // The last worker sends each input gradient before its weight pass; the
  // first fills its wait for gradients with forwards and weight passes.
  CHECK(listing(plan.actions[1]) == "F0@1 I0@1 W0@1 F1@1 I1@1 W1@1 F2@1 I2@1 W2@1 F3@1 I3@1 W3@1");
  CHECK(listing(plan.actions[0]) == "F0@0 F1@0 I0@0 W0@0 F2@0 I1@0 W1@0 F3@0 I2@0 W2@0 I3@0 W3@0");
  for (int workers : {2, 3, 4}) {
    for (int chunks : {1, 3, 8}) {
      CAPTURE(workers);
      CAPTURE(chunks);
      auto p = pipeline::ZeroBubble().plan(workers, chunks);
      auto zb = pipeline::simulate(p, 1, 2, 1);
      auto ofob = pipeline::simulate(pipeline::OneFOneB().plan(workers, chunks), 1, 2, 1);
      for (int w = 0; w < workers; ++w) {
        CHECK(zb.peak_stash[w] <= std::min(workers - w, chunks));
        CHECK(p.actions[w].size() == static_cast<size_t>(3 * chunks));
      }
      CHECK(zb.makespan <= ofob.makespan);
      if (workers > 1 && chunks > 1) CHECK(zb.makespan < ofob.makespan);
    }
  }
  CHECK(pipeline::make_schedule("zero-bubble")->name() == "zero-bubble");
}

TEST_CASE(
    "pipeline schedules: split backwards that are half there, doubled or out of order are "
    "refused") {
  using K = Action::Kind;
  auto plan = [](std::vector<Action> w0) {
    pipeline::Plan p;
    p.workers = 1;
    p.stages = 1;
    p.chunks = 1;
    p.actions = {std::move(w0)};
    return p;
  };
  CHECK_NOTHROW(
      pipeline::check(plan({{K::kForward, 0, 0}, {K::kInputGrad, 0, 0}, {K::kWeightGrad, 0, 0}})));
  CHECK(test::error_of([&] {
          pipeline::check(plan({{K::kForward, 0, 0}, {K::kInputGrad, 0, 0}}));
        }) == "no worker runs W0@0 (I0@0 is listed)");
  CHECK(test::error_of([&] {
          pipeline::check(plan({{K::kForward, 0, 0}, {K::kWeightGrad, 0, 0}}));
        }) == "no worker runs I0@0 (W0@0 is listed)");
  CHECK(
      test::error_of([&] {
        pipeline::check(plan({{K::kForward, 0, 0}, {K::kBackward, 0, 0}, {K::kWeightGrad, 0, 0}}));
      }) ==
      "the backward of micro-batch 0 through stage 0 is listed both whole (B0@0) and split "
      "(W0@0)");
  CHECK(
      test::error_of([&] {
        pipeline::check(plan({{K::kForward, 0, 0}, {K::kWeightGrad, 0, 0}, {K::kInputGrad, 0, 0}}));
      }).find("the plan cannot finish") != std::string::npos);
  CHECK(test::error_of([&] { pipeline::simulate(pipeline::ZeroBubble().plan(2, 2), 1, 1, 2); }) ==
        "simulate: costs must be >= 0, and a backward's at least its W's");
}
