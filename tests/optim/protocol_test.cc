// The messages between a DistributedOptimizer and its owners
// (optim/owner/protocol.h): each encodes as the IValues the functions have
// always taken, decodes back to what was encoded, and a short, long or
// lying message is refused naming the function and the field.
#include "test_util.h"

#include <ATen/ops/scalar_tensor.h>

#include <cmath>
#include <limits>

#include "optim/optim_support.h"
#include "tandem/autograd/autograd.h"
#include "tandem/optim/distributed_optimizer.h"
#include "tandem/optim/owner/protocol.h"
#include "tandem/rpc/rref.h"

using namespace tandem;
using namespace tandem::optim::owner;
using test::World;
namespace optim_support = tandem::test::optim_support;

namespace {

const double kNaN = std::nan("");
const double kInf = std::numeric_limits<double>::infinity();

// Options with every field off its default, so a field read from another's
// place shows.
optim::Options odd_options() {
  optim::Options o;
  o.lr = 0.25;
  o.weight_decay = 0.125;
  o.momentum = 0.5;
  o.dampening = 0.0625;
  o.nesterov = true;
  o.beta1 = 0.8;
  o.beta2 = 0.9;
  o.eps = 1e-7;
  o.amsgrad = false;
  o.lr_decay = 0.03;
  o.initial_accumulator_value = 0.04;
  o.alpha = 0.7;
  o.centered = true;
  return o;
}

// A create request's arguments with `options` for its options and a list
// of no RRefs (every check before params' comes first).
std::vector<c10::IValue> create_args(int64_t kind, c10::IValue options) {
  return {c10::IValue(int64_t(7)), c10::IValue(kind), std::move(options),
          rpc::to_ivalue(std::vector<int64_t>{}), c10::IValue(std::string())};
}

std::vector<double> good_numbers() {
  CreateRequest m;
  m.options = odd_options();
  return m.encode()[2].toDoubleVector();
}

at::Tensor scalar(double v, at::ScalarType dtype = at::kDouble) {
  return at::scalar_tensor(v, at::TensorOptions().dtype(dtype));
}

}  // namespace

TEST_CASE("optim protocol: create carries every option by name, in the order it always had") {
  World w(1);
  const at::Tensor t = at::zeros({2}).requires_grad_();
  {
    CreateRequest m{(int64_t(3) << 40) | 5,
                    optim::Kind::kRMSprop,
                    odd_options(),
                    {rpc::RRef<at::Tensor>::make_local(w[0], t)},
                    "mesh#1/dp"};
    const std::vector<c10::IValue> args = m.encode();
    REQUIRE(args.size() == 5);
    // The wire: (int id, int kind, 13 floats, RRef list, str shard_group),
    // flags as 0 or 1.
    CHECK(args[4].toStringRef() == "mesh#1/dp");
    CHECK(args[0].toInt() == m.id);
    CHECK(args[1].toInt() == 4);
    CHECK((args[2].toDoubleVector() == std::vector<double>{0.25, 0.125, 0.5, 0.0625, 1, 0.8, 0.9,
                                                           1e-7, 0, 0.03, 0.04, 0.7, 1}));
    const CreateRequest back = CreateRequest::decode(args);
    CHECK(back.id == m.id);
    CHECK(back.kind == optim::Kind::kRMSprop);
    const optim::Options& o = back.options;
    CHECK(o.lr == 0.25);
    CHECK(o.weight_decay == 0.125);
    CHECK(o.momentum == 0.5);
    CHECK(o.dampening == 0.0625);
    CHECK(o.nesterov);
    CHECK(o.beta1 == 0.8);
    CHECK(o.beta2 == 0.9);
    CHECK(o.eps == 1e-7);
    CHECK_FALSE(o.amsgrad);
    CHECK(o.lr_decay == 0.03);
    CHECK(o.initial_accumulator_value == 0.04);
    CHECK(o.alpha == 0.7);
    CHECK(o.centered);
    REQUIRE(back.params.size() == 1);
    CHECK(back.params[0].local_value().is_same(t));
    CHECK(back.shard_group == "mesh#1/dp");
    // The kinds' defaults (negative eps and weight_decay) travel as they are.
    const CreateRequest d = CreateRequest::decode(
        CreateRequest{1, optim::Kind::kSGD, optim::Options{}, m.params, ""}.encode());
    CHECK(d.options.eps == -1);
    CHECK(d.options.weight_decay == -1);
  }  // every handle to the RRef gone
  w.shutdown();
}

