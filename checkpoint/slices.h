// Where a step holds each tensor and each parameter's optimizer state:
// whole under its name, or in flat slices "<name>#<start>:<end>" (elements
// [start, end) of the flattened tensor, a 1-D tensor or the state of a
// parameter of [end - start]: what FullyShardedDataParallel's ranks write,
// each the pieces of the parameters its shard holds). Beside the slices,
// "<name>#shape" (bytes: the dimensions, space-separated) records the
// whole tensor's shape, and "<name>#alias" (bytes: another name) says that
// `name` is the same tensor as that one (a parameter two modules share,
// which FSDP holds once). A tensor-parallel piece cut along a dimension d
// other than 0 is a block "<name>#d<d>:<start>:<end>" (checkpoint/
// placement.h: its elements flattened, the whole shape recorded beside):
// here it stands for the flat slices it covers, one a row of the
// dimensions before d. Every loader of the library reads through here,
// so whatever layout wrote a step, any layout loads it. Internal to the
// library (not installed).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tandem/checkpoint/checkpoint.h"
#include "tandem/checkpoint/placement.h"
#include "tandem/optim/param_state.h"

namespace tandem::checkpoint {

// "<name>#<start>:<end>", "<name>#shape", "<name>#alias"; the shape record's bytes.
std::string slice_name(const std::string& name, int64_t start, int64_t end);
std::string shape_name(const std::string& name);
std::string alias_name(const std::string& name);
std::string shape_text(at::IntArrayRef shape);

// How `t` (a tensor, or a parameter whose optimizer state is written) goes
// under `name`: one cut, whole (numel -1); or, for a piece of a larger
// tensor (placement_of), one per entry (placement.h 2.), each the piece's
// flattened elements [start, start + numel) (of the state: the state of a
// parameter of those elements); none for a replica's copy other than 0.
// `shape_record` gets the whole shape's text when this piece records it,
// the one that starts the split dimension (else "").
struct PieceCut {
  std::string entry;
  int64_t start = 0, numel = -1;
};
std::vector<PieceCut> piece_cuts(const std::string& name, const at::Tensor& t,
                                 std::string* shape_record);
// Writes `t` under `name` as piece_cuts cuts it, with its shape record.
void add_tensor(Part& part, const std::string& name, const at::Tensor& t);

class Slices;
// The shape `t` has in a step: the whole tensor's when it is a piece.
std::vector<int64_t> saved_shape(const at::Tensor& t);
// `t`'s values from `r` (its piece when it is one), in t's shape; and the
// state of parameter `param` under `name`, as load_param_state takes it.
at::Tensor read_tensor(const Slices& r, const std::string& name, const at::Tensor& t);
std::string read_state(const Slices& r, optim::Kind kind, const std::string& name,
                       const at::Tensor& param);

class Slices {
 public:
  // Indexes `reader`'s names (which must outlive this).
  explicit Slices(const Reader& reader);
  const Reader& reader() const { return reader_; }

  // Whether the step holds `name` whole, in slices, or as an alias of one
  // that it holds.
  bool contains(const std::string& name) const;
  // What keeps the tensor `name` from loading into one of `shape` ("" when
  // nothing): missing (a tensor of no elements needs nothing), another
  // shape, slices that leave elements out or overlap, a part that fails its
  // checks (every part it would read is read and checked here).
  std::string tensor_problem(const std::string& name, at::IntArrayRef shape) const;
  // The same for the optimizer state of a parameter of `shape` (the state's
  // bytes are checked when decoded: check_state).
  std::string state_problem(const std::string& name, at::IntArrayRef shape) const;

  // Elements [a, b) of the flattened tensor `name` of `shape` (1-D).
  at::Tensor tensor(const std::string& name, at::IntArrayRef shape, int64_t a, int64_t b) const;
  // All of it, in `shape`.
  at::Tensor tensor(const std::string& name, at::IntArrayRef shape) const;
  // The pieces of the state of parameter `name` (of `shape`) holding its
  // flattened elements [a, b), placed from `to` on.
  void state_pieces(const std::string& name, at::IntArrayRef shape, int64_t a, int64_t b,
                    int64_t to, std::vector<optim::StatePiece>& out) const;
  // The whole state of parameter `name` of `shape`, as load_param_state
  // takes it (the saved bytes themselves when it is whole);
  // std::invalid_argument naming the piece that does not fit.
  std::string state(optim::Kind kind, const std::string& name, at::IntArrayRef shape) const;

  // A piece of the tensor `name` of `whole` shape where `p` places it (in
  // the piece's shape), and the state of such a piece as load_param_state
  // takes it; checked first as tensor_problem / state_problem check the
  // whole (std::invalid_argument naming the problem).
  at::Tensor piece(const std::string& name, const Placement& p) const;
  std::string piece_state(optim::Kind kind, const std::string& name, const Placement& p) const;
  // Elements [lo, hi) of such a piece, flattened (1-D: an FSDP shard's
  // share of it); and the pieces of their state, placed from `to` on (as
  // state_pieces). Checked likewise.
  at::Tensor piece(const std::string& name, const Placement& p, int64_t lo, int64_t hi) const;
  void piece_state_pieces(const std::string& name, const Placement& p, int64_t lo, int64_t hi,
                          int64_t to, std::vector<optim::StatePiece>& out) const;

 private:
  struct Slice {
    int64_t start = 0, end = 0;
    std::string entry;
    int64_t offset = 0;        // where in the entry's (flattened) elements `start` is
    int64_t entry_numel = -1;  // the entry's elements (-1: end - start)
    int64_t numel() const { return entry_numel < 0 ? end - start : entry_numel; }
  };
  // Read by one call: each entry once.
  struct Cache {
    std::map<std::string, at::Tensor> tensors;
    std::map<std::string, std::shared_ptr<const std::string>> bytes;
  };
  // fn(slice, lo, hi) for each slice of `list` holding elements [lo, hi)
  // of [a, b), in order.
  static void overlapping(const std::vector<Slice>& list, int64_t a, int64_t b,
                          const std::function<void(const Slice&, int64_t, int64_t)>& fn);
  at::Tensor read_range(const std::string& n, int64_t a, int64_t b, Cache& cache) const;
  void pieces_range(const std::string& n, int64_t count, int64_t a, int64_t b, int64_t to,
                    std::vector<optim::StatePiece>& out, Cache& cache) const;
  // (elements [lo, hi) of the block, flattened; hi -1: to its end)
  void add_block(const std::string& name, const std::string& entry, int64_t dim, int64_t a,
                 int64_t b, int64_t lo, int64_t hi);
  // The name the step holds `name` under (itself, or the one it aliases).
  std::string resolve(const std::string& name) const;
  const std::vector<Slice>* slices_of(const std::string& name) const;
  std::string coverage_problem(const std::string& name, at::IntArrayRef shape, bool tensors) const;

  const Reader& reader_;
  std::map<std::string, std::vector<Slice>> slices_;  // by name, in order of start
};

}  // namespace tandem::checkpoint
