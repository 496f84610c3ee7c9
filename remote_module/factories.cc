// The built-in module factories: LibTorch's layers by their PyTorch names,
// with PyTorch's argument order and defaults, and Sequential of them.
//
//   Linear(in, out, bias=true)            Embedding(num, dim)
//   EmbeddingBag(num, dim, mode="mean")   Conv2d(in, out, kernel, stride=1, padding=0, bias=true)
//   LSTM / GRU(input, hidden, num_layers=1, bias=true, batch_first=false, dropout=0)
//   LayerNorm(shape (int or list), eps=1e-5, elementwise_affine=true)
//   Dropout(p=0.5)   ReLU()   Tanh()
//   Sequential([spec("Linear", {4, 8}), spec("ReLU"), ...])   (children "0", "1", ...)
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>

#include "tandem/remote_module/served.h"

namespace tandem::nn {
namespace {

// Argument i of a factory, or `def` when left out.
class ArgList {
 public:
  ArgList(const std::string& name, std::vector<c10::IValue>& args, size_t max)
      : name_(name), args_(args) {
    if (args.size() > max) {
      throw std::invalid_argument(name + " takes at most " + std::to_string(max) +
                                  " argument(s), got " + std::to_string(args.size()));
    }
  }
  template <class T>
  T get(size_t i, const char* what) const {
    if (i >= args_.size()) {
      throw std::invalid_argument(name_ + ": argument " + std::to_string(i + 1) + " (" + what +
                                  ") is missing");
    }
    return rpc::from_ivalue<T>(args_[i],
                               name_ + " argument " + std::to_string(i + 1) + " (" + what + ")");
  }
  template <class T>
  T get(size_t i, const char* what, T def) const {
    return i < args_.size() ? get<T>(i, what) : def;
  }
  int64_t positive(size_t i, const char* what) const {
    auto v = get<int64_t>(i, what);
    if (v <= 0) {
      throw std::invalid_argument(name_ + ": " + what + " must be positive, got " +
                                  std::to_string(v));
    }
    return v;
  }

