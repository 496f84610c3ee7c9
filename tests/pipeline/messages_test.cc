// The pipeline's messages (pipeline/step/messages.h): each comes back from
// its encoder through its decoder as it went in, and each decoder refuses a
// short, long or lying message naming the field. And its errors
// (pipeline/step/errors.h): their texts, and the echo of a failure told
// from the failure itself, here and after crossing the wire.
#include "test_util.h"

#include <ATen/ops/full.h>

#include <cmath>
#include <limits>

#include "tandem/pipeline/pipe.h"
#include "tandem/pipeline/step/errors.h"
#include "tandem/pipeline/step/messages.h"

using namespace tandem;
using pipeline::Action;
using pipeline::step::AbortNote;
using pipeline::step::Handoff;
using pipeline::step::PassList;
using pipeline::step::PassTimes;
using pipeline::step::RunReply;
using pipeline::step::RunRequest;
using pipeline::step::StepHeader;
using std::chrono::milliseconds;
using test::World;

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// What `fn` throws (it must throw std::invalid_argument), or "" if nothing.
std::string refusal(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Worker 1 of 2, four stages (it holds 1 and 3, the last), three micro-batches.
StepHeader header(bool train = true) { return {77, 3, 4, 2, 1, milliseconds(5000), train}; }

std::vector<Action> passes() {
  return {{Action::kForward, 1, 0},
          {Action::kForward, 3, 0},
          {Action::kBackward, 3, 0},
          {Action::kInputGrad, 1, 2},
          {Action::kWeightGrad, 1, 2}};
}

// A request for header()'s worker; modules are references held by `agent`.
RunRequest request(rpc::Agent& agent, bool train = true) {
  RunRequest r;
  r.header = header(train);
  r.stage_ids = {1, 3};
  for (int64_t s : r.stage_ids) {
    r.modules.push_back(rpc::RRef<c10::IValue>::make_local(agent, c10::IValue(s)));
  }
  r.passes.passes = passes();
  r.worker_names = {"worker0", "worker1"};
  r.loss = "mse";
  if (train) r.targets = {at::ones({2}), at::ones({2}), at::ones({1})};
  r.weights = {0.4, 0.4, 0.2};
  return r;
}

RunReply reply(const RunRequest& r) {
  RunReply a;
  a.losses = at::full({r.header.chunks}, 0.5, at::kDouble);
  double t = 0;
  for (const auto& p : r.passes.passes) {
    a.times.times.push_back({p, t, t + 1.5});
    t += 2;
  }
  a.peak_stash = 2;
  if (!r.header.train) a.outputs = {at::ones({2}), at::ones({2}), at::ones({1})};
  return a;
}

}  // namespace