TEST_CASE("optim protocol: a create with a wrong count, kind, options or params is refused") {
  auto refused = [](const std::vector<c10::IValue>& args, const char* text) {
    CHECK_THROWS_WITH_AS(CreateRequest::decode(args), doctest::Contains(text),
                         std::invalid_argument);
  };
  const c10::IValue good = rpc::to_ivalue(good_numbers());
  // Short and long messages.
  refused({c10::IValue(int64_t(1))}, "'tandem.optim.create' takes 5 argument(s), got 1");
  auto six = create_args(0, good);
  six.emplace_back(int64_t(0));
  refused(six, "'tandem.optim.create' takes 5 argument(s), got 6");
  // Each field's type.
  auto args = create_args(0, good);
  args[0] = c10::IValue("seven");
  refused(args, "tandem.optim.create: id: expected int, got String");
  refused(create_args(0, c10::IValue(int64_t(3))),
          "tandem.optim.create: options: expected list, got Int");
  args = create_args(0, good);
  args[3] = rpc::to_ivalue(std::vector<int64_t>{1});
  refused(args, "tandem.optim.create: params[0]: expected RRef, got Int");
  args = create_args(0, good);
  args[4] = c10::IValue(int64_t(3));
  refused(args, "tandem.optim.create: shard_group: expected str");
  // Kinds.
  refused(create_args(5, good), "tandem.optim.create: kind: unknown optimizer kind 5");
  refused(create_args(-1, good), "tandem.optim.create: kind: unknown optimizer kind -1");
  // Options: 13 numbers, a flag 0 or 1.
  std::vector<double> numbers = good_numbers();
  numbers.pop_back();
  refused(create_args(0, rpc::to_ivalue(numbers)),
          "tandem.optim.create: options: expected 13 numbers, got 12");
  numbers = good_numbers();
  numbers.push_back(0);
  refused(create_args(0, rpc::to_ivalue(numbers)),
          "tandem.optim.create: options: expected 13 numbers, got 14");
  refused(create_args(0, rpc::to_ivalue(std::vector<double>{})),
          "tandem.optim.create: options: expected 13 numbers, got 0");
  const std::pair<size_t, const char*> flags[] = {
      {4, "options.nesterov"}, {8, "options.amsgrad"}, {12, "options.centered"}};
  for (const auto& [at, name] : flags) {
    CAPTURE(name);
    for (double lie : {0.5, -1.0, 2.0, kNaN}) {
      CAPTURE(lie);
      numbers = good_numbers();
      numbers[at] = lie;
      CHECK_THROWS_WITH_AS(
          CreateRequest::decode(create_args(0, rpc::to_ivalue(numbers))),
          doctest::Contains((std::string("tandem.optim.create: ") + name + ": ").c_str()),
          std::invalid_argument);
    }
  }
  numbers = good_numbers();
  numbers[4] = 0.5;
  refused(create_args(0, rpc::to_ivalue(numbers)), "options.nesterov: 0.5, not 0 or 1");
  // Values are make_optimizer's to judge, as for the caller's own part: a
  // NaN or negative number where a kind's optimizer takes none still
  // decodes (and LibTorch refuses it there).
  numbers = good_numbers();
  numbers[0] = kNaN;
  numbers[11] = -3;
  refused(create_args(0, rpc::to_ivalue(numbers)), "params: none");  // got past the options
  // At least one parameter.
  refused(create_args(0, good), "tandem.optim.create: params: none");
}

