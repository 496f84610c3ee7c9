// JobState (checkpoint/job.h): each registered piece as a writer, a checker
// and a reader of named entries.
#include "tandem/checkpoint/job.h"

#include "tandem/checkpoint/remote.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <mutex>
#include <sstream>
#include <stdexcept>

#include "tandem/ddp/sampler.h"
#include "tandem/optim/lr_scheduler.h"
#include "tandem/optim/param_state.h"
#include "tandem/optim/zero_redundancy_optimizer.h"

namespace tandem::checkpoint {

namespace {

void need(const Reader& r, const std::string& name, const std::string& what) {
  if (!r.contains(name)) {
    throw std::invalid_argument("checkpoint: the step holds no '" + name + "' (" + what + ")");
  }
}

std::vector<std::pair<std::string, at::Tensor>> tensors_of(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters(true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers(true)) out.emplace_back(b.key(), b.value());
  return out;
}

// The GPUs this process sees (0 without CUDA).
int cuda_devices() {
  return at::hasCUDA() ? static_cast<int>(at::detail::getCUDAHooks().getNumGPUs()) : 0;
}

std::string state_name(const std::string& prefix, const std::string& param) {
  return prefix + "/" + param;
}

// A sampler's epoch and this rank's place in it among `replicas`, from the
// job's place (the indices every replica went through together).
// (An epoch gone through whole is "end": its padding differs among replica
// counts.)
std::pair<int64_t, size_t> sampler_place(const Reader& r, const std::string& name,
                                         const ddp::DistributedSampler& s) {
  need(r, name, "a sampler's epoch and position");
  const int replicas = s.num_replicas();
  std::istringstream in(r.bytes(name));
  long long epoch = -1;
  std::string token;
  if (!(in >> epoch >> token) || epoch < 0) {
    throw std::invalid_argument("checkpoint: '" + name + "' is not a sampler's position");
  }
  if (token == "end") return {epoch, s.num_samples()};
  unsigned long long done = 0;
  try {
    done = std::stoull(token);
  } catch (const std::exception&) {
    throw std::invalid_argument("checkpoint: '" + name + "' is not a sampler's position");
  }
  if (done % static_cast<unsigned long long>(replicas) != 0) {
    throw std::invalid_argument("checkpoint: '" + name + "': the job had gone through " +
                                std::to_string(done) + " indices of epoch " +
                                std::to_string(epoch) + ", which do not divide among " +
                                std::to_string(replicas) + " replicas");
  }
  return {epoch, static_cast<size_t>(done / static_cast<unsigned long long>(replicas))};
}

}  // namespace

JobState::JobState(int rank) : rank_(rank) {
  if (rank < 0) throw std::invalid_argument("checkpoint::JobState: a negative rank");
}

JobState& JobState::module(const std::string& prefix, torch::nn::Module& m, bool write) {
  torch::nn::Module* mod = &m;
  Item item;
  item.write = [prefix, mod, write](Part& p) {
    if (!write) return;
    for (const auto& [name, t] : tensors_of(*mod)) p.add(prefix + "." + name, t);
  };
  item.verify = [prefix, mod](const Reader& r) {
    for (const auto& [name, t] : tensors_of(*mod)) {
      const std::string entry = prefix + "." + name;
      need(r, entry, "a tensor of module '" + prefix + "'");
      const at::Tensor saved = r.tensor(entry);
      if (!saved.sizes().equals(t.sizes())) {
        throw std::invalid_argument("checkpoint: '" + entry + "' is " + c10::str(saved.sizes()) +
                                    " in the step, " + c10::str(t.sizes()) + " here");
      }
    }
  };
  item.read = [prefix, mod](const Reader& r) {
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : tensors_of(*mod)) t.copy_(r.tensor(prefix + "." + name));
  };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::optimizer(const std::string& prefix, torch::optim::Optimizer& opt,
                              std::vector<std::pair<std::string, at::Tensor>> params, bool write) {
  optim::kind_of(opt);  // (refuses one whose state is not per parameter, now)
  torch::optim::Optimizer* o = &opt;
  auto ps = std::make_shared<std::vector<std::pair<std::string, at::Tensor>>>(std::move(params));
  Item item;
  item.write = [prefix, o, ps, write](Part& p) {
    if (!write) return;
    for (const auto& [name, t] : *ps)
      p.add_bytes(state_name(prefix, name), optim::param_state_bytes(*o, t));
  };
  item.verify = [prefix, ps](const Reader& r) {
    for (const auto& [name, t] : *ps)
      need(r, state_name(prefix, name), "optimizer '" + prefix + "'");
  };
  item.read = [prefix, o, ps](const Reader& r) {
    for (const auto& [name, t] : *ps) {
      try {
        optim::load_param_state(*o, t, r.bytes(state_name(prefix, name)));
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("checkpoint: '" + state_name(prefix, name) + "': " + e.what());
      }
    }
  };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::optimizer(const std::string& prefix, optim::ZeroRedundancyOptimizer& z,
                              std::vector<std::string> names) {
  if (names.size() != z.params().size()) {
    throw std::invalid_argument("checkpoint::JobState::optimizer('" + prefix +
                                "'): " + std::to_string(names.size()) + " names for " +
                                std::to_string(z.params().size()) + " parameters");
  }
  optim::ZeroRedundancyOptimizer* zp = &z;
  auto ns = std::make_shared<std::vector<std::string>>(std::move(names));
  const int rank = rank_;
  Item item;
  item.write = [prefix, zp, ns, rank](Part& p) {
    torch::optim::Optimizer* local = zp->local_optimizer();
    for (size_t i : zp->share(zp->rank())) {
      p.add_bytes(state_name(prefix, (*ns)[i]),
                  local ? optim::param_state_bytes(*local, zp->params()[i]) : std::string());
    }
    if (rank == 0) {
      std::ostringstream lr;
      lr.precision(17);
      lr << zp->lr();
      p.add_bytes(prefix + "#lr", lr.str());
    }
  };
  item.verify = [prefix, zp, ns](const Reader& r) {
    for (size_t i : zp->share(zp->rank())) {
      need(r, state_name(prefix, (*ns)[i]), "optimizer '" + prefix + "'");
    }
  };
  item.read = [prefix, zp, ns](const Reader& r) {
    torch::optim::Optimizer* local = zp->local_optimizer();
    for (size_t i : zp->share(zp->rank())) {
      if (!local) break;
      try {
        optim::load_param_state(*local, zp->params()[i], r.bytes(state_name(prefix, (*ns)[i])));
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("checkpoint: '" + state_name(prefix, (*ns)[i]) +
                                    "': " + e.what());
      }
    }
    // (a plain optimizer's state carries no rate: the current one stays)
    if (r.contains(prefix + "#lr")) zp->set_lr(std::stod(r.bytes(prefix + "#lr")));
  };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::sampler(const std::string& name, ddp::DistributedSampler& s) {
  ddp::DistributedSampler* sp = &s;
  const int rank = rank_;
  Item item;
  item.write = [name, sp, rank](Part& p) {
    if (rank != 0) return;
    const uint64_t done =
        static_cast<uint64_t>(sp->position()) * static_cast<uint64_t>(sp->num_replicas());
    const bool whole = sp->position() >= sp->num_samples();
    p.add_bytes(name, std::to_string(sp->epoch()) + " " + (whole ? "end" : std::to_string(done)));
  };
  item.verify = [name, sp](const Reader& r) { sampler_place(r, name, *sp); };
  item.read = [name, sp](const Reader& r) {
    const auto [epoch, position] = sampler_place(r, name, *sp);
    sp->resume(epoch, position);
  };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::scheduler(const std::string& name, optim::LRScheduler& s) {
  optim::LRScheduler* sp = &s;
  const int rank = rank_;
  Item item;
  item.write = [name, sp, rank](Part& p) {
    if (rank != 0) return;
    std::ostringstream out;
    out.precision(17);
    out << sp->last_epoch() << " " << sp->base_lr();
    p.add_bytes(name, out.str());
  };
  item.verify = [name](const Reader& r) { need(r, name, "a learning-rate schedule"); };
  item.read = [name, sp](const Reader& r) {
    std::istringstream in(r.bytes(name));
    optim::LRScheduler::State st;
    if (!(in >> st.last_epoch >> st.base_lr)) {
      throw std::invalid_argument("checkpoint: '" + name + "' is not a schedule's state");
    }
    sp->load_state(st);
  };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::random(const std::string& name) {
  const std::string mine = name + "/" + std::to_string(rank_);
  Item item;
  item.write = [mine](Part& p) {
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      p.add(mine, gen.get_state());
    }
    // Each visible GPU's generator too: "<name>/<rank>/cuda<i>".
    for (int i = 0; i < cuda_devices(); ++i) {
      at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i));
      std::lock_guard<std::mutex> lock(gen.mutex());
      p.add(mine + "/cuda" + std::to_string(i), gen.get_state());
    }
  };
  item.verify = [](const Reader&) {};
  item.read = [mine](const Reader& r) {
    // (a rank, or a GPU, the step had none for keeps its own)
    if (r.contains(mine)) {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(r.tensor(mine));
    }
    for (int i = 0; i < cuda_devices(); ++i) {
      const std::string cuda = mine + "/cuda" + std::to_string(i);
      if (!r.contains(cuda)) continue;
      at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i));
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(r.tensor(cuda));
    }
  };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::record(const std::string& name, std::string* bytes) {
  const int rank = rank_;
  Item item;
  item.write = [name, bytes, rank](Part& p) {
    if (rank == 0) p.add_bytes(name, *bytes);
  };
  item.verify = [name](const Reader& r) { need(r, name, "a record"); };
  item.read = [name, bytes](const Reader& r) { *bytes = r.bytes(name); };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::remote_module(const std::string& prefix, const nn::RemoteModule& m,
                                  int64_t first_layer, bool write) {
  Item item;
  item.write = [](Part&) {};
  item.verify = [&m, prefix, first_layer](const Reader& r) {
    load_module_part(m, r.path(), prefix, first_layer, true);
  };
  item.read = [&m, prefix, first_layer](const Reader& r) {
    load_module_part(m, r.path(), prefix, first_layer, false);
  };
  if (write) item.remote.push_back(module_writer(m, prefix, first_layer));
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::distributed_optimizer(const std::string& prefix,
                                          optim::DistributedOptimizer& opt,
                                          std::vector<std::string> names, bool write) {
  Item item;
  item.write = [](Part&) {};
  // (the writers check the names' count)
  std::vector<RemotePartWriter> writers = optimizer_writers(opt, names, prefix);
  auto ns = std::make_shared<std::vector<std::string>>(std::move(names));
  optim::DistributedOptimizer* op = &opt;
  item.verify = [op, ns, prefix](const Reader& r) {
    load_optimizer_parts(*op, *ns, r.path(), prefix, true);
  };
  item.read = [op, ns, prefix](const Reader& r) {
    load_optimizer_parts(*op, *ns, r.path(), prefix, false);
  };
  if (write) item.remote = std::move(writers);
  items_.push_back(std::move(item));
  return *this;
}

Part JobState::part() const {
  Part p;
  for (const auto& item : items_) item.write(p);
  return p;
}

std::vector<RemotePartWriter> JobState::remote_writers() const {
  std::vector<RemotePartWriter> out;
  for (const auto& item : items_) {
    out.insert(out.end(), item.remote.begin(), item.remote.end());
  }
  return out;
}

void JobState::load(const Reader& reader) {
  for (const auto& item : items_) item.verify(reader);
  for (const auto& item : items_) item.read(reader);
}

void save_job(const std::string& dir, int64_t step, const JobState& state,
              const SaveOptions& options) {
  save_parts(dir, step, state.part(), state.remote_writers(), options);
}

std::optional<int64_t> load_latest_job(const std::string& dir, JobState& state) {
  const std::optional<Found> found = latest(dir);
  if (!found) return std::nullopt;
  Reader reader(found->path);
  state.load(reader);
  return reader.step();
}

}  // namespace tandem::checkpoint
