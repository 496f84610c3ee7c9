#pragma once
// A tensor that is a piece of a larger one (a tensor-parallel rank's slice
// of a parameter) saying so: the whole tensor's shape, the dimension it is
// cut along, and the ranges of that dimension it holds, in order (several
// along dimension 0 for a fused [q; k; v] cut by heads). Checkpoints write
// such a tensor, and its optimizer state, under the whole tensor's name as
// slices of it, and load it back from whatever a step holds of the whole:
// the whole tensor (one process's job), flat slices (FSDP's), or another
// split's pieces; and a whole tensor loads from such pieces.
//
//   // rank r of 2: rows [r * C/2, (r+1) * C/2) of each of q, k and v
//   checkpoint::set_placement(qkv->weight, {{3 * C, C}, 0, {{a, b}, {C + a, C + b}, {2 * C + a, 2 * C + b}}});
//
// 1. The placement is kept beside the tensor (by its TensorImpl, held
//    weakly), so the same tensor anywhere in the process (a module's
//    parameter, an optimizer's, a RemoteModule's owner's) carries it.
//    parallel/'s layers set it on their split parameters.
// 2. In a step, a piece along dimension 0 is flat slices
//    "<name>#<start>:<end>" (checkpoint/slices.h, one a range); along
//    another dimension d it is a block "<name>#d<d>:<start>:<end>" holding
//    its elements flattened; "<name>#shape" records the whole shape. An
//    optimizer's state likewise ("<prefix>/<name>#..."): each entry the
//    state of a parameter of that slice's or block's elements.
// 3. A tensor replicated over a group (a tensor-parallel rank's copy of a
//    LayerNorm's weight) is marked as copy k of it (set_replica): only
//    copy 0 is written, with its optimizer state; every copy loads the
//    whole tensor.
// 4. set_placement refuses (std::invalid_argument, naming it) ranges that
//    leave the dimension, are empty, overlap or go backwards, several
//    ranges along a dimension other than 0, and a piece whose shape is not
//    the whole's with that dimension the ranges' total.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tandem::checkpoint {

struct Placement {
  std::vector<int64_t> whole;  // the whole tensor's shape
  int64_t dim = 0;             // the dimension the piece is cut along
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [start, end) along dim, in order
};

void set_placement(const at::Tensor& piece, Placement placement);
// `t`'s placement; nullopt for a tensor that is whole.
std::optional<Placement> placement_of(const at::Tensor& t);
// 3.: `t` is copy `copy` of a replicated tensor; and which copy it is (0
// for one never marked).
void set_replica(const at::Tensor& t, int copy);
int replica_of(const at::Tensor& t);

// The piece's shape: the whole's, with the split dimension the ranges' total.
std::vector<int64_t> piece_shape(const Placement& p);

// The piece's elements, flattened in order, as ranges [start, end) of the
// whole tensor's flattened elements (adjacent ones merged); with [lo, hi),
// only the piece's flattened elements [lo, hi) (hi -1: to its end).
std::vector<std::pair<int64_t, int64_t>> flat_ranges(const Placement& p, int64_t lo = 0,
                                                     int64_t hi = -1);

// How a piece is written (2.): each entry's name suffix ("#<start>:<end>" or
// "#d<d>:<start>:<end>") and the elements of the flattened piece it holds.
struct PieceEntry {
  std::string suffix;
  int64_t piece_start = 0, numel = 0;
};
// With [lo, hi): the entries of only the piece's flattened elements
// [lo, hi) (an FSDP shard's share of a piece): the flat slices cut to it,
// or the part "#d<d>:<start>:<end>@<lo>:<hi>" of a block (its flattened
// elements [lo, hi)).
std::vector<PieceEntry> piece_entries(const Placement& p, int64_t lo = 0, int64_t hi = -1);

}  // namespace tandem::checkpoint