TEST_CASE(
    "optim protocol: step, destroy, state, set_lr, grad_norms, scale_grads and load round-trip") {
  const uint64_t big_context = (uint64_t(1) << 63) | 9;  // the top bit set: negative on the wire
  StepRequest step = StepRequest::decode(StepRequest{11, big_context}.encode());
  CHECK(step.id == 11);
  CHECK(step.context_id == big_context);
  CHECK(StepRequest{11, 3}.encode()[1].toInt() == 3);

  CHECK(IdRequest::decode(IdRequest{12}.encode(), kDestroy).id == 12);
  CHECK(IdRequest::decode(IdRequest{13}.encode(), kState).id == 13);

  for (double lr : {0.0, 1e-4, 10.0}) {
    SetLrRequest m = SetLrRequest::decode(SetLrRequest{14, lr}.encode());
    CHECK(m.id == 14);
    CHECK(m.lr == lr);
  }

  for (double norm_type : {0.0, 1.0, 2.0, 3.5, kInf}) {
    GradNormsRequest m = GradNormsRequest::decode(GradNormsRequest{15, 4, norm_type}.encode());
    CHECK(m.id == 15);
    CHECK(m.context_id == 4);
    CHECK(m.norm_type == norm_type);
  }

  for (double coef : {0.0, 0.5, 0.999999}) {
    ScaleGradsRequest m = ScaleGradsRequest::decode(ScaleGradsRequest{16, 5, coef}.encode());
    CHECK(m.id == 16);
    CHECK(m.context_id == 5);
    CHECK(m.coef == coef);
  }

  const std::string bytes("an\0archive\xff", 11);
  LoadRequest load = LoadRequest::decode(LoadRequest{17, bytes, 0.5}.encode());
  CHECK(load.id == 17);
  CHECK(load.bytes == bytes);
  CHECK(load.lr == 0.5);

  CHECK(StateReply::decode(StateReply{bytes}.encode(), "worker1").bytes == bytes);

  // Norms: None for no gradient; NaN and infinity are norms too.
  GradNormsReply reply{
      {c10::nullopt, scalar(0.5), scalar(kNaN, at::kFloat), scalar(kInf), scalar(0)}};
  GradNormsReply back = GradNormsReply::decode(reply.encode(), 5, "worker1");
  REQUIRE(back.norms.size() == 5);
  CHECK_FALSE(back.norms[0]);
  CHECK(back.norms[1]->item<double>() == 0.5);
  CHECK(std::isnan(back.norms[2]->item<double>()));
  CHECK((back.norms[2]->scalar_type() == at::kFloat));
  CHECK(back.norms[3]->item<double>() == kInf);
  CHECK(back.norms[4]->item<double>() == 0);
  CHECK(GradNormsReply::decode(GradNormsReply{}.encode(), 0, "worker1").norms.empty());
}

