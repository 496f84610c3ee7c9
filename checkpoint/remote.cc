// Parts written and read where the state lives (checkpoint/remote.h): the
// handlers every agent serves, on a RemoteModule's module (by its RRef) or
// on a DistributedOptimizer's optimizer (by its id on the owner), and the
// callers' side.
#include "tandem/checkpoint/remote.h"
#include "tandem/checkpoint/slices.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/StringUtil.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "tandem/optim/owner/service.h"
#include "tandem/remote_module/served.h"
#include "tandem/rpc/agent.h"
#include "tandem/rpc/extension.h"
#include "tandem/rpc/registry.h"

namespace tandem::checkpoint {
namespace {

std::shared_ptr<nn::Served> served(const c10::IValue& m, const std::string& what) {
  auto s = nn::served_of(m);
  if (!s) throw std::invalid_argument(what + ": not a RemoteModule's module");
  return s;
}

// The module's tensors under the names they are saved by: "<prefix>.<name>",
// the leading index shifted by `first_layer` when it is not negative (a
// stage of a Sequential cut into stages: "0.weight" of a stage whose first
// layer is the model's 3rd is "<prefix>.3.weight").
std::vector<std::pair<std::string, at::Tensor>> saved_names(const nn::Served& s,
                                                            const std::string& prefix,
                                                            int64_t first_layer) {
  nn::NamedTensors all = s.parameters();
  for (auto& b : s.buffers()) all.push_back(std::move(b));
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, t] : all) {
    std::string saved = name;
    if (first_layer >= 0) {
      const size_t dot = name.find('.');
      int64_t index = 0;
      try {
        index = std::stoll(name.substr(0, dot));
      } catch (const std::exception&) {
        throw std::invalid_argument("checkpoint: '" + name + "' of " + s.what +
                                    " has no leading layer index to shift by first_layer");
      }
      saved =
          std::to_string(index + first_layer) + (dot == std::string::npos ? "" : name.substr(dot));
    }
    out.emplace_back(prefix + "." + saved, t);
  }
  return out;
}

class PartService final : public rpc::AgentExtension {
 public:
  explicit PartService(rpc::Agent& agent) : agent_(agent) {}
  ~PartService() override { close(); }

