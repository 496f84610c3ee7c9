// A checkpoint's MANIFEST (checkpoint/checkpoint.h): one encoder and one
// decoder that checks every line. Internal to the library.
//
// The format, one record a line, fields separated by one space:
//   tandem-checkpoint 1
//   step STEP
//   world N
//   meta KEY VALUE...                    (the value runs to the end of the line)
//   part RANK FILE BYTES FNV             (FNV: the file's FNV-1a 64, 16 hex digits)
//   tensor RANK NAME DTYPE NDIM D0 .. OFFSET BYTES
//   blob RANK NAME OFFSET BYTES
//   fnv FNV                              (of every byte before this line)
// A part file is "TANDEM-CKPT-PART\n" followed by its entries' bytes, at the
// offsets the manifest gives.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tandem/checkpoint/checkpoint.h"

namespace tandem::checkpoint::detail {

constexpr char kPartMagic[] = "TANDEM-CKPT-PART\n";
constexpr size_t kPartHeader = sizeof(kPartMagic) - 1;

uint64_t fnv1a(const char* data, size_t size, uint64_t h = 14695981039346656037ull);

struct EntryIndex {
  int rank = 0;
  std::string name;
  bool is_tensor = false;
  int64_t dtype = 0;  // c10::ScalarType's number
  std::vector<int64_t> shape;
  uint64_t offset = 0, bytes = 0;
};
struct PartIndex {
  int rank = 0;
  std::string file;
  uint64_t bytes = 0, fnv = 0;
};
struct Manifest {
  int64_t step = 0;
  int world = 1;
  std::map<std::string, std::string> meta;
  std::vector<PartIndex> parts;
  std::vector<EntryIndex> entries;
};

// One rank's lines (its part and entries), as save() gathers them.
std::string part_lines(const PartIndex& part, const std::vector<EntryIndex>& entries);
// The whole manifest from the header fields and every rank's lines.
std::string encode(const Manifest& head, const std::vector<std::string>& rank_lines);
// std::invalid_argument naming `source` and the line that is wrong.
Manifest decode(const std::string& text, const std::string& source);

// A save's two halves (checkpoint.cc), so that AsyncSaver starts the
// remote parts in the caller's step (no collective) and finishes on its
// thread. The start asks for this rank's remote parts; an error there is
// kept for finish_save to agree on.
struct RemoteStart {
  int ranks = 1;
  std::vector<RemotePart> started;
  std::string error;
};
RemoteStart start_remote(const std::string& dir, int64_t step,
                         const std::vector<RemotePartWriter>& remote, const SaveOptions& options);
void finish_save(const std::string& dir, int64_t step, const Part& mine, RemoteStart remote,
                 const SaveOptions& options);

}  // namespace tandem::checkpoint::detail
