#include "tandem/optim/owner/protocol.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "tandem/rpc/convert.h"

namespace tandem::optim::owner {
namespace {

// A number for a message ("-1", "nan", "0.001").
std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// Options on the wire: each field in this order, a flag as 0 or 1. A field
// added to Options goes here too (and makes the list one longer).
struct OptionField {
  const char* name;
  double Options::*number;  // or, for a flag,
  bool Options::*flag;
};
constexpr OptionField kOptionFields[] = {
    {"lr", &Options::lr, nullptr},
    {"weight_decay", &Options::weight_decay, nullptr},
    {"momentum", &Options::momentum, nullptr},
    {"dampening", &Options::dampening, nullptr},
    {"nesterov", nullptr, &Options::nesterov},
    {"beta1", &Options::beta1, nullptr},
    {"beta2", &Options::beta2, nullptr},
    {"eps", &Options::eps, nullptr},
    {"amsgrad", nullptr, &Options::amsgrad},
    {"lr_decay", &Options::lr_decay, nullptr},
    {"initial_accumulator_value", &Options::initial_accumulator_value, nullptr},
    {"alpha", &Options::alpha, nullptr},
    {"centered", nullptr, &Options::centered},
};
constexpr size_t kNumOptionFields = sizeof(kOptionFields) / sizeof(kOptionFields[0]);

// A request's arguments, read by field name: each error names the function
// and the field.
class Fields {
 public:
  Fields(const std::vector<c10::IValue>& args, const char* function, size_t count)
      : args_(args), function_(function) {
    if (args.size() != count) {
      throw std::invalid_argument("'" + function_ + "' takes " + std::to_string(count) +
                                  " argument(s), got " + std::to_string(args.size()));
    }
  }

  template <class T>
  T get(size_t i, const std::string& field) const {
    return rpc::from_ivalue<T>(args_[i], function_ + ": " + field);
  }

  // An autograd context: any 64 bits (an int on the wire) but 0, which is
  // no context.
  uint64_t context(size_t i) const {
    const auto id = get<int64_t>(i, "context_id");
    if (id == 0) bad("context_id", "0 (no context)");
    return static_cast<uint64_t>(id);
  }

  // A learning rate, as DistributedOptimizer::set_lr takes one.
  double rate(size_t i, const std::string& field) const {
    const auto lr = get<double>(i, field);
    if (!(lr >= 0) || std::isinf(lr)) bad(field, number(lr) + ", not a finite number >= 0");
    return lr;
  }

  [[noreturn]] void bad(const std::string& field, const std::string& why) const {
    throw std::invalid_argument(function_ + ": " + field + ": " + why);
  }