TEST_CASE("pipeline messages: a step's header round-trips; a bad slot is refused by name") {
  const std::vector<int64_t> slots = header().encode();
  CHECK(slots == std::vector<int64_t>{77, 3, 4, 2, 1, 5000, 1});
  const StepHeader h = StepHeader::decode(slots);
  CHECK(h.step == 77);
  CHECK(h.chunks == 3);
  CHECK(h.stages == 4);
  CHECK(h.workers == 2);
  CHECK(h.me == 1);
  CHECK((h.timeout == milliseconds(5000)));
  CHECK(h.train);
  CHECK(h.holds_last());
  CHECK_FALSE(StepHeader::decode({77, 3, 4, 2, 0, 5000, 0}).train);
  // A day at most, so that deadlines cannot overflow.
  CHECK((StepHeader::decode({77, 3, 4, 2, 1, kMax, 1}).timeout == pipeline::step::kMaxPassTimeout));

  auto refused = [](std::vector<int64_t> s) { return refusal([&] { StepHeader::decode(s); }); };
  auto with = [&](size_t slot, int64_t value) {
    auto s = slots;
    s[slot] = value;
    return refused(s);
  };
  CHECK(refused({77, 3, 4, 2, 1, 5000}) ==
        "tandem.pipe.run: header has 6, not 7 (step, chunks, stages, workers, me, timeout_ms, "
        "train)");
  CHECK(has(refused({77, 3, 4, 2, 1, 5000, 1, 0}), "header has 8, not 7"));
  CHECK(has(refused({}), "header has 0, not 7"));
  CHECK(with(0, 0) == "tandem.pipe.run: header.step is 0, not at least 1");
  CHECK(has(with(0, -77), "header.step is -77"));
  CHECK(with(1, 0) == "tandem.pipe.run: header.chunks is 0, not in 1 .. 2147483647");
  CHECK(has(with(1, kMax), "header.chunks is 9223372036854775807"));
  CHECK(has(with(2, -4), "header.stages is -4"));
  CHECK(has(with(2, int64_t{1} << 40), "header.stages is 1099511627776"));
  CHECK(with(3, 0) == "tandem.pipe.run: header.workers is 0, not in 1 .. 4");
  CHECK(has(with(3, 5), "header.workers is 5, not in 1 .. 4"));
  CHECK(with(3, 3) == "tandem.pipe.run: header.stages is 4, not a multiple of header.workers (3)");
  CHECK(with(4, 2) == "tandem.pipe.run: header.me is 2, not in 0 .. 1");
  CHECK(has(with(4, -1), "header.me is -1"));
  CHECK(with(5, 0) == "tandem.pipe.run: header.timeout_ms is 0, not at least 1");
  CHECK(has(with(5, -1), "header.timeout_ms is -1"));
  CHECK(with(6, 2) == "tandem.pipe.run: header.train is 2, not in 0 .. 1");
  CHECK(has(with(6, -1), "header.train is -1"));
}

TEST_CASE(
    "pipeline messages: a worker's passes round-trip; a bad row or table is refused by name") {
  const std::vector<int64_t> held = {1, 3};
  const at::Tensor t = PassList{passes()}.encode();
  CHECK((t.sizes() == at::IntArrayRef({5, 3})));
  CHECK((t.scalar_type() == at::kLong));
  CHECK((PassList::decode(t, held, 3).passes == passes()));
  CHECK(PassList::decode(PassList{}.encode(), held, 3).passes.empty());

  auto refused = [&](const at::Tensor& bad) {
    return refusal([&] { PassList::decode(bad, held, 3); });
  };
  auto with = [&](int64_t row, int64_t col, int64_t value) {
    at::Tensor bad = t.clone();
    bad[row][col] = value;
    return refused(bad);
  };
  const std::string table =
      "tandem.pipe.run: the passes must be an [n, 3] int64 tensor on the CPU, got ";
  CHECK(refused(t.flatten()) == table + "[15] Long on cpu");
  CHECK(refused(t.narrow(1, 0, 2)) == table + "[5, 2] Long on cpu");
  CHECK(refused(at::zeros({5, 4}, at::kLong)) == table + "[5, 4] Long on cpu");
  CHECK(refused(t.to(at::kFloat)) == table + "[5, 3] Float on cpu");
  CHECK(refused(at::Tensor()) == table + "undefined");
  CHECK(with(2, 0, 4) == "tandem.pipe.run: passes[2].kind is 4, not in 0 .. 3");
  CHECK(has(with(0, 0, -1), "passes[0].kind is -1"));
  CHECK(with(1, 1, 2) ==
        "tandem.pipe.run: passes[1].stage is 2, not a stage this worker holds (1, 3)");
  CHECK(has(with(1, 1, -1), "passes[1].stage is -1"));
  CHECK(has(with(1, 1, kMax), "passes[1].stage is 9223372036854775807"));
  CHECK(with(3, 2, 3) == "tandem.pipe.run: passes[3].micro_batch is 3, not in 0 .. 2");
  CHECK(has(with(3, 2, -1), "passes[3].micro_batch is -1"));
  // A view's strides are read as they are.
  CHECK((PassList::decode(t.t().contiguous().t(), held, 3).passes == passes()));
}