  void register_handlers(rpc::Registry& internal) override {
    // The copies are made in the call (the caller's step); the writes go
    // on on threads of their own, collected by "written".
    internal.def("tandem.checkpoint.copy_module", [this](c10::IValue m, std::string dir,
                                                         int64_t step, int64_t part,
                                                         std::string prefix, int64_t first_layer) {
      auto s = served(m, "checkpoint: saving '" + prefix + "'");
      auto mine = std::make_shared<Part>();  // copies now
      // (between this worker's optimizer steps, which update
      // the parameters in place: one moment's values)
      const int64_t moment = optim::owner::OptimService::of(agent_)->between_steps([&] {
        for (const auto& [name, t] : saved_names(*s, prefix, first_layer)) {
          add_tensor(*mine, name, t);  // (a piece as slices of the whole)
        }
      });
      return std::make_tuple(start_write(dir, step, part, [mine] { return std::move(*mine); }),
                             moment);
    });
    internal.def("tandem.checkpoint.copy_optimizer", [this](int64_t id, std::string dir,
                                                            int64_t step, int64_t part,
                                                            std::string prefix,
                                                            std::vector<std::string> names) {
      // The state copied now; made into bytes on the writer's thread.
      // A piece of a larger parameter (placement.h) is written as
      // slices of the whole one's state, the piece that starts
      // the split dimension recording its shape.
      // Each snapshot's entry name, in the order they are made.
      auto entries = std::make_shared<std::vector<std::string>>();
      auto shapes = std::make_shared<std::vector<std::pair<std::string, std::string>>>();
      using Ranges = std::vector<std::pair<int64_t, int64_t>>;
      auto copies = std::make_shared<std::vector<optim::owner::OptimService::CutSnapshot>>();
      auto service = optim::owner::OptimService::of(agent_);
      // (between steps too: of the same moment as the module's copy, or told apart)
      const int64_t moment = service->between_steps([&] {
        *copies = service->param_state_snapshots(
            id, [&](size_t i, const at::Tensor& p) -> std::optional<Ranges> {
              const std::string name = prefix + "/" + names.at(i);  // (a bad name fails here)
              std::string shape;
              const auto cuts = piece_cuts(name, p, &shape);
              if (cuts.empty()) return std::nullopt;  // (another copy's)
              Ranges ranges;
              for (const PieceCut& c : cuts) {
                entries->push_back(c.entry);
                if (c.numel >= 0) ranges.emplace_back(c.start, c.numel);
              }
              if (!shape.empty()) shapes->emplace_back(shape_name(name), shape);
              return ranges;
            });
      });
      return std::make_tuple(start_write(dir, step, part,
                                         [copies, entries, shapes] {
                                           Part mine;
                                           for (size_t k = 0; k < copies->size(); ++k) {
                                             mine.add_bytes(entries->at(k), (*copies)[k].make());
                                           }
                                           for (const auto& [name, text] : *shapes) {
                                             mine.add_bytes(name, text);
                                           }
                                           return mine;
                                         }),
                             moment);
    });
    // The part's index once durable (else its error): by a module's RRef,
    // or by the owner's name.
    internal.def("tandem.checkpoint.written",
                 [this](c10::IValue, std::string key) { return written(key); });
    internal.def("tandem.checkpoint.written_at", [this](std::string key) { return written(key); });

    internal.def("tandem.checkpoint.load_module", [this](c10::IValue m, std::string path,
                                                         std::string prefix, int64_t first_layer,
                                                         bool check_only) {
      auto s = served(m, "checkpoint: loading '" + prefix + "'");
      Reader reader(path);
      const Slices slices(reader);  // (whole, or in an FSDP job's slices)
      const auto mine = saved_names(*s, prefix, first_layer);
      std::string problems;
      auto problem = [&](const std::string& p) { problems += (problems.empty() ? "" : "; ") + p; };
      for (const auto& [name, t] : mine) {
        if (!slices.contains(name) && t.numel() > 0) {
          problem(name + " is missing");
        } else if (const std::string p = slices.tensor_problem(name, saved_shape(t)); !p.empty()) {
          problem(p);
        }
      }
      std::vector<at::Tensor> values;
      if (problems.empty()) {
        for (const auto& [name, t] : mine) values.push_back(read_tensor(slices, name, t));
      }
      if (!problems.empty()) {
        throw std::invalid_argument("checkpoint " + path + " cannot load into " + s->what + " '" +
                                    prefix + "': " + problems);
      }
      if (check_only) return;
      at::NoGradGuard no_grad;
      optim::owner::OptimService::of(agent_)->between_steps([&] {
        for (size_t i = 0; i < mine.size(); ++i) mine[i].second.copy_(values[i]);
      });
    });
    internal.def("tandem.checkpoint.load_optimizer",
                 [this](int64_t id, std::string path, std::string prefix,
                        std::vector<std::string> names, bool check_only, double lr) {
                   Reader reader(path);
                   const Slices slices(reader);  // (whole, or in an FSDP job's slices)
                   auto service = optim::owner::OptimService::of(agent_);
                   const auto [kind, shapes] = service->layout(id);
                   const std::vector<at::Tensor> params = service->params(id);
                   std::string missing;
                   for (size_t i : service->held_params(id)) {
                     const std::string name = prefix + "/" + names.at(i);
                     if (!slices.contains(name) && c10::multiply_integers(shapes.at(i)) > 0) {
                       missing += (missing.empty() ? "" : ", ") + name;
                     }
                   }
                   if (!missing.empty()) {
                     throw std::invalid_argument("checkpoint " + path + " holds no " + missing +
                                                 " (the optimizer state of " + agent_.name() + ")");
                   }
                   // A parameter of no elements the step has nothing of keeps
                   // its optimizer's own state (Adagrad's must never be missing).
                   const auto bytes_of = [&, kind = kind](size_t i) -> std::optional<std::string> {
                     const std::string name = prefix + "/" + names.at(i);
                     if (!slices.contains(name)) return std::nullopt;
                     return read_state(slices, kind, name, params.at(i));
                   };
                   try {
                     if (check_only) {
                       service->check_param_states(id, bytes_of);
                     } else {
                       service->load_param_states(id, bytes_of, lr);
                     }
                   } catch (const std::invalid_argument& e) {
                     throw std::invalid_argument("checkpoint " + path +
                                                 ", the optimizer state of " + agent_.name() +
                                                 ": " + e.what());
                   }
                 });
  }

