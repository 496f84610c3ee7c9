// JobState (checkpoint/job.h): each registered piece as a writer, a checker
// and a reader of named entries.
#include "tandem/checkpoint/job.h"

#include "tandem/checkpoint/remote.h"
#include "tandem/checkpoint/slices.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/StringUtil.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "tandem/ddp/fully_sharded.h"
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

// Writes the optimizer state of parameter `t` under `name` as piece_cuts
// cuts it (a piece of a larger parameter's as slices of the whole one's),
// with its shape record: each state copied now, made into bytes where the
// part is written. Without an optimizer (a ZeRO rank whose share holds no
// state keeper), empty entries.
void add_state(Part& p, torch::optim::Optimizer* o, const std::string& name, const at::Tensor& t) {
  std::string shape;
  for (const PieceCut& c : piece_cuts(name, t, &shape)) {
    if (!o) {
      p.add_bytes(c.entry, "");
    } else {
      p.add_bytes_later(c.entry, c.numel < 0 ? optim::param_state_snapshot(*o, t)
                                             : optim::param_state_slice_snapshot(*o, t, c.start,
                                                                                 c.numel));
    }
  }
  if (!shape.empty()) p.add_bytes(shape_name(name), shape);
}

// A tensor the step must hold (whole or in slices) in `shape` (one of no
// elements needs nothing); every part it is read from checked.
void check_tensor(const Slices& r, const std::string& name, at::IntArrayRef shape,
                  const std::string& what) {
  if (!r.contains(name) && c10::multiply_integers(shape) > 0) need(r.reader(), name, what);
  if (const std::string p = r.tensor_problem(name, shape); !p.empty()) {
    throw std::invalid_argument("checkpoint: " + p);
  }
}

// The optimizer state of a parameter of `shape` the step must hold (whole or
// in slices; one of no elements needs nothing); every part it is read from
// checked.
void check_state(const Slices& r, const std::string& name, at::IntArrayRef shape,
                 const std::string& optimizer) {
  if (!r.contains(name) && c10::multiply_integers(shape) > 0) {
    need(r.reader(), name, "optimizer '" + optimizer + "'");
  }
  if (const std::string p = r.state_problem(name, shape); !p.empty()) {
    throw std::invalid_argument("checkpoint: " + p);
  }
}

// The optimizer state of parameter `name` (of `shape`) from the step, whole
// or joined from slices, decoded once to check it fits (so that a load
// refuses before it changes anything). None for a parameter of no
// elements the step has nothing of (its optimizer keeps what it has:
// Adagrad's state must never be missing).
std::optional<std::string> checked_state(const Slices& r, optim::Kind kind, const std::string& name,
                                         const at::Tensor& param, const std::string& optimizer) {
  check_state(r, name, saved_shape(param), optimizer);
  if (!r.contains(name)) return std::nullopt;
  try {
    std::string bytes = read_state(r, kind, name, param);
    optim::check_param_state(kind, param.sizes(), bytes);
    return bytes;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("checkpoint: '" + name + "': " + e.what());
  }
}

// Every parameter `m` holds under two names or more (LibTorch names a
// shared parameter once per module holding it; FSDP holds it once, under
// the first): (another name, the first).
std::vector<std::pair<std::string, std::string>> aliases_of(torch::nn::Module& m) {
  std::vector<std::pair<std::string, std::string>> out;
  std::map<const c10::TensorImpl*, std::string> first;
  for (const auto& p : m.named_parameters(true)) {
    auto [it, fresh] = first.emplace(p.value().unsafeGetTensorImpl(), p.key());
    if (!fresh) out.emplace_back(p.key(), it->second);
  }
  return out;
}

// Each piece of a parameter a rank's FSDP shard holds: fn(k, its name's
// index in the unit; its offset in the unit's flat buffer; [a, b) of the
// parameter's flattened elements; where they start in the shard).
void for_each_piece(const ddp::UnitShard& u,
                    const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) {
  const int64_t size = u.shard.numel();
  const int64_t lo = static_cast<int64_t>(u.rank) * size;
  int64_t offset = 0;
  for (size_t k = 0; k < u.names.size(); ++k) {
    const int64_t n = c10::multiply_integers(u.shapes[k]);
    const int64_t a = std::max(offset, lo), b = std::min(offset + n, lo + size);
    if (a < b) fn(k, a - offset, b - offset, a - lo);
    offset += n;
  }
}