TEST_CASE(
    "pipeline messages: pass times round-trip; a row of another pass or a bad time is refused") {
  const std::vector<Action> sent = passes();
  PassTimes times;
  for (size_t i = 0; i < sent.size(); ++i) {
    times.times.push_back({sent[i], 2.0 * i, 2.0 * i + 1.25});
  }
  const at::Tensor t = times.encode();
  CHECK((t.sizes() == at::IntArrayRef({5, 5})));
  CHECK((t.scalar_type() == at::kDouble));
  const PassTimes back = PassTimes::decode(t, sent, "answer");
  REQUIRE(back.times.size() == sent.size());
  for (size_t i = 0; i < sent.size(); ++i) {
    CHECK((back.times[i].pass == sent[i]));
    CHECK(back.times[i].start_us == 2.0 * i);
    CHECK(back.times[i].end_us == 2.0 * i + 1.25);
  }

  auto refused = [&](const at::Tensor& bad) {
    return refusal([&] { PassTimes::decode(bad, sent, "answer"); });
  };
  auto with = [&](int64_t row, int64_t col, double value) {
    at::Tensor bad = t.clone();
    bad[row][col] = value;
    return refused(bad);
  };
  CHECK(refused(t.narrow(1, 0, 4)) ==
        "answer: times must be an [n, 5] double tensor on the CPU, got [5, 4] Double on cpu");
  CHECK(has(refused(t.to(at::kFloat)), "times must be an [n, 5] double tensor"));
  CHECK(has(refused(t.flatten()), "got [25] Double"));
  CHECK(refused(t.narrow(0, 0, 4)) == "answer: times has 4, not 5 (one per pass sent)");
  CHECK(has(refused(at::cat({t, t.narrow(0, 0, 1)})), "times has 6, not 5"));
  CHECK(has(with(1, 0, 1),
            "answer: times[1] is of (kind 1.000000, stage 3.000000, micro-batch "
            "0.000000), not of the pass sent, F0@3"));
  CHECK(has(with(1, 1, 1), "times[1] is of"));
  CHECK(has(with(1, 2, 0.5), "times[1] is of"));
  CHECK(has(with(2, 3, -1), "answer: times[2].start_us is -1.000000, not a time"));
  CHECK(has(with(2, 3, std::nan("")), "times[2].start_us is nan"));
  CHECK(
      has(with(2, 4, 3.5), "times[2].end_us is 3.500000, not a time from start_us (4.000000) on"));
  CHECK(has(with(2, 4, std::numeric_limits<double>::infinity()), "times[2].end_us is inf"));
}