TEST_CASE("optim protocol: lying requests are refused, naming the function and the field") {
  auto refused = [](auto decode, const std::vector<c10::IValue>& args, const char* text) {
    CHECK_THROWS_WITH_AS(decode(args), doctest::Contains(text), std::invalid_argument);
  };
  auto step = [](const std::vector<c10::IValue>& a) { return StepRequest::decode(a); };
  auto destroy = [](const std::vector<c10::IValue>& a) { return IdRequest::decode(a, kDestroy); };
  auto state = [](const std::vector<c10::IValue>& a) { return IdRequest::decode(a, kState); };
  auto set_lr = [](const std::vector<c10::IValue>& a) { return SetLrRequest::decode(a); };
  auto grad_norms = [](const std::vector<c10::IValue>& a) { return GradNormsRequest::decode(a); };
  auto scale = [](const std::vector<c10::IValue>& a) { return ScaleGradsRequest::decode(a); };
  auto load = [](const std::vector<c10::IValue>& a) { return LoadRequest::decode(a); };
  using V = std::vector<c10::IValue>;
  const c10::IValue id(int64_t(1)), ctx(int64_t(2));

  // Counts.
  refused(step, V{id}, "'tandem.optim.step' takes 2 argument(s), got 1");
  refused(step, V{id, ctx, ctx}, "'tandem.optim.step' takes 2 argument(s), got 3");
  refused(destroy, V{}, "'tandem.optim.destroy' takes 1 argument(s), got 0");
  refused(state, V{id, id}, "'tandem.optim.state' takes 1 argument(s), got 2");
  refused(set_lr, V{id}, "'tandem.optim.set_lr' takes 2 argument(s), got 1");
  refused(grad_norms, V{id, ctx}, "'tandem.optim.grad_norms' takes 3 argument(s), got 2");
  refused(scale, V{id, ctx, c10::IValue(0.5), c10::IValue(0.5)},
          "'tandem.optim.scale_grads' takes 3 argument(s), got 4");
  refused(load, V{id, c10::IValue("x")}, "'tandem.optim.load' takes 3 argument(s), got 2");

  // Types.
  refused(step, V{c10::IValue(1.5), ctx}, "tandem.optim.step: id: expected int, got Double");
  refused(step, V{id, c10::IValue("ctx")},
          "tandem.optim.step: context_id: expected int, got String");
  refused(destroy, V{c10::IValue()}, "tandem.optim.destroy: id: expected int, got None");
  refused(set_lr, V{id, c10::IValue("fast")},
          "tandem.optim.set_lr: lr: expected float, got String");
  refused(grad_norms, V{id, ctx, c10::IValue(true)},
          "tandem.optim.grad_norms: norm_type: expected float, got Bool");
  refused(scale, V{id, ctx, c10::IValue()},
          "tandem.optim.scale_grads: coef: expected float, got None");
  refused(load, V{id, c10::IValue(int64_t(3)), c10::IValue(0.5)},
          "tandem.optim.load: bytes: expected str, got Int");

  // Values no caller sends: context 0 (none), rates that are not finite
  // numbers >= 0, a norm type below 0, a factor outside [0, 1).
  const c10::IValue none_ctx(int64_t(0));
  refused(step, V{id, none_ctx}, "tandem.optim.step: context_id: 0 (no context)");
  refused(grad_norms, V{id, none_ctx, c10::IValue(2.0)},
          "tandem.optim.grad_norms: context_id: 0 (no context)");
  refused(scale, V{id, none_ctx, c10::IValue(0.5)},
          "tandem.optim.scale_grads: context_id: 0 (no context)");
  for (double lie : {-1.0, kNaN, kInf, -kInf}) {
    CAPTURE(lie);
    refused(set_lr, V{id, c10::IValue(lie)}, "tandem.optim.set_lr: lr: ");
    refused(load, V{id, c10::IValue("x"), c10::IValue(lie)}, "tandem.optim.load: lr: ");
  }
  refused(set_lr, V{id, c10::IValue(-1.0)}, "lr: -1, not a finite number >= 0");
  refused(load, V{id, c10::IValue("x"), c10::IValue(kNaN)}, "lr: nan, not a finite number >= 0");
  for (double lie : {-1.0, -kInf, kNaN}) {
    CAPTURE(lie);
    refused(grad_norms, V{id, ctx, c10::IValue(lie)}, "tandem.optim.grad_norms: norm_type: ");
  }
  refused(grad_norms, V{id, ctx, c10::IValue(-2.0)}, "norm_type: -2, not >= 0 (or infinity)");
  for (double lie : {1.0, 1.5, -0.25, kInf, kNaN}) {
    CAPTURE(lie);
    refused(scale, V{id, ctx, c10::IValue(lie)}, "tandem.optim.scale_grads: coef: ");
  }
  refused(scale, V{id, ctx, c10::IValue(1.0)}, "coef: 1, not in [0, 1)");
}