// What a rank writes of an FSDP model (`name_of` makes a parameter's entry
// name): each piece its shards hold, by `piece(entry, shard index, its
// unit, where it starts in the shard, its elements)`, and beside them each
// parameter's shape (by the writer of its first elements); on rank 0 the
// other names of shared parameters. With HSDP only the first replica's
// ranks write pieces: the replicas hold the same shards. A parameter that
// is itself a tensor-parallel piece (placement.h) is written as slices of
// the whole one (the flat slices, or the parts of a block, its shard's
// share covers), and a replica's copy other than 0 not at all.
void write_fsdp(Part& p, ddp::FullyShardedDataParallel& f, int rank,
                const std::function<std::string(const std::string&)>& name_of,
                const std::function<void(const std::string&, size_t, const ddp::UnitShard&, int64_t,
                                         int64_t)>& piece) {
  if (!f.replicate_group() || f.replicate_group()->rank() == 0) {
    const std::vector<ddp::UnitShard> shards = f.shards();
    for (size_t s = 0; s < shards.size(); ++s) {
      const ddp::UnitShard& u = shards[s];
      for_each_piece(u, [&](size_t k, int64_t a, int64_t b, int64_t at) {
        const std::string name = name_of(u.names[k]);
        const at::Tensor& param = u.params.at(k);
        if (replica_of(param) > 0) return;  // (copy 0 writes it)
        const std::optional<Placement> placed = placement_of(param);
        if (!placed) {
          piece(slice_name(name, a, b), s, u, at, b - a);
          if (a == 0) p.add_bytes(shape_name(name), shape_text(u.shapes[k]));
          return;
        }
        for (const PieceEntry& e : piece_entries(*placed, a, b)) {
          piece(name + e.suffix, s, u, at + (e.piece_start - a), e.numel);
        }
        if (a == 0 && placed->ranges.front().first == 0) {
          p.add_bytes(shape_name(name), shape_text(placed->whole));
        }
      });
    }
  }
  if (rank == 0) {
    for (const auto& [alias, first] : aliases_of(*f.module())) {
      p.add_bytes(alias_name(name_of(alias)), name_of(first));
    }
  }
}