TEST_CASE(
    "pipeline messages: a run's request and answer round-trip; a lying field is refused by name") {
  World w(1);
  {
    auto& agent = *w.agents[0];
    const RunRequest sent = request(agent);
    std::vector<c10::IValue> args = sent.encode();
    REQUIRE(args.size() == 11);
    const RunRequest r = RunRequest::decode(args);
    CHECK(r.header.encode() == sent.header.encode());
    CHECK(r.stage_ids == sent.stage_ids);
    REQUIRE(r.modules.size() == 2);
    CHECK(r.modules[1].local_value().toInt() == 3);
    CHECK((r.passes.passes == sent.passes.passes));
    CHECK(r.worker_names == sent.worker_names);
    CHECK(r.loss == "mse");
    CHECK(r.inputs.empty());
    REQUIRE(r.targets.size() == 3);
    CHECK(at::equal(r.targets[2], sent.targets[2]));
    CHECK(r.weights == sent.weights);
    CHECK(r.data_parallel.group.empty());
    CHECK(r.data_parallel.sync);
    CHECK_FALSE(r.data_parallel.averages());
    {
      RunRequest dp = request(agent);
      dp.data_parallel = {"mesh#0/dp", false, 4096};
      const RunRequest back = RunRequest::decode(dp.encode());
      CHECK(back.data_parallel.group == "mesh#0/dp");
      CHECK_FALSE(back.data_parallel.sync);
      CHECK(back.data_parallel.bucket_cap_bytes == 4096);
      CHECK_FALSE(back.data_parallel.averages());  // not while accumulating
    }

    auto refused = [](const RunRequest& bad) {
      return refusal([&] { RunRequest::decode(bad.encode()); });
    };
    auto changed = [&](const std::function<void(RunRequest&)>& change) {
      RunRequest bad = request(agent);
      change(bad);
      return refused(bad);
    };
    auto arg = [&](size_t i, c10::IValue v) {
      auto bad = sent.encode();
      bad[i] = std::move(v);
      return refusal([&] { RunRequest::decode(bad); });
    };
    {
      auto short_args = sent.encode();
      short_args.pop_back();
      CHECK(refusal([&] { RunRequest::decode(short_args); }) ==
            "tandem.pipe.run: 10 arguments, not 11 (header, stages, modules, passes, worker "
            "names, loss, inputs, targets, weights, data-parallel group, data-parallel flags)");
      auto long_args = sent.encode();
      long_args.emplace_back(int64_t{1});
      CHECK(has(refusal([&] { RunRequest::decode(long_args); }), "12 arguments, not 11"));
    }
    CHECK(arg(0, c10::IValue("x")) == "tandem.pipe.run: header: expected list, got String");
    CHECK(has(changed([](RunRequest& b) { b.header.me = 2; }), "header.me is 2"));
    CHECK(arg(1, c10::IValue(int64_t{1})) == "tandem.pipe.run: stages: expected list, got Int");
    CHECK(changed([](RunRequest& b) { b.stage_ids = {1}; }) ==
          "tandem.pipe.run: stages has 1, not 2 (stages per worker)");
    CHECK(changed([](RunRequest& b) {
            b.stage_ids = {1, 2};
          }) == "tandem.pipe.run: stages[1] is 2, not 3 (worker 1 holds stages 1, 1 + 2, ...)");
    CHECK(has(changed([](RunRequest& b) { b.stage_ids = {3, 1}; }), "stages[0] is 3, not 1"));
    CHECK(
        has(arg(2, c10::IValue(std::vector<int64_t>{1, 2})), "modules[0]: expected RRef, got Int"));
    CHECK(changed([](RunRequest& b) { b.modules.pop_back(); }) ==
          "tandem.pipe.run: modules has 1, not 2 (one per stage)");
    CHECK(
        has(arg(3, c10::IValue(int64_t{0})), "tandem.pipe.run: passes: expected Tensor, got Int"));
    CHECK(has(changed([](RunRequest& b) {
                b.passes.passes.push_back({Action::kForward, 0, 0});
              }),
              "passes[5].stage is 0, not a stage this worker holds (1, 3)"));
    CHECK(has(changed([](RunRequest& b) {
                b.passes.passes.push_back({Action::kForward, 1, 3});
              }),
              "passes[5].micro_batch is 3, not in 0 .. 2"));
    CHECK(changed([](RunRequest& b) { b.worker_names.push_back("worker2"); }) ==
          "tandem.pipe.run: worker_names has 3, not 2 (one per worker)");
    CHECK(has(changed([](RunRequest& b) { b.worker_names.pop_back(); }),
              "worker_names has 1, not 2"));
    CHECK(changed([](RunRequest& b) { b.worker_names[0].clear(); }) ==
          "tandem.pipe.run: worker_names[0] is empty");
    CHECK(has(arg(5, c10::IValue(int64_t{0})), "tandem.pipe.run: loss: expected str, got Int"));
    CHECK(changed([](RunRequest& b) { b.inputs = {at::ones({2})}; }) ==
          "tandem.pipe.run: inputs has 1, not 0 (only stage 0's worker gets them)");
    CHECK(changed([](RunRequest& b) { b.targets.pop_back(); }) ==
          "tandem.pipe.run: targets has 2, not 3 (one per micro-batch for the last stage)");
    CHECK(has(changed([](RunRequest& b) { b.header.train = false; }),
              "targets has 3, not 0 (only the last stage's worker gets them, when training)"));
    CHECK(changed([](RunRequest& b) { b.weights.push_back(0); }) ==
          "tandem.pipe.run: weights has 4, not 3 (one per micro-batch)");
    CHECK(changed([](RunRequest& b) { b.weights[1] = 1.5; }) ==
          "tandem.pipe.run: weights[1] is 1.500000, not a share of the batch (0 .. 1)");
    CHECK(has(changed([](RunRequest& b) { b.weights[2] = -0.25; }), "weights[2] is -0.250000"));
    CHECK(has(changed([](RunRequest& b) { b.weights[0] = std::nan(""); }), "weights[0] is nan"));
    CHECK(has(arg(9, c10::IValue(int64_t{0})), "data-parallel group: expected str, got Int"));
    CHECK(arg(10, c10::IValue(std::vector<int64_t>{1})) ==
          "tandem.pipe.run: data-parallel flags has 1, not 2 (sync, bucket_cap_bytes)");
    CHECK(arg(10, c10::IValue(std::vector<int64_t>{2, 10})) ==
          "tandem.pipe.run: data-parallel sync is 2, not in 0 .. 1");
    CHECK(arg(10, c10::IValue(std::vector<int64_t>{1, 0})) ==
          "tandem.pipe.run: data-parallel bucket_cap_bytes is 0, not at least 1");
    // Worker 0 gets the inputs, one per micro-batch.
    CHECK(has(changed([](RunRequest& b) {
                b.header.me = 0;
                b.stage_ids = {0, 2};
                b.passes.passes = {{Action::kForward, 0, 0}};
                b.targets.clear();
              }),
              "inputs has 0, not 3 (one per micro-batch for stage 0)"));

    // The answer, checked against the request it answers.
    const RunReply a = reply(r);
    const RunReply back = RunReply::decode(a.encode(), r);
    CHECK(at::equal(back.losses, a.losses));
    REQUIRE(back.times.times.size() == 5);
    CHECK((back.times.times[4].pass == r.passes.passes[4]));
    CHECK(back.times.times[4].end_us == 9.5);
    CHECK(back.peak_stash == 2);
    CHECK(back.outputs.empty());
    RunRequest forward = request(agent, /*train=*/false);
    CHECK(RunReply::decode(reply(forward).encode(), forward).outputs.size() == 3);

    const std::string from = "tandem.pipe.run's answer from worker1: ";
    auto answer = [&](const std::function<void(RunReply&)>& change, const RunRequest& to) {
      RunReply bad = reply(to);
      change(bad);
      return refusal([&] { RunReply::decode(bad.encode(), to); });
    };
    CHECK(refusal([&] { RunReply::decode(c10::IValue(int64_t{1}), r); }) ==
          from + "the answer is a Int, not a tuple");
    CHECK(
        refusal([&] {
          RunReply::decode(c10::ivalue::Tuple::create({a.losses, a.times.encode(), int64_t{2}}), r);
        }) == from + "3 fields, not 5 (losses, times, peak_stash, outputs, allreduces)");
    CHECK(refusal([&] {
            RunReply::decode(c10::ivalue::Tuple::create({a.losses, int64_t{0}, int64_t{2},
                                                         c10::IValue(std::vector<at::Tensor>{}),
                                                         a.allreduces.encode()}),
                             r);
          }) == from + "times: expected Tensor, got Int");
    // The all-reduce times: only when averaging, one row a stage of the worker's.
    {
      RunRequest dp = request(agent);
      dp.data_parallel.group = "mesh#0/dp";
      RunReply ok = reply(dp);
      ok.allreduces.times = {{3, 1.0, 4.0}, {1, 2.0, 2.0}};
      const RunReply got = RunReply::decode(ok.encode(), dp);
      REQUIRE(got.allreduces.times.size() == 2);
      CHECK(got.allreduces.times[0].stage == 3);
      CHECK(got.allreduces.times[0].done_us == 4.0);
      CHECK(answer(
                [](RunReply& b) {
                  b.allreduces.times = {{1, 1.0, 2.0}};
                },
                r) == from + "allreduces has rows, but the step asked for no averaging");
      CHECK(answer(
                [](RunReply& b) {
                  b.allreduces.times = {{2, 1.0, 2.0}};
                },
                dp) == from + "allreduces[0].stage is 2.000000, not a stage of this worker");
      CHECK(answer(
                [](RunReply& b) {
                  b.allreduces.times = {{1, 1.0, 2.0}, {1, 3.0, 4.0}};
                },
                dp) == from + "allreduces[1].stage is 1, averaged twice in one step");
      CHECK(has(answer(
                    [](RunReply& b) {
                      b.allreduces.times = {{1, 5.0, 2.0}};
                    },
                    dp),
                "allreduces[0].done_us is 2.000000, not a time from launch_us (5.000000) on"));
      CHECK(has(answer(
                    [](RunReply& b) {
                      b.allreduces.times = {{1, -1.0, 2.0}};
                    },
                    dp),
                "allreduces[0].launch_us is -1.000000, not a time"));
    }
    CHECK(answer([](RunReply& b) { b.losses = at::zeros({4}, at::kDouble); }, r) ==
          from + "losses has 4, not 3 (one per micro-batch)");
    CHECK(answer([](RunReply& b) { b.losses = at::zeros({3}, at::kFloat); }, r) ==
          from + "losses must be a [chunks] double tensor on the CPU, got [3] Float on cpu");
    CHECK(has(answer(
                  [](RunReply& b) {
                    b.losses = at::zeros({3, 1}, at::kDouble);
                  },
                  r),
              "losses must be a [chunks] double tensor"));
    CHECK(answer([](RunReply& b) { b.times.times.pop_back(); }, r) ==
          from + "times has 4, not 5 (one per pass sent)");
    CHECK(has(answer([](RunReply& b) { b.times.times[0].pass.chunk = 1; }, r),
              "times[0] is of (kind 0.000000, stage 1.000000, micro-batch 1.000000), not of the "
              "pass sent, F0@1"));
    CHECK(answer([](RunReply& b) { b.peak_stash = -1; }, r) ==
          from + "peak_stash is -1, not in 0 .. 5");
    CHECK(has(answer([](RunReply& b) { b.peak_stash = 6; }, r), "peak_stash is 6, not in 0 .. 5"));
    CHECK(answer([](RunReply& b) { b.outputs = {at::ones({1})}; }, r) ==
          from + "outputs has 1, not 0 (only the last stage's worker gives them, forwards only)");
    CHECK(answer([](RunReply& b) { b.outputs.pop_back(); }, forward) ==
          from + "outputs has 2, not 3 (one per micro-batch)");
    CHECK(answer([](RunReply& b) { b.outputs[1] = at::Tensor(); }, forward) ==
          from + "outputs[1] is undefined");
  }
  w.shutdown();
}

