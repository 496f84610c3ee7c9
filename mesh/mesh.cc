#include "tandem/mesh/mesh.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

#include "tandem/rpc/agent.h"
#include "tandem/rpc/api.h"
#include "tandem/rpc/rendezvous.h"

namespace tandem {

namespace {

std::string shape_text(const Mesh::Shape& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    s += (i ? ", " : "") + shape[i].first + "=" + std::to_string(shape[i].second);
  }
  return s + ")";
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// The shape as a rank publishes it: "pp=2, dp=2".
std::string encode(const Mesh::Shape& shape) {
  std::string s;
  for (const auto& [dim, n] : shape) s += (s.empty() ? "" : ", ") + dim + "=" + std::to_string(n);
  return s;
}

}  // namespace

struct Mesh::State {
  std::string name;  // the user's
  std::string tag;   // name#incarnation: what every key and group name carries
  std::weak_ptr<rpc::Agent> agent;
  std::map<std::string, std::shared_ptr<ddp::ProcessGroup>> groups;  // by dimension

  ~State() {
    if (auto a = agent.lock()) {
      for (const auto& [dim, _] : groups) ddp::unregister_group(*a, tag + "/" + dim);
    }
    // The groups close in the same order on every rank (by dimension name):
    // each waits for its peers to close it too.
    for (auto& [_, g] : groups) g.reset();
  }
};

Mesh::Mesh(const Shape& shape, MeshOptions o) : state_(std::make_shared<State>()) {
  state_->name = o.name;
  std::shared_ptr<rpc::Agent> agent = o.agent;
  if (!agent) {
    try {
      agent = rpc::current_agent();
    } catch (const std::logic_error&) {
      // no agent: ranks and the store come from the options or the environment
    }
  }
  state_->agent = agent;
  const rpc::WorldEnv env = rpc::world_from_env();
  int rank = o.rank, world = o.world_size;
  if (agent) {
    if (rank < 0) rank = agent->rank();
    if (world < 0) world = agent->world_size();
  }
  std::tie(rank, world) = rpc::rank_and_size(rank, world, env, "MeshOptions");
  const std::string what = "mesh '" + o.name + "'";

  // The members, and the key space they meet in: the whole world's, or one
  // named by a hash of the member list.
  std::vector<int> members = o.ranks;
  std::string space = "all";
  if (members.empty()) {
    for (int r = 0; r < world; ++r) members.push_back(r);
  } else {
    std::set<int> seen;
    uint64_t h = 1469598103934665603ull;  // FNV-1a of the list
    for (int r : members) {
      if (r < 0 || r >= world) {
        throw std::invalid_argument(what + ": rank " + std::to_string(r) +
                                    " of MeshOptions::ranks is not in the world's 0 .. " +
                                    std::to_string(world - 1));
      }
      if (!seen.insert(r).second) {
        throw std::invalid_argument(what + ": rank " + std::to_string(r) +
                                    " appears twice in MeshOptions::ranks");
      }
      for (char c : std::to_string(r) + ",")
        h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    }
    space = std::to_string(h);
  }
  const auto where = std::find(members.begin(), members.end(), rank);
  if (where == members.end()) {
    throw std::invalid_argument(what + ": rank " + std::to_string(rank) +
                                " is not one of MeshOptions::ranks, so it cannot make the mesh");
  }
  const int n = static_cast<int>(members.size());

  c10::intrusive_ptr<c10d::Store> store = o.store;
  if (!store) {
    auto [host, port] = rpc::master_from_init_method(o.init_method);
    store = rpc::make_store(host, port, env.rank >= 0 ? env.rank : rank, world, o.timeout);
  }
  auto keys = c10::make_intrusive<c10d::PrefixStore>("tandem/mesh/" + o.name + "/" + space, store);

  // Every rank counts itself in before it waits for anyone: the k-th mesh
  // of this name (and these members) gets k on every rank, however the
  // ranks interleave.
  const int64_t incarnation = (keys->add("made", 1) - 1) / n;
  state_->tag = o.name + "#" + std::to_string(incarnation) + (space == "all" ? "" : "@" + space);
  const std::string at = std::to_string(incarnation) + "/";
  const std::string mine = encode(shape);
  keys->set("shape/" + at + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::map<std::string, std::vector<int>> holders;  // shape text -> ranks
  for (int r : members) {
    try {
      const auto bytes = keys->get("shape/" + at + std::to_string(r));
      holders[std::string(bytes.begin(), bytes.end())].push_back(r);
    } catch (const std::exception& e) {
      throw ddp::CollectiveError(what + ": rank " + std::to_string(rank) + " waited for rank " +
                                 std::to_string(r) +
                                 " to make it and it did not come (do all its ranks make the "
                                 "same meshes in the same order, with the same "
                                 "MeshOptions::ranks?): " +
                                 std::string(e.what()).substr(0, std::string(e.what()).find('\n')));
    }
  }
  if (holders.size() > 1) {
    std::string parts;
    for (const auto& [text, ranks] : holders) {
      parts += (parts.empty() ? "" : "; ") + ranks_text(ranks) + " made it (" + text + ")";
    }
    throw std::invalid_argument(what + ": the ranks disagree on its shape: " + parts);
  }

  if (shape.empty()) throw std::invalid_argument(what + ": a mesh needs at least one dimension");
  int64_t product = 1;
  std::set<std::string> seen;
  for (const auto& [dim, n] : shape) {
    if (dim.empty()) throw std::invalid_argument(what + ": a dimension has no name");
    if (!seen.insert(dim).second) {
      throw std::invalid_argument(what + ": dimension '" + dim + "' appears twice in " +
                                  shape_text(shape));
    }
    if (n < 1) {
      throw std::invalid_argument(what + ": dimension '" + dim + "' has size " + std::to_string(n) +
                                  " (at least 1)");
    }
    product *= n;
    dims_.push_back(dim);
    sizes_.push_back(n);
  }
  if (product != n) {
    throw std::invalid_argument(what + ": shape " + shape_text(shape) + " holds " +
                                std::to_string(product) + " ranks, but " +
                                (o.ranks.empty() ? "the world has " : "MeshOptions::ranks has ") +
                                std::to_string(n));
  }
  ranks_ = members;
  me_ = static_cast<int>(where - members.begin());

  // One group per dimension: this rank's peers along it. Its name carries
  // the mesh's tag, the dimension and which of that dimension's groups it
  // is (the coordinates of the other dimensions, as one number).
  for (size_t d = 0; d < dims_.size(); ++d) {
    int which = 0;
    for (size_t e = 0; e < dims_.size(); ++e) {
      if (e != d) which = which * sizes_[e] + coordinate(dims_[e]);
    }
    ddp::ProcessGroupOptions g;
    g.backend = o.backend;
    g.init_method = o.init_method;
    g.timeout = o.timeout;
    g.store = store;
    g.rank = coordinate(dims_[d]);
    g.world_size = sizes_[d];
    g.group_name = "mesh/" + state_->tag + "/" + dims_[d] + "/" + std::to_string(which);
    if (agent) g.member_name = agent->name();
    state_->groups[dims_[d]] = ddp::ProcessGroup::create(g);
  }
  if (agent) {
    for (const auto& [dim, group] : state_->groups) {
      ddp::register_group(*agent, state_->tag + "/" + dim, group);
    }
  }
  // Nobody leaves before every rank has registered its groups: a driver
  // that stepped at once would otherwise reach a stage worker that has not.
  const std::string ready = "ready/" + std::to_string(incarnation);
  if (keys->add(ready, 1) == n) keys->set(ready + "/all", std::vector<uint8_t>{1});
  try {
    keys->wait({ready + "/all"});
  } catch (const std::exception& e) {
    throw ddp::CollectiveError(what + ": rank " + std::to_string(rank) +
                               " made its groups, but not every rank did within the store's "
                               "timeout: " +
                               std::string(e.what()).substr(0, std::string(e.what()).find('\n')));
  }
}

const std::string& Mesh::name() const { return state_->name; }

Mesh::Shape Mesh::shape() const {
  Shape s;
  for (size_t d = 0; d < dims_.size(); ++d) s.emplace_back(dims_[d], sizes_[d]);
  return s;
}

size_t Mesh::index_of(const std::string& dim) const {
  auto it = std::find(dims_.begin(), dims_.end(), dim);
  if (it == dims_.end()) {
    std::string have;
    for (const auto& d : dims_) have += (have.empty() ? "" : ", ") + d;
    throw std::invalid_argument(to_string() + " has no dimension '" + dim +
                                "' (its dimensions: " + have + ")");
  }
  return static_cast<size_t>(it - dims_.begin());
}

int Mesh::size(const std::string& dim) const { return sizes_[index_of(dim)]; }

std::vector<int> Mesh::coordinates() const {
  std::vector<int> c(dims_.size());
  int rest = me_;
  for (size_t d = dims_.size(); d-- > 0;) {
    c[d] = rest % sizes_[d];
    rest /= sizes_[d];
  }
  return c;
}

int Mesh::coordinate(const std::string& dim) const { return coordinates()[index_of(dim)]; }

int Mesh::rank_at(const std::vector<int>& c) const {
  if (c.size() != dims_.size()) {
    throw std::invalid_argument(to_string() + ": rank_at takes " + std::to_string(dims_.size()) +
                                " coordinates, not " + std::to_string(c.size()));
  }
  int index = 0;
  for (size_t d = 0; d < dims_.size(); ++d) {
    if (c[d] < 0 || c[d] >= sizes_[d]) {
      throw std::invalid_argument(to_string() + ": coordinate " + std::to_string(c[d]) +
                                  " of dimension '" + dims_[d] + "' is not in [0, " +
                                  std::to_string(sizes_[d]) + ")");
    }
    index = index * sizes_[d] + c[d];
  }
  return ranks_[static_cast<size_t>(index)];
}

int Mesh::rank_at(Some some) const {
  std::vector<int> c = coordinates();
  for (const auto& [dim, x] : some) c[index_of(dim)] = x;
  return rank_at(c);
}

namespace {
std::string worker_name(const std::weak_ptr<rpc::Agent>& weak, const std::string& mesh, int rank) {
  auto agent = weak.lock();
  if (!agent) {
    throw std::logic_error(mesh +
                           ": no RPC agent, so no worker names (make the mesh after "
                           "rpc::init, or give MeshOptions::agent)");
  }
  return agent->get_worker_info(rank).name;
}
}  // namespace

std::string Mesh::worker_at(const std::vector<int>& c) const {
  return worker_name(state_->agent, to_string(), rank_at(c));
}

std::string Mesh::worker_at(Some some) const {
  return worker_name(state_->agent, to_string(), rank_at(some));
}

std::vector<int> Mesh::ranks_along(const std::string& dim) const {
  const size_t d = index_of(dim);
  std::vector<int> c = coordinates(), out;
  for (int x = 0; x < sizes_[d]; ++x) {
    c[d] = x;
    out.push_back(rank_at(c));
  }
  return out;
}

std::shared_ptr<ddp::ProcessGroup> Mesh::group(const std::string& dim) const {
  index_of(dim);  // names the dimension when it is not one of ours
  return state_->groups.at(dim);
}

std::string Mesh::group_name(const std::string& dim) const {
  index_of(dim);
  return state_->tag + "/" + dim;
}

Mesh Mesh::operator[](const std::string& dim) const {
  return (*this)[std::vector<std::string>{dim}];
}

Mesh Mesh::operator[](const std::vector<std::string>& dims) const {
  if (dims.empty()) throw std::invalid_argument(to_string() + ": a sub-mesh needs a dimension");
  std::vector<size_t> picked;
  for (const auto& dim : dims) {
    const size_t d = index_of(dim);
    if (!picked.empty() && d <= picked.back()) {
      throw std::invalid_argument(to_string() + ": a sub-mesh's dimensions go in the mesh's " +
                                  "order, once each ('" + dim + "' is out of place)");
    }
    picked.push_back(d);
  }
  Mesh sub;
  sub.state_ = state_;
  for (size_t d : picked) {
    sub.dims_.push_back(dims_[d]);
    sub.sizes_.push_back(sizes_[d]);
  }
  // Every point of the picked dimensions, row-major, the others at mine.
  const std::vector<int> mine = coordinates();
  std::vector<int> c = mine;
  std::vector<int> at(picked.size(), 0);
  const int n = [&] {
    int p = 1;
    for (int s : sub.sizes_) p *= s;
    return p;
  }();
  for (int i = 0; i < n; ++i) {
    int rest = i;
    for (size_t k = picked.size(); k-- > 0;) {
      at[k] = rest % sub.sizes_[k];
      rest /= sub.sizes_[k];
      c[picked[k]] = at[k];
    }
    sub.ranks_.push_back(rank_at(c));
    bool is_me = true;
    for (size_t k = 0; k < picked.size(); ++k) is_me = is_me && at[k] == mine[picked[k]];
    if (is_me) sub.me_ = i;
  }
  return sub;
}

std::string Mesh::to_string() const {
  return "mesh '" + (state_ ? state_->name : std::string("?")) + "' " + shape_text(shape());
}

}  // namespace tandem