// The shape parameter k of an FSDP unit has in a step (the whole one's for
// a tensor-parallel piece).
std::vector<int64_t> saved_shape(const ddp::UnitShard& u, size_t k) {
  const std::optional<Placement> placed = placement_of(u.params.at(k));
  return placed ? placed->whole : u.shapes[k];
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
    for (const auto& [name, t] : tensors_of(*mod)) add_tensor(p, prefix + "." + name, t);
  };
  item.verify = [prefix, mod](const Slices& r) {
    for (const auto& [name, t] : tensors_of(*mod)) {
      check_tensor(r, prefix + "." + name, saved_shape(t), "a tensor of module '" + prefix + "'");
    }
  };
  item.read = [prefix, mod](const Slices& r) {
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : tensors_of(*mod)) t.copy_(read_tensor(r, prefix + "." + name, t));
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
    for (const auto& [name, t] : *ps) add_state(p, o, state_name(prefix, name), t);
  };
  auto decoded = std::make_shared<std::vector<std::optional<std::string>>>();
  item.verify = [prefix, o, ps, decoded](const Slices& r) {
    const optim::Kind kind = optim::kind_of(*o);
    decoded->clear();
    for (const auto& [name, t] : *ps) {
      decoded->push_back(checked_state(r, kind, state_name(prefix, name), t, prefix));
    }
  };
  item.read = [o, ps, decoded](const Slices&) {
    for (size_t i = 0; i < ps->size(); ++i) {
      if (decoded->at(i)) optim::load_param_state(*o, (*ps)[i].second, *decoded->at(i));
    }
    decoded->clear();
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
      add_state(p, local, state_name(prefix, (*ns)[i]), zp->params()[i]);
    }
    if (rank == 0) {
      std::ostringstream lr;
      lr.precision(17);
      lr << zp->lr();
      p.add_bytes(prefix + "#lr", lr.str());
    }
  };
  auto decoded = std::make_shared<std::vector<std::optional<std::string>>>();
  item.verify = [prefix, zp, ns, decoded](const Slices& r) {
    const optim::Kind kind = zp->kind();
    decoded->clear();
    for (size_t i : zp->share(zp->rank())) {
      decoded->push_back(
          checked_state(r, kind, state_name(prefix, (*ns)[i]), zp->params()[i], prefix));
    }
  };
  item.read = [prefix, zp, decoded](const Slices& slices) {
    const Reader& r = slices.reader();
    torch::optim::Optimizer* local = zp->local_optimizer();
    size_t k = 0;
    for (size_t i : zp->share(zp->rank())) {
      if (!local) break;
      const std::optional<std::string>& bytes = decoded->at(k++);
      if (bytes) optim::load_param_state(*local, zp->params()[i], *bytes);
    }
    decoded->clear();
    // (a plain optimizer's state carries no rate: the current one stays)
    if (r.contains(prefix + "#lr")) zp->set_lr(std::stod(r.bytes(prefix + "#lr")));
  };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::module(const std::string& prefix, ddp::FullyShardedDataParallel& f) {
  ddp::FullyShardedDataParallel* fp = &f;
  const int rank = rank_;
  auto buffers = [fp] {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& b : fp->module()->named_buffers(true)) out.emplace_back(b.key(), b.value());
    return out;
  };
  Item item;
  item.write = [prefix, fp, rank, buffers](Part& p) {
    write_fsdp(
        p, *fp, rank, [&](const std::string& name) { return prefix + "." + name; },
        [&](const std::string& entry, size_t, const ddp::UnitShard& u, int64_t at, int64_t n) {
          p.add(entry, u.shard.narrow(0, at, n));
        });
    if (rank == 0) {
      for (const auto& [name, t] : buffers()) p.add(prefix + "." + name, t);
    }
  };
  item.verify = [prefix, fp, buffers](const Slices& r) {
    const std::string what = "a tensor of module '" + prefix + "'";
    for (const ddp::UnitShard& u : fp->shards()) {
      for (size_t k = 0; k < u.names.size(); ++k) {
        check_tensor(r, prefix + "." + u.names[k], saved_shape(u, k), what);
      }
    }
    for (const auto& [name, t] : buffers()) check_tensor(r, prefix + "." + name, t.sizes(), what);
  };
  item.read = [prefix, fp, buffers](const Slices& r) {
    torch::NoGradGuard no_grad;
    for (const ddp::UnitShard& u : fp->shards()) {
      at::Tensor shard = u.shard;  // (the live one: shards() copies nothing)
      shard.zero_();               // (the padding)
      for_each_piece(u, [&](size_t k, int64_t a, int64_t b, int64_t at) {
        const std::string name = prefix + "." + u.names[k];
        const std::optional<Placement> placed = placement_of(u.params.at(k));
        shard.narrow(0, at, b - a)
            .copy_(placed ? r.piece(name, *placed, a, b) : r.tensor(name, u.shapes[k], a, b));
      });
    }
    for (auto& [name, t] : buffers()) t.copy_(r.tensor(prefix + "." + name, t.sizes()));
  };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::optimizer(const std::string& prefix, torch::optim::Optimizer& opt,
                              ddp::FullyShardedDataParallel& f) {
  const optim::Kind kind = optim::kind_of(opt);
  torch::optim::Optimizer* o = &opt;
  ddp::FullyShardedDataParallel* fp = &f;
  const int rank = rank_;
  Item item;
  item.write = [prefix, o, fp, rank](Part& p) {
    const std::vector<at::Tensor> params = fp->parameters();
    write_fsdp(
        p, *fp, rank, [&](const std::string& name) { return state_name(prefix, name); },
        [&](const std::string& entry, size_t s, const ddp::UnitShard&, int64_t at, int64_t n) {
          p.add_bytes_later(entry, optim::param_state_slice_snapshot(*o, params[s], at, n));
        });
  };
  // Each shard's state joined from the pieces it overlaps, in verify (every
  // piece decoded and checked before any shard is loaded); none for a shard
  // that is all padding (its optimizer keeps what it has: Adagrad's state
  // must never be missing).
  auto decoded = std::make_shared<std::vector<std::optional<std::string>>>();
  item.verify = [prefix, fp, kind, decoded](const Slices& r) {
    decoded->clear();
    for (const ddp::UnitShard& u : fp->shards()) {
      for (size_t k = 0; k < u.names.size(); ++k) {
        check_state(r, state_name(prefix, u.names[k]), saved_shape(u, k), prefix);
      }
      std::vector<optim::StatePiece> pieces;
      for_each_piece(u, [&](size_t k, int64_t a, int64_t b, int64_t at) {
        const std::string name = state_name(prefix, u.names[k]);
        if (const std::optional<Placement> placed = placement_of(u.params.at(k))) {
          r.piece_state_pieces(name, *placed, a, b, at, pieces);
        } else {
          r.state_pieces(name, u.shapes[k], a, b, at, pieces);
        }
      });
      if (pieces.empty()) {
        decoded->emplace_back();
        continue;
      }
      try {
        decoded->push_back(optim::join_param_states(kind, {u.shard.numel()}, pieces));
      } catch (const std::invalid_argument& e) {
        const std::string unit = u.unit.empty() ? "the root unit" : "unit '" + u.unit + "'";
        throw std::invalid_argument("checkpoint: optimizer '" + prefix + "', the shard of " + unit +
                                    ": " + e.what());
      }
    }
  };
  item.read = [o, fp, decoded](const Slices&) {
    const std::vector<at::Tensor> params = fp->parameters();
    for (size_t s = 0; s < params.size(); ++s) {
      if (decoded->at(s)) optim::load_param_state(*o, params[s], *decoded->at(s));
    }
    decoded->clear();
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
  item.verify = [name, sp](const Slices& r) { sampler_place(r.reader(), name, *sp); };
  item.read = [name, sp](const Slices& r) {
    const auto [epoch, position] = sampler_place(r.reader(), name, *sp);
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
  item.verify = [name](const Slices& r) { need(r.reader(), name, "a learning-rate schedule"); };
  item.read = [name, sp](const Slices& r) {
    std::istringstream in(r.reader().bytes(name));
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
  item.verify = [](const Slices&) {};
  item.read = [mine](const Slices& slices) {
    const Reader& r = slices.reader();
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
  item.verify = [name](const Slices& r) { need(r.reader(), name, "a record"); };
  item.read = [name, bytes](const Slices& r) { *bytes = r.reader().bytes(name); };
  items_.push_back(std::move(item));
  return *this;
}

JobState& JobState::remote_module(const std::string& prefix, const nn::RemoteModule& m,
                                  int64_t first_layer, bool write) {
  Item item;
  item.write = [](Part&) {};
  item.verify = [&m, prefix, first_layer](const Slices& r) {
    load_module_part(m, r.reader().path(), prefix, first_layer, true);
  };
  item.read = [&m, prefix, first_layer](const Slices& r) {
    load_module_part(m, r.reader().path(), prefix, first_layer, false);
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
  item.verify = [op, ns, prefix](const Slices& r) {
    load_optimizer_parts(*op, *ns, r.reader().path(), prefix, true);
  };
  item.read = [op, ns, prefix](const Slices& r) {
    load_optimizer_parts(*op, *ns, r.reader().path(), prefix, false);
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
  const Slices slices(reader);
  for (const auto& item : items_) item.verify(slices);
  for (const auto& item : items_) item.read(slices);
}

void save_job(const std::string& dir, int64_t step, const JobState& state,
              const SaveOptions& options) {
  save_parts(dir, step, state.part(), state.remote_writers(), options);
}

std::optional<int64_t> load_latest_job(const std::string& dir, JobState& state,
                                       const LatestOptions& options) {
  std::vector<std::string> passed_over;
  LatestOptions o = options;
  o.passed_over = &passed_over;
  const std::optional<Found> found = latest(dir, o);
  for (const std::string& s : passed_over) {
    std::fprintf(stderr, "tandem: checkpoint passed over: %s\n", s.c_str());
  }
  if (!found) return std::nullopt;
  Reader reader(found->path);
  state.load(reader);
  return reader.step();
}

}  // namespace tandem::checkpoint