TEST_CASE("pipeline messages: a hand-off and an abort round-trip; a bad field is refused by name") {
  const Handoff h{78, milliseconds(2000), pipeline::step::kGradient, 2, 5, at::ones({2, 3})};
  const std::vector<c10::IValue> args = h.encode();
  const Handoff back = Handoff::decode(args);
  CHECK(back.step == 78);
  CHECK((back.timeout == milliseconds(2000)));
  CHECK((back.slot == pipeline::step::kGradient));
  CHECK(back.stage == 2);
  CHECK(back.chunk == 5);
  CHECK(at::equal(back.tensor, h.tensor));
  // The layout tests and older peers send by hand.
  CHECK((Handoff::decode(
             rpc::to_ivalues(int64_t{79}, kMax, int64_t{0}, int64_t{1}, int64_t{0}, at::ones({1})))
             .timeout == pipeline::step::kMaxPassTimeout));

  auto put_with = [&](size_t i, c10::IValue v) {
    auto bad = args;
    bad[i] = std::move(v);
    return refusal([&] { Handoff::decode(bad); });
  };
  CHECK(refusal([&] {
          Handoff::decode({args.begin(), args.end() - 1});
        }) ==
        "tandem.pipe.put: 5 arguments, not 6 (step, timeout_ms, slot, stage, micro-batch, tensor)");
  CHECK(put_with(0, int64_t{0}) == "tandem.pipe.put: step is 0, not at least 1");
  CHECK(has(put_with(0, c10::IValue("x")), "tandem.pipe.put: step: expected int, got String"));
  CHECK(put_with(1, int64_t{0}) == "tandem.pipe.put: timeout_ms is 0, not at least 1");
  CHECK(has(put_with(1, int64_t{-5}), "timeout_ms is -5"));
  CHECK(put_with(2, int64_t{2}) == "tandem.pipe.put: slot is 2, not in 0 .. 1");
  CHECK(has(put_with(2, int64_t{-1}), "slot is -1"));
  CHECK(put_with(3, int64_t{-1}) == "tandem.pipe.put: stage is -1, not in 0 .. 2147483647");
  CHECK(put_with(4, int64_t{-2}) == "tandem.pipe.put: micro_batch is -2, not in 0 .. 2147483647");
  CHECK(put_with(5, int64_t{1}) == "tandem.pipe.put: tensor: expected Tensor, got Int");
  CHECK(put_with(5, c10::IValue(at::Tensor())) == "tandem.pipe.put: tensor is undefined");

  const AbortNote note{80, milliseconds(60000), "forward of micro-batch 0 failed"};
  const AbortNote got = AbortNote::decode(note.encode());
  CHECK(got.step == 80);
  CHECK((got.timeout == milliseconds(60000)));
  CHECK(got.why == note.why);
  auto abort_with = [&](size_t i, c10::IValue v) {
    auto bad = note.encode();
    bad[i] = std::move(v);
    return refusal([&] { AbortNote::decode(bad); });
  };
  auto four = note.encode();
  four.emplace_back(int64_t{0});
  CHECK(refusal([&] { AbortNote::decode(four); }) ==
        "tandem.pipe.abort: 4 arguments, not 3 (step, timeout_ms, why)");
  CHECK(abort_with(0, int64_t{-80}) == "tandem.pipe.abort: step is -80, not at least 1");
  CHECK(abort_with(1, int64_t{0}) == "tandem.pipe.abort: timeout_ms is 0, not at least 1");
  CHECK(abort_with(2, c10::IValue(std::string())) == "tandem.pipe.abort: why is empty");
  CHECK(abort_with(2, int64_t{3}) == "tandem.pipe.abort: why: expected str, got Int");
}