 private:
  std::string name_;
  std::vector<c10::IValue>& args_;
};

template <class M>
std::shared_ptr<Served> serve(M holder, const std::string& name) {
  auto module = holder.ptr();
  using Impl = typename M::ContainedType;
  return serve_module(module, name,
                      detail::bind_forward(module, &Impl::forward, "forward of " + name));
}

template <class Options, class Holder>
std::shared_ptr<Served> rnn(const std::string& name, std::vector<c10::IValue>& args) {
  ArgList a(name, args, 6);
  auto o = Options(a.positive(0, "input_size"), a.positive(1, "hidden_size"))
               .num_layers(a.get<int64_t>(2, "num_layers", 1))
               .bias(a.get<bool>(3, "bias", true))
               .batch_first(a.get<bool>(4, "batch_first", false))
               .dropout(a.get<double>(5, "dropout", 0.0));
  return serve(Holder(o), name);
}

const bool kBuiltIns = [] {
  register_factory("Linear", [](std::vector<c10::IValue>& args) {
    ArgList a("Linear", args, 3);
    return serve(torch::nn::Linear(torch::nn::LinearOptions(a.positive(0, "in_features"),
                                                            a.positive(1, "out_features"))
                                       .bias(a.get<bool>(2, "bias", true))),
                 "Linear");
  });
  register_factory("Embedding", [](std::vector<c10::IValue>& args) {
    ArgList a("Embedding", args, 2);
    return serve(
        torch::nn::Embedding(a.positive(0, "num_embeddings"), a.positive(1, "embedding_dim")),
        "Embedding");
  });
  register_factory("EmbeddingBag", [](std::vector<c10::IValue>& args) {
    ArgList a("EmbeddingBag", args, 3);
    const std::string mode = a.get<std::string>(2, "mode", "mean");
    torch::nn::EmbeddingBagOptions o(a.positive(0, "num_embeddings"),
                                     a.positive(1, "embedding_dim"));
    if (mode == "mean") {
      o.mode(torch::kMean);
    } else if (mode == "sum") {
      o.mode(torch::kSum);
    } else if (mode == "max") {
      o.mode(torch::kMax);
    } else {
      throw std::invalid_argument("EmbeddingBag: mode '" + mode + "' is not sum, mean or max");
    }
    return serve(torch::nn::EmbeddingBag(o), "EmbeddingBag");
  });
  register_factory("LSTM", [](std::vector<c10::IValue>& args) {
    return rnn<torch::nn::LSTMOptions, torch::nn::LSTM>("LSTM", args);
  });
  register_factory("GRU", [](std::vector<c10::IValue>& args) {
    return rnn<torch::nn::GRUOptions, torch::nn::GRU>("GRU", args);
  });
  register_factory("Conv2d", [](std::vector<c10::IValue>& args) {
    ArgList a("Conv2d", args, 6);
    auto o = torch::nn::Conv2dOptions(a.positive(0, "in_channels"), a.positive(1, "out_channels"),
                                      a.positive(2, "kernel_size"))
                 .stride(a.get<int64_t>(3, "stride", 1))
                 .padding(a.get<int64_t>(4, "padding", 0))
                 .bias(a.get<bool>(5, "bias", true));
    return serve(torch::nn::Conv2d(o), "Conv2d");
  });
  register_factory("LayerNorm", [](std::vector<c10::IValue>& args) {
    ArgList a("LayerNorm", args, 3);
    std::vector<int64_t> shape;
    if (!args.empty() && args[0].isInt()) {
      shape = {a.positive(0, "normalized_shape")};
    } else {
      shape = a.get<std::vector<int64_t>>(0, "normalized_shape");
    }
    auto o = torch::nn::LayerNormOptions(shape)
                 .eps(a.get<double>(1, "eps", 1e-5))
                 .elementwise_affine(a.get<bool>(2, "elementwise_affine", true));
    return serve(torch::nn::LayerNorm(o), "LayerNorm");
  });
  register_factory("Dropout", [](std::vector<c10::IValue>& args) {
    ArgList a("Dropout", args, 1);
    const double p = a.get<double>(0, "p", 0.5);
    if (p < 0 || p > 1)
      throw std::invalid_argument("Dropout: p must be in [0, 1], got " + std::to_string(p));
    return serve(torch::nn::Dropout(p), "Dropout");
  });
  register_factory("ReLU", [](std::vector<c10::IValue>& args) {
    ArgList("ReLU", args, 0);
    return serve(torch::nn::ReLU(), "ReLU");
  });
  register_factory("Tanh", [](std::vector<c10::IValue>& args) {
    ArgList("Tanh", args, 0);
    return serve(torch::nn::Tanh(), "Tanh");
  });
  register_factory("Sequential", [](std::vector<c10::IValue>& args) {
    ArgList a("Sequential", args, 1);
    auto specs = a.get<std::vector<std::tuple<std::string, c10::IValue>>>(0, "modules");
    auto parent = std::make_shared<torch::nn::Module>("Sequential");
    std::vector<std::shared_ptr<Served>> children;
    for (size_t i = 0; i < specs.size(); ++i) {
      auto& [name, child_args] = specs[i];
      if (!child_args.isList()) {
        throw std::invalid_argument("Sequential: the arguments of module " + std::to_string(i) +
                                    " (" + name + ") are not a list");
      }
      auto list = child_args.toList();
      std::vector<c10::IValue> items(list.begin(), list.end());
      auto child = make_module(name, items);
      if (!child->module) {
        throw std::invalid_argument("Sequential: module " + std::to_string(i) + " (" + name +
                                    ") is not a torch::nn module");
      }
      parent->register_module(std::to_string(i), child->module);
      children.push_back(std::move(child));
    }
    if (children.empty()) throw std::invalid_argument("Sequential: no modules");
    // Each child's output is the next one's only argument.
    return serve_module(parent, "Sequential", [children](std::vector<c10::IValue>& in) {
      c10::IValue x = children[0]->forward(in);
      for (size_t i = 1; i < children.size(); ++i) {
        std::vector<c10::IValue> one{std::move(x)};
        x = children[i]->forward(one);
      }
      return x;
    });
  });
  return true;
}();

}  // namespace
}  // namespace tandem::nn
