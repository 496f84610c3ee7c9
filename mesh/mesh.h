#pragma once
// Mesh: the world's ranks laid out as an n-dimensional grid with named
// dimensions, and a process group along each, as PyTorch's
// init_device_mesh gives them.
//
//   tandem::Mesh mesh({{"pp", 2}, {"dp", 2}});   // 4 ranks: row-major, last dimension fastest
//   mesh.coordinate("pp");                        // this rank's stage
//   mesh.size("dp");                              // replicas
//   mesh.rank_at({{"pp", 1}});                    // the rank at pp = 1 with my other coordinates
//   mesh.worker_at({{"pp", 1}});                  // its RPC worker's name
//   mesh.group("dp")->all_reduce(t);              // over this rank's data-parallel peers
//   tandem::Mesh dp = mesh["dp"];                 // a 1-D sub-mesh of those peers
//
// Layout: the rank at coordinates (c0, c1, ..., cn-1) of shape
// (s0, s1, ..., sn-1) is c0 * s1 * ... * sn-1 + ... + cn-1, so with
// {{"pp", 2}, {"dp", 2}} ranks 0 and 1 are stage 0 of replicas 0 and 1,
// ranks 2 and 3 stage 1 of each, and the data-parallel group of rank 2 is
// {2, 3}, its pipeline group {0, 2}.
//
// Construction is collective: every rank of the mesh (the world, or
// MeshOptions::ranks) makes the same mesh, in the same order as its other
// meshes. The ranks first compare their shapes at the job's store (the one
// the RPC agent meets at: MASTER_ADDR / MASTER_PORT, or MeshOptions::store),
// so that a shape whose sizes do not multiply to the mesh's rank count, or
// ranks that were given different shapes, fail on every rank with
// std::invalid_argument naming the shapes (and the ranks that disagree).
// Ranks given different MeshOptions::ranks meet under different keys: they
// wait out the timeout, and the error says what to check. Then each rank makes one process group
// per dimension: the group of its peers along it (gloo for CPU tensors, nccl for CUDA ones). Every
// group's keys carry the mesh's name and incarnation and the dimension, so the groups of two meshes
// (or two dimensions) of one job never mix. With an RPC agent, the groups are registered with it
// under group_name(dim) (ddp::find_group), which is how a pipeline's stage workers find their
// data-parallel group (PipeOptions::data_parallel_group).
//
// A dimension a mesh does not have is std::invalid_argument naming it and
// the ones it has. Sub-meshes share their parent's groups.
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/ddp/process_group.h"

namespace c10d {
class Store;
}

namespace tandem {

namespace rpc {
class Agent;
}

struct MeshOptions {
  // Two meshes of one job with the same name are told apart by their order
  // (their incarnation); names only make groups easier to read in errors.
  std::string name = "mesh";
  std::string backend = "gloo";  // of every group: "gloo" (CPU tensors) or "nccl" (CUDA ones)
  std::chrono::milliseconds timeout = ddp::kDefaultCollectiveTimeout;  // each group's
  // Where the ranks meet. With `store` null: init_method's ("env://", as
  // tandem-run sets it, or "tcp://host:port"), shared with the RPC agent.
  std::string init_method = "env://";
  c10::intrusive_ptr<c10d::Store> store;
  // -1: the agent's (or the environment's without one).
  int rank = -1, world_size = -1;
  // The world ranks the mesh lays out, row-major: a mesh over some of the
  // world (the trainers, with a parameter server outside it). Only these
  // ranks make it; each must be in it. Empty: the whole world, in order.
  std::vector<int> ranks;
  // The agent whose workers the mesh names, and with which its groups are
  // registered. Null: rpc::init's, when there is one.
  std::shared_ptr<rpc::Agent> agent;
};

class Mesh {
 public:
  using Shape = std::vector<std::pair<std::string, int>>;

  // Collective (see above). Throws std::invalid_argument for a bad shape (a
  // dimension of size < 1, an empty or repeated name, sizes whose product
  // is not the world size) or ranks that disagree on it, and
  // ddp::CollectiveError when a group cannot be made.
  explicit Mesh(const Shape& shape, MeshOptions options = {});

  const std::string& name() const;
  const std::vector<std::string>& dims() const { return dims_; }
  int ndim() const { return static_cast<int>(dims_.size()); }
  Shape shape() const;
  int size() const { return static_cast<int>(ranks_.size()); }  // ranks in this mesh
  int size(const std::string& dim) const;

  int rank() const { return ranks_[static_cast<size_t>(me_)]; }  // this process's, in the world
  // This rank's index along `dim`, and all of them in dimension order.
  int coordinate(const std::string& dim) const;
  std::vector<int> coordinates() const;

  // The world rank at these coordinates: one per dimension, in order, or
  // some by name (the rest: this rank's own). std::invalid_argument when
  // one is out of range or a name unknown.
  using Some = std::initializer_list<std::pair<std::string, int>>;
  int rank_at(const std::vector<int>& coordinates) const;
  int rank_at(Some some) const;
  // The RPC worker's name there (std::logic_error without an agent).
  std::string worker_at(const std::vector<int>& coordinates) const;
  std::string worker_at(Some some) const;
  // The world ranks of this rank's peers along `dim`, by coordinate.
  std::vector<int> ranks_along(const std::string& dim) const;
  // Every world rank of the mesh, row-major.
  const std::vector<int>& ranks() const { return ranks_; }

  // The process group of this rank's peers along `dim` (its rank in it is
  // coordinate(dim)).
  std::shared_ptr<ddp::ProcessGroup> group(const std::string& dim) const;
  // The name the group is registered under with the agent (the same on
  // every rank of the mesh, one group per rank): what a pipeline's
  // PipeOptions::data_parallel_group takes.
  std::string group_name(const std::string& dim) const;

  // The sub-mesh of this rank's peers along `dim` (or along several, given
  // in this mesh's order), sharing this mesh's groups.
  Mesh operator[](const std::string& dim) const;
  Mesh operator[](const std::vector<std::string>& dims) const;
  Mesh operator[](std::initializer_list<std::string> dims) const {
    return (*this)[std::vector<std::string>(dims)];
  }

  // "mesh (pp=2, dp=2)".
  std::string to_string() const;

 private:
  struct State;
  Mesh() = default;
  size_t index_of(const std::string& dim) const;

  std::shared_ptr<State> state_;
  std::vector<std::string> dims_;
  std::vector<int> sizes_;
  std::vector<int> ranks_;  // world ranks, row-major over dims_
  int me_ = 0;              // this rank's place in ranks_
};

}  // namespace tandem