 private:
  const std::vector<c10::IValue>& args_;
  const std::string function_;
};

// A gradient-norm answer's contents that do not fit: the owner is broken.
[[noreturn]] void bad_norms(const std::string& why) {
  throw std::runtime_error("DistributedOptimizer::clip_grad_norm: " + why);
}

}  // namespace

std::vector<c10::IValue> CreateRequest::encode() const {
  std::vector<double> numbers;
  numbers.reserve(kNumOptionFields);
  for (const auto& f : kOptionFields) {
    numbers.push_back(f.flag ? (options.*f.flag ? 1.0 : 0.0) : options.*f.number);
  }
  return rpc::to_ivalues(id, static_cast<int64_t>(kind), numbers, params, shard_group);
}

CreateRequest CreateRequest::decode(const std::vector<c10::IValue>& args) {
  Fields in(args, kCreate, 5);
  CreateRequest m;
  m.id = in.get<int64_t>(0, "id");
  const auto kind = in.get<int64_t>(1, "kind");
  if (auto k = kind_from_number(kind)) {
    m.kind = *k;
  } else {
    in.bad("kind", "unknown optimizer kind " + std::to_string(kind));
  }
  // The values themselves are make_optimizer's to check (LibTorch refuses
  // what its optimizer of the kind cannot take), as for the caller's own
  // part, which never travels: what is checked here is that each field is
  // where it belongs.
  const auto numbers = in.get<std::vector<double>>(2, "options");
  if (numbers.size() != kNumOptionFields) {
    in.bad("options", "expected " + std::to_string(kNumOptionFields) + " numbers, got " +
                          std::to_string(numbers.size()));
  }
  for (size_t i = 0; i < kNumOptionFields; ++i) {
    const OptionField& f = kOptionFields[i];
    if (!f.flag) {
      m.options.*f.number = numbers[i];
    } else if (numbers[i] == 0 || numbers[i] == 1) {
      m.options.*f.flag = numbers[i] == 1;
    } else {
      in.bad(std::string("options.") + f.name, number(numbers[i]) + ", not 0 or 1");
    }
  }
  m.params = in.get<std::vector<rpc::RRef<at::Tensor>>>(3, "params");
  m.shard_group = in.get<std::string>(4, "shard_group");
  if (m.params.empty()) in.bad("params", "none (an owner steps at least one)");
  return m;
}

std::vector<c10::IValue> StepRequest::encode() const {
  return rpc::to_ivalues(id, static_cast<int64_t>(context_id));
}

StepRequest StepRequest::decode(const std::vector<c10::IValue>& args) {
  Fields in(args, kStep, 2);
  return {in.get<int64_t>(0, "id"), in.context(1)};
}

std::vector<c10::IValue> IdRequest::encode() const { return rpc::to_ivalues(id); }

IdRequest IdRequest::decode(const std::vector<c10::IValue>& args, const char* function) {
  Fields in(args, function, 1);
  return {in.get<int64_t>(0, "id")};
}

std::vector<c10::IValue> SetLrRequest::encode() const { return rpc::to_ivalues(id, lr); }

SetLrRequest SetLrRequest::decode(const std::vector<c10::IValue>& args) {
  Fields in(args, kSetLr, 2);
  return {in.get<int64_t>(0, "id"), in.rate(1, "lr")};
}

std::vector<c10::IValue> GradNormsRequest::encode() const {
  return rpc::to_ivalues(id, static_cast<int64_t>(context_id), norm_type);
}

GradNormsRequest GradNormsRequest::decode(const std::vector<c10::IValue>& args) {
  Fields in(args, kGradNorms, 3);
  GradNormsRequest m{in.get<int64_t>(0, "id"), in.context(1), in.get<double>(2, "norm_type")};
  if (!(m.norm_type >= 0)) {
    in.bad("norm_type", number(m.norm_type) + ", not >= 0 (or infinity)");
  }
  return m;
}

c10::IValue GradNormsReply::encode() const { return rpc::to_ivalue(norms); }

GradNormsReply GradNormsReply::decode(const c10::IValue& answer, size_t num_params,
                                      const std::string& from) {
  GradNormsReply m;
  m.norms = rpc::from_ivalue<std::vector<c10::optional<at::Tensor>>>(
      answer, "the gradient norms from " + from);
  if (m.norms.size() != num_params) {
    bad_norms(from + " sent " + std::to_string(m.norms.size()) + " gradient norms for its " +
              std::to_string(num_params) + " parameters");
  }
  for (size_t k = 0; k < m.norms.size(); ++k) {
    if (!m.norms[k]) continue;  // no gradient in the context
    const at::Tensor& n = *m.norms[k];
    const std::string which = from + "'s gradient norm " + std::to_string(k);
    if (!n.defined()) bad_norms(which + " is an undefined tensor");
    if (n.dim() != 0) {
      std::ostringstream shape;
      shape << n.sizes();
      bad_norms(which + " is of shape " + shape.str() + ", not one number");
    }
    if (!n.is_floating_point()) {
      bad_norms(which + " is of dtype " + std::string(c10::toString(n.scalar_type())) +
                ", not floating point");
    }
    if (!n.is_cpu()) bad_norms(which + " is on " + n.device().str() + ", not the CPU");
    // NaN and infinity are norms of gradients that hold them; no norm is
    // below 0.
    const double v = n.item<double>();
    if (v < 0) bad_norms(which + " is " + number(v));
  }
  return m;
}

std::vector<c10::IValue> ScaleGradsRequest::encode() const {
  return rpc::to_ivalues(id, static_cast<int64_t>(context_id), coef);
}

ScaleGradsRequest ScaleGradsRequest::decode(const std::vector<c10::IValue>& args) {
  Fields in(args, kScaleGrads, 3);
  ScaleGradsRequest m{in.get<int64_t>(0, "id"), in.context(1), in.get<double>(2, "coef")};
  if (!(m.coef >= 0 && m.coef < 1)) in.bad("coef", number(m.coef) + ", not in [0, 1)");
  return m;
}

c10::IValue StateReply::encode() const { return c10::IValue(bytes); }

StateReply StateReply::decode(const c10::IValue& answer, const std::string& from) {
  return {rpc::from_ivalue<std::string>(answer, "the optimizer state from " + from)};
}

std::vector<c10::IValue> LoadRequest::encode() const { return rpc::to_ivalues(id, bytes, lr); }

LoadRequest LoadRequest::decode(const std::vector<c10::IValue>& args) {
  Fields in(args, kLoad, 3);
  return {in.get<int64_t>(0, "id"), in.get<std::string>(1, "bytes"), in.rate(2, "lr")};
}

}  // namespace tandem::optim::owner