  void before_send(rpc::Message&, int) override {}
  void after_encode(const rpc::Message&, rpc::OutFrame&, int) override {}
  void after_receive(rpc::Message&, int) override {}
  // Parts still being written (one written but not collected, its caller
  // gone, is let go at close).
  std::vector<std::string> live_objects() const override {
    std::lock_guard<std::mutex> lock(mu_);
    size_t writing = 0;
    for (const auto& [key, w] : writes_) writing += w.promise.done() ? 0 : 1;
    if (writing == 0) return {};
    return {std::to_string(writing) + " checkpoint part(s) still being written"};
  }
  // A part being written is finished, not cut.
  void close() override {
    std::vector<std::shared_future<void>> threads;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      writes_.clear();
      threads.swap(threads_);
    }
    for (auto& t : threads) t.wait();
  }

 private:
  struct Write {
    rpc::Promise<std::string> promise;  // the part's index, or its error
  };

  // Writes `make()` as `part` of `dir`'s step on a thread of its own;
  // answers the key that written() finds it by.
  std::string start_write(const std::string& dir, int64_t step, int64_t part,
                          std::function<Part()> make) {
    const std::string key = dir + "\n" + std::to_string(step) + "\n" + std::to_string(part);
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw std::runtime_error("checkpoint: " + agent_.name() + " is shutting down");
    auto it = writes_.find(key);
    if (it != writes_.end() && !it->second.promise.done()) {
      throw std::invalid_argument("checkpoint: part " + std::to_string(part) + " of step " +
                                  std::to_string(step) + " is being written already");
    }
    // (one done but never collected, its caller gone, is replaced)
    Write& w = writes_[key];
    w = Write{};
    rpc::Promise<std::string> promise = w.promise;
    threads_.erase(std::remove_if(threads_.begin(), threads_.end(),
                                  [](const std::shared_future<void>& t) {
                                    return t.wait_for(std::chrono::seconds(0)) ==
                                           std::future_status::ready;
                                  }),
                   threads_.end());
    threads_.push_back(std::async(std::launch::async, [dir, step, part, make = std::move(make),
                                                       promise]() mutable {
                         try {
                           promise.set_value(write_part(dir, step, static_cast<int>(part), make()));
                         } catch (...) {
                           promise.set_error(std::current_exception());
                         }
                       }).share());
    return key;
  }

  // Answers once the part is durable, without holding a worker thread.
  rpc::Future<std::string> written(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = writes_.find(key);
    if (it == writes_.end()) {
      throw std::invalid_argument("checkpoint: no part being written for this key");
    }
    rpc::Future<std::string> out = it->second.promise.future();
    writes_.erase(it);
    return out;
  }

  rpc::Agent& agent_;
  mutable std::mutex mu_;
  bool closed_ = false;
  std::map<std::string, Write> writes_;
  std::vector<std::shared_future<void>> threads_;  // the writers, joined at close
};

const bool kRegistered = [] {
  rpc::register_agent_extension(
      [](rpc::Agent& agent) { return std::make_shared<PartService>(agent); });
  return true;
}();

// What a copy answers: its write's key (for "written"), and the moment of
// the copy on its worker (OptimService::between_steps).
using KeyAndMoment = std::tuple<std::string, int64_t>;

// The names of an owner's parameters, in its order.
std::vector<std::string> names_of(const optim::DistributedOptimizer::OwnerPart& part,
                                  const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (size_t i : part.index) out.push_back(names.at(i));
  return out;
}

}  // namespace