TEST_CASE("optim protocol: a lying gradient-norm answer is refused, naming the owner") {
  auto refused = [](const c10::IValue& answer, size_t n, const char* text) {
    CHECK_THROWS_WITH_AS(GradNormsReply::decode(answer, n, "worker1"), doctest::Contains(text),
                         std::runtime_error);
  };
  using Norms = std::vector<c10::optional<at::Tensor>>;
  auto answer = [](Norms norms) { return GradNormsReply{std::move(norms)}.encode(); };
  // The wrong type: as from_ivalue says it (std::invalid_argument).
  CHECK_THROWS_WITH_AS(GradNormsReply::decode(c10::IValue(int64_t(1)), 1, "worker1"),
                       doctest::Contains("the gradient norms from worker1: expected list, got Int"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      GradNormsReply::decode(rpc::to_ivalue(std::vector<std::string>{"x"}), 1, "worker1"),
      doctest::Contains("the gradient norms from worker1[0]: expected Tensor, got String"),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(StateReply::decode(c10::IValue(int64_t(1)), "worker1"),
                       doctest::Contains("the optimizer state from worker1: expected str, got Int"),
                       std::invalid_argument);
  // Too few, too many.
  refused(
      answer({scalar(1)}), 2,
      "DistributedOptimizer::clip_grad_norm: worker1 sent 1 gradient norms for its 2 parameters");
  refused(answer({scalar(1), c10::nullopt, scalar(2)}), 2,
          "worker1 sent 3 gradient norms for its 2 parameters");
  // Not one non-negative floating-point number on the CPU.
  refused(answer({c10::nullopt, at::ones({2})}), 2,
          "worker1's gradient norm 1 is of shape [2], not one number");
  refused(answer({at::ones({1, 1})}), 1, "worker1's gradient norm 0 is of shape [1, 1]");
  refused(answer({scalar(1, at::kLong)}), 1,
          "worker1's gradient norm 0 is of dtype Long, not floating point");
  refused(answer({scalar(-1)}), 1, "worker1's gradient norm 0 is -1");
  refused(answer({scalar(-kInf)}), 1, "worker1's gradient norm 0 is -inf");
}

TEST_CASE("optim protocol: an owner refuses a lying create or step and keeps serving") {
  World w(2, optim_support::define);
  optim_support::L().w = {at::zeros({1, 2}, optim_support::kF64).requires_grad_()};
  auto p = w[0].rpc_sync<rpc::RRef<at::Tensor>>("worker1", "param", int64_t(0));
  std::vector<rpc::RRef<at::Tensor>> params = {p};
  std::vector<double> numbers = good_numbers();
  numbers[8] = 3;  // amsgrad
  CHECK_THROWS_WITH_AS(
      w[0].rpc_sync("worker1", kCreate, int64_t(1), int64_t(1), numbers, params, std::string()),
      doctest::Contains("tandem.optim.create: options.amsgrad: 3, not 0 or 1"), rpc::RemoteError);
  CHECK_THROWS_WITH_AS(w[0].rpc_sync("worker1", kCreate, int64_t(1), int64_t(9), good_numbers(),
                                     params, std::string()),
                       doctest::Contains("tandem.optim.create: kind: unknown optimizer kind 9"),
                       rpc::RemoteError);
  CHECK(optim::live_optimizers(w[1]) == 0);
  CHECK_THROWS_WITH_AS(w[0].rpc_sync("worker1", kStep, int64_t(1), int64_t(0)),
                       doctest::Contains("tandem.optim.step: context_id: 0 (no context)"),
                       rpc::RemoteError);
  CHECK_THROWS_WITH_AS(w[0].rpc_sync("worker1", kSetLr, int64_t(1), std::nan("")),
                       doctest::Contains("tandem.optim.set_lr: lr: nan"), rpc::RemoteError);
  // It still serves: an optimizer made there steps its parameter.
  {
    optim::Options o;
    o.lr = 1.0;
    optim::DistributedOptimizer opt(w[0], optim::Kind::kSGD, params, o);
    autograd::Context ctx(w[0]);
    at::Tensor y = w[0].rpc_sync<at::Tensor>("worker1", "linear", int64_t(0),
                                             at::ones({1, 1}, optim_support::kF64));
    autograd::backward(w[0], ctx.id(), {y.sum()});
    opt.step(ctx.id());
  }
  CHECK(at::equal(optim_support::L().w[0], at::full({1, 2}, -1.0, optim_support::kF64)));
  CHECK(optim::live_optimizers(w[1]) == 0);
  p = rpc::RRef<at::Tensor>();
  params.clear();
  optim_support::L().w.clear();
  w.shutdown();
}
