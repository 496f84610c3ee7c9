// A checkpoint of a DistributedOptimizer, in memory (OptimizerState) and as
// bytes or a file.
//
// What it promises: state_to_bytes writes one format (below), and
// state_from_bytes reads back exactly what it wrote, or refuses with
// std::invalid_argument naming the source and what is wrong (another file,
// a truncated or altered one, a field no checkpoint holds); it never reads
// past the end. Its neighbours: DistributedOptimizer::state_dict() makes an
// OptimizerState from every owner's archive and load_state_dict() hands the
// parts back to their owners (optim/distributed_optimizer.h); each part's
// bytes are the owner's LibTorch archive, opaque here and read by the owner.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/optim/options.h"

namespace tandem::optim {

// A checkpoint of a DistributedOptimizer: every owner's LibTorch optimizer,
// serialized there (Optimizer::save into a torch::serialize::OutputArchive),
// plus the learning rate. The parts follow the optimizer's owners() order;
// load_state_dict() takes it only into an optimizer of the same kind over
// the same owners with as many parameters on each (the parameters of a
// fresh run: the state is matched to them by position, as in LibTorch).
// The hyper-parameters other than lr come from the loading optimizer's
// Options (LibTorch's own load keeps them too).
struct OptimizerState {
  struct Part {
    int rank = -1;           // the owner
    std::string worker;      // its name (for messages)
    int64_t num_params = 0;  // parameters this owner steps
    std::string bytes;       // its OutputArchive, as written by save_to()
  };
  Kind kind = Kind::kSGD;
  double lr = 0;
  std::vector<Part> parts;
};

// One OptimizerState in one file, and back. The format (little-endian):
//   "TANDEM-OPTIM-STATE\n", u32 version (1), i64 kind, f64 lr, u64 parts,
//   per part: i64 rank, u64 n + n bytes of worker name, i64 num_params,
//             u64 n + n bytes of state;
//   u64 FNV-1a hash of everything before it.
// save_state writes a temporary file beside `path` and renames it over
// `path`, so a crash never leaves half a checkpoint. Errors name the path:
// std::runtime_error when the file cannot be opened or written,
// std::invalid_argument when what is read is not such a checkpoint
// (another file, truncated, corrupt).
void save_state(const OptimizerState& state, const std::string& path);
OptimizerState load_state(const std::string& path);
// The same bytes, for a checkpoint of one's own that holds more than the
// optimizer (examples/char_lm/checkpoint.cc). `source` names the bytes in errors.
// Beyond the hash, state_from_bytes refuses, naming the field: a version
// other than 1, an unknown kind, a learning rate that is NaN or negative,
// a rank outside 0..INT_MAX or given twice, a negative parameter count,
// and a length or count that runs past the end.
std::string state_to_bytes(const OptimizerState& state);
OptimizerState state_from_bytes(const std::string& data,
                                const std::string& source = "the optimizer state");

}  // namespace tandem::optim