RemotePart save_module_part(const nn::RemoteModule& m, const std::string& dir, int64_t step,
                            int part, const std::string& prefix, int64_t first_layer) {
  (void)kRegistered;
  const rpc::RRef<c10::IValue> module = m.get_module_rref();
  auto key = std::make_shared<rpc::Future<KeyAndMoment>>(module.rpc_async<KeyAndMoment>(
      "tandem.checkpoint.copy_module", dir, step, static_cast<int64_t>(part), prefix, first_layer));
  // (a large part on slow storage may take longer than any call's timeout)
  return {[key] { key->wait(); },
          [module, key] {
            return module.rpc_sync<std::string>(rpc::CallOptions{rpc::kNoTimeout},
                                                "tandem.checkpoint.written",
                                                std::get<0>(key->wait()));
          },
          module.owner_name(), [key] { return std::get<1>(key->wait()); }};
}

RemotePartWriter module_writer(const nn::RemoteModule& m, const std::string& prefix,
                               int64_t first_layer) {
  const nn::RemoteModule module(m.get_module_rref());  // (by value: it may outlive `m`)
  return [module, prefix, first_layer](const std::string& dir, int64_t step, int part) {
    return save_module_part(module, dir, step, part, prefix, first_layer);
  };
}

void load_module_part(const nn::RemoteModule& m, const std::string& path, const std::string& prefix,
                      int64_t first_layer, bool check_only) {
  m.get_module_rref().rpc_sync<void>(rpc::CallOptions{rpc::kNoTimeout},
                                     "tandem.checkpoint.load_module", path, prefix, first_layer,
                                     check_only);
}

std::vector<RemotePartWriter> optimizer_writers(const optim::DistributedOptimizer& opt,
                                                const std::vector<std::string>& names,
                                                const std::string& prefix) {
  (void)kRegistered;
  size_t params = 0;
  for (const auto& part : opt.owner_parts()) params += part.index.size();
  if (names.size() != params) {
    throw std::invalid_argument("checkpoint: " + std::to_string(names.size()) +
                                " names for the optimizer '" + prefix + "''s parameters");
  }
  std::vector<RemotePartWriter> out;
  std::weak_ptr<rpc::Agent> weak = opt.agent();
  for (const auto& part : opt.owner_parts()) {
    const std::string owner = opt.agent()->get_worker_info(part.owner).name;
    const std::vector<std::string> mine = names_of(part, names);
    const int64_t id = part.id;
    out.push_back([weak, owner, id, mine, prefix](const std::string& dir, int64_t step, int n) {
      auto a = weak.lock();
      if (!a) throw std::runtime_error("checkpoint: the optimizer's agent is gone");
      auto key = std::make_shared<rpc::Future<KeyAndMoment>>(
          a->rpc_async<KeyAndMoment>(owner, "tandem.checkpoint.copy_optimizer", id, dir, step,
                                     static_cast<int64_t>(n), prefix, mine));
      return RemotePart{[key] { key->wait(); },
                        [weak, owner, key] {
                          auto b = weak.lock();
                          if (!b)
                            throw std::runtime_error("checkpoint: the optimizer's agent is gone");
                          return b->rpc_sync<std::string>(rpc::CallOptions{rpc::kNoTimeout}, owner,
                                                          "tandem.checkpoint.written_at",
                                                          std::get<0>(key->wait()));
                        },
                        owner, [key] { return std::get<1>(key->wait()); }};
    });
  }
  return out;
}

void load_optimizer_parts(const optim::DistributedOptimizer& opt,
                          const std::vector<std::string>& names, const std::string& path,
                          const std::string& prefix, bool check_only) {
  auto agent = opt.agent();
  // Every owner checks (reads and decodes) its state before any loads.
  for (const bool check : check_only ? std::vector<bool>{true} : std::vector<bool>{true, false}) {
    std::vector<rpc::Future<void>> calls;
    for (const auto& part : opt.owner_parts()) {
      calls.push_back(agent->rpc_async<void>(rpc::CallOptions{rpc::kNoTimeout},
                                             agent->get_worker_info(part.owner).name,
                                             "tandem.checkpoint.load_optimizer", part.id, path,
                                             prefix, names_of(part, names), check, opt.lr()));
    }
    std::string first_error;
    for (auto& c : calls) {  // every owner's answer, even after an error
      try {
        c.wait();
      } catch (const std::exception& e) {
        if (first_error.empty()) first_error = e.what();
      }
    }
    if (!first_error.empty()) throw std::invalid_argument(first_error);
  }
}

}  // namespace tandem::checkpoint