TEST_CASE(
    "pipeline errors: a failed pass and an aborted step are types, told apart across the wire") {
  using namespace pipeline::step;
  const Action f{Action::kForward, 1, 3};
  const PassError failed(f, "worker2", "boom");
  CHECK(std::string(failed.what()) == "forward of micro-batch 3 through stage 1 on worker2: boom");
  CHECK((failed.pass() == f));
  const PassTimeoutError late({Action::kInputGrad, 0, 2}, "worker1",
                              "its output's gradient did not come within 100 ms");
  CHECK(std::string(late.what()) ==
        "input gradient of micro-batch 2 through stage 0 on worker1: "
        "its output's gradient did not come within 100 ms");
  CHECK(dynamic_cast<const rpc::TimeoutError*>(&late) != nullptr);  // crosses the wire as one
  const StepAborted echo("agent worker3 shut down");
  CHECK(std::string(echo.what()) == "step aborted: agent worker3 shut down");
  CHECK(echo.why() == "agent worker3 shut down");

  CHECK(is_step_aborted(echo));
  CHECK_FALSE(is_step_aborted(failed));
  CHECK_FALSE(is_step_aborted(late));
  CHECK(is_step_aborted(rpc::RemoteError("worker1", echo.what())));
  CHECK_FALSE(is_step_aborted(rpc::RemoteError("worker1", failed.what())));
  // Only at the start of the remote message: a failure whose cause quotes
  // an echo is a failure.
  CHECK_FALSE(is_step_aborted(rpc::RemoteError("worker1", std::string("forward: ") + echo.what())));
  CHECK_FALSE(is_step_aborted(rpc::TimeoutError(echo.what())));

  // As they arrive from a worker that threw them.
  World w(2, [](rpc::Registry& reg) {
    reg.def("test_abort", [] { throw StepAborted("a worker of the step failed"); });
    reg.def("test_fail", [] { throw PassError({Action::kBackward, 2, 0}, "worker1", "no"); });
    reg.def("test_late", [] {
      throw PassTimeoutError({Action::kForward, 1, 0}, "worker1", "its input did not come");
    });
  });
  {
    auto error = [&](const char* fn) -> std::exception_ptr {
      try {
        w.agents[0]->rpc_sync("worker1", fn);
      } catch (...) {
        return std::current_exception();
      }
      return nullptr;
    };
    auto aborted = [](const std::exception_ptr& e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        return is_step_aborted(x);
      }
    };
    auto text = [](const std::exception_ptr& e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        return std::string(x.what());
      }
    };
    auto e = error("test_abort");
    REQUIRE(e);
    CHECK(aborted(e));
    CHECK(text(e) == "Error on worker1: step aborted: a worker of the step failed");
    e = error("test_fail");
    REQUIRE(e);
    CHECK_FALSE(aborted(e));
    CHECK(text(e) == "Error on worker1: backward of micro-batch 0 through stage 2 on worker1: no");
    e = error("test_late");
    REQUIRE(e);
    CHECK_FALSE(aborted(e));
    CHECK_THROWS_AS(std::rethrow_exception(e), rpc::TimeoutError);
  }
  w.shutdown();
}

TEST_CASE("pipeline messages: a stage worker refuses a lying run or hand-off, naming the field") {
  World w(2);
  {
    // A run whose header names a worker that is not there: the caller's
    // error says which field.
    RunRequest bad;
    bad.header = {5, 1, 2, 2, 5, milliseconds(1000), false};
    const std::string error = test::error_of(
        [&] { w.agents[0]->call("worker1", pipeline::step::kRunFn, bad.encode()).wait(); });
    CHECK(error == "Error on worker1: tandem.pipe.run: header.me is 5, not in 0 .. 1");
    // A hand-off in a slot that is neither is dropped; a good one is kept.
    rpc::LayerAccess::notify(*w.agents[0], "worker1", pipeline::step::kPutFn,
                             rpc::to_ivalues(int64_t{90}, int64_t{60000}, int64_t{7}, int64_t{1},
                                             int64_t{0}, at::ones({1})));
    rpc::LayerAccess::notify(*w.agents[0], "worker1", pipeline::step::kPutFn,
                             rpc::to_ivalues(int64_t{91}, int64_t{60000}, int64_t{0}, int64_t{1},
                                             int64_t{0}, at::ones({1})));
    CHECK(test::eventually([&] { return pipeline::pending_steps(*w.agents[1]) == 1; },
                           std::chrono::milliseconds(5000)));
    std::this_thread::sleep_for(milliseconds(50));
    CHECK(pipeline::pending_steps(*w.agents[1]) == 1);
  }
  w.shutdown();
}
