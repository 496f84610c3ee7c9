#pragma once
// Whole-job checkpoints on disk: every rank writes its own part of a step,
// in parallel, into one directory per step, and one coordinator commits
// the step atomically with a manifest.
//
//   checkpoint::Part mine;
//   mine.add("0.weight", stage_weight);           // named tensors (any CPU dtype)
//   mine.add_bytes("sampler", sampler_state);     // and named bytes
//   checkpoint::SaveOptions o;
//   o.keep = 3;
//   o.meta = {{"layout", "pp=2 dp=2"}};
//   checkpoint::save("ckpt", step, mine, o);      // collective over o.group
//   ...
//   if (auto found = checkpoint::latest("ckpt")) {
//     checkpoint::Reader r(found->path);
//     at::Tensor w = r.tensor("0.weight");        // from whichever part holds it
//   }
//
// What it promises:
//  1. Layout: DIR/step-NNNNNNNNNN/ holds part-R.bin for every rank R that
//     saved and MANIFEST. A part is written to part-R.bin.tmp, flushed to
//     disk (fsync) and renamed; once every rank's part is in, rank 0 writes
//     MANIFEST.tmp (each part's size and FNV-1a checksum; each entry's part,
//     dtype, shape, offset and size; the world size; the caller's meta),
//     fsyncs it, renames it to MANIFEST and fsyncs the directory. A step
//     directory without a valid MANIFEST is not a checkpoint. Then the
//     complete checkpoints beyond the newest `keep` are removed, and so are
//     incomplete directories older than the newest complete one.
//  2. save() is collective over the group (every rank calls it with the
//     same dir and step); it returns on every rank once the step is
//     committed, or throws on every rank when any rank's part or the
//     manifest could not be written (naming the rank and the file).
//  3. latest(dir) is the newest step with a valid manifest; each newer
//     directory it passed over is named in Found::skipped with the reason.
//     With LatestOptions::verify it is the newest whose every part is
//     whole too (each read and checked against the manifest's size and
//     checksum), so that a restart goes back one step past a damaged one
//     instead of failing on it; refuse_damaged makes a damaged newest step
//     an error instead.
//  4. Reader checks the manifest when made and a part's size and checksum
//     the first time it reads from it: a missing, truncated, altered or
//     foreign part, or an altered manifest, is std::invalid_argument naming
//     the file and what is wrong. expect_meta() compares a meta value (a
//     model's fingerprint, say) and names both when they differ.
//  5. Names are non-empty, without whitespace, unique within a step (two
//     ranks saving one name is an error at save, naming both ranks).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/rpc/future.h"

namespace tandem::ddp {
class ProcessGroup;
}

namespace tandem::checkpoint {

// One rank's part of a step.
class Part {
 public:
  // The tensor's values (moved to the CPU, made contiguous) at the time of
  // the call.
  Part& add(const std::string& name, const at::Tensor& tensor);
  Part& add_bytes(const std::string& name, std::string bytes);
  // Bytes made when the part is written (by an AsyncSaver, on its thread):
  // `make` must own whatever it reads (a copy taken now, such as
  // optim::param_state_snapshot's), since the state may change meanwhile.
  Part& add_bytes_later(const std::string& name, std::function<std::string()> make);

  struct Entry {
    std::string name;
    bool is_tensor = false;
    at::Tensor tensor;  // CPU, contiguous
    std::string bytes;
    std::function<std::string()> later;  // when set, makes `bytes` at write time
  };
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  std::vector<Entry> entries_;
};

struct SaveOptions {
  // The ranks that save together; null: this process alone (world 1).
  std::shared_ptr<ddp::ProcessGroup> group;
  int keep = 2;  // complete checkpoints kept (>= 1)
  // Written into the manifest: the layout, a model's fingerprint, the step's
  // metrics. Keys without whitespace; values without newlines.
  std::map<std::string, std::string> meta;
};

void save(const std::string& dir, int64_t step, const Part& mine, const SaveOptions& options = {});

// A part written by another worker, where its state lives (a RemoteModule's
// owner: checkpoint/remote.h). The writer asks that worker, without waiting,
// to copy the state into its host memory and write it as part `part` of
// `dir`'s step in the background. copied() blocks until the copy is made
// (so the state may change after it), written() until the part is durable,
// and answers its index; both throw the worker's error.
//
// A worker whose steps update the state in place (an optimizer owner's
// parameters and optimizer state) copies each part in one moment, but
// several parts in several calls, between which a step can fall (another
// client's). Such a part names the worker (`where`) and answers, once
// copied, the moment of its copy (`moment`: the steps that worker had
// taken); save_parts writes a worker's parts again, all of them, until
// they are of one moment. Empty / null: a part with no such worker.
struct RemotePart {
  std::function<void()> copied;
  std::function<std::string()> written;
  std::string where;
  std::function<int64_t()> moment;
};
using RemotePartWriter = std::function<RemotePart(const std::string& dir, int64_t step, int part)>;

// save() with parts written elsewhere too: each rank writes its own part
// (numbered by its rank, of W) and asks for its remote ones (rank r's k-th
// numbered W * (k + 1) + r), all at once; once every part is durable, rank
// 0 commits the step. Collective over options.group, as save() is; a remote
// writer's error fails the save on every rank, naming it.
void save_parts(const std::string& dir, int64_t step, const Part& mine,
                const std::vector<RemotePartWriter>& remote, const SaveOptions& options = {});

// The two halves of a save, for parts written by processes no process group
// joins. write_part writes `state` as part `part` of `dir`'s step (to a
// temporary name, fsynced, renamed) and returns its index, a text; commit
// checks that `indexes` (every part's, in any grouping) hold the ranks'
// parts 0 to ranks - 1, no part twice and no name twice, then writes the
// manifest and prunes as save() does.
std::string write_part(const std::string& dir, int64_t step, int part, const Part& state);
void commit(const std::string& dir, int64_t step, int ranks,
            const std::vector<std::string>& indexes, const SaveOptions& options = {});

// Saves in the background: the step waits only for its state to be copied
// into host memory (Part::add does that) and, when the save before has not
// finished, for that one.
//
//   checkpoint::AsyncSaver saver(dir, options);   // options.group: the saver's own
//   ...
//   checkpoint::Part part;                         // copies now
//   part.add("w", w);
//   saver.save(step, std::move(part));             // returns once the write has begun
//   ...                                            // training goes on
//   saver.wait();                                  // durable: committed
//
// 1. save() first waits for the save in flight to be committed and rethrows
//    its error (that step was not committed: latest() still names the one
//    before). Then a thread of the saver writes and commits the part as
//    save() would.
// 2. The saver's collectives run on that thread: options.group must be one
//    that nothing else uses while a save is in flight (make one for it,
//    ProcessGroupOptions::group_name "checkpoint", say). Every rank saves
//    the same steps, in the same order.
// 3. The destructor waits for the save in flight; an error nobody took is
//    written to stderr.
class AsyncSaver {
 public:
  AsyncSaver(std::string dir, SaveOptions options = {});
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  void save(int64_t step, Part part);
  // With parts written elsewhere (save_parts): their copies are made before
  // this returns (their workers write them in the background, as the
  // saver's thread writes `part`), and the saver's thread commits the step
  // once every part is durable.
  void save(int64_t step, Part part, const std::vector<RemotePartWriter>& remote);
  // Blocks until the save in flight (if any) is committed; rethrows its error.
  void wait();
  bool in_flight() const;
  // How long the last save() waited for the one before it (0: it was done).
  double last_wait_ms() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct Found {
  int64_t step = 0;
  std::string path;                  // DIR/step-NNNNNNNNNN
  std::vector<std::string> skipped;  // newer directories passed over, and why
};
struct LatestOptions {
  // Read every part of a candidate step and check it against its manifest
  // (3.): a step with a part missing, truncated or altered is passed over,
  // named in Found::skipped with the file and what is wrong. Reads the
  // whole step once per call.
  bool verify = false;
  // With verify: a damaged newest step throws std::invalid_argument
  // (naming the step, the file and what is wrong) instead of being passed over.
  bool refuse_damaged = false;
  // Where to put the directories passed over also when no step is found
  // (Found::skipped has them otherwise); may be null.
  std::vector<std::string>* passed_over = nullptr;
  static LatestOptions verified(bool refuse = false) { return {true, refuse, nullptr}; }
};
std::optional<Found> latest(const std::string& dir, const LatestOptions& options = {});

// Which round of a restarted job this is: TANDEM_RESTART_COUNT (tandem-run
// --max-restarts), else TORCHELASTIC_RESTART_COUNT (torchrun), else 0.
int restart_count();

// Removes every step directory in `dir` (a fresh run must not be taken for
// the continuation of an older one's steps after a restart); returns how
// many.
int remove_steps(const std::string& dir);

// The directory of `step` under `dir`.
std::string step_path(const std::string& dir, int64_t step);

class Reader {
 public:
  // Reads and checks PATH/MANIFEST.
  explicit Reader(const std::string& path);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  int64_t step() const;
  // One more than the step's highest part number (the ranks that saved are
  // 0 to W - 1; parts written for them elsewhere come after).
  int world_size() const;
  // The step's directory, as given.
  const std::string& path() const;
  // Reads every part once (streaming, nothing kept) and checks its size and
  // checksum against the manifest: std::invalid_argument naming the first
  // file that is missing, truncated or altered (4.).
  void verify() const;
  std::vector<std::string> names() const;  // every entry, sorted
  bool contains(const std::string& name) const;
  at::Tensor tensor(const std::string& name) const;
  // A tensor entry's shape, from the manifest (nothing read).
  std::vector<int64_t> shape(const std::string& name) const;
  // Reads and checks (size, checksum) the part that holds `name`, as the
  // first read from it would: a loader checks every part it will read
  // before it changes anything.
  void check(const std::string& name) const;
  std::string bytes(const std::string& name) const;
  // The rank whose part holds `name`.
  int rank_of(const std::string& name) const;
  const std::map<std::string, std::string>& meta() const;
  // std::invalid_argument naming the key and both values when the
  // manifest's value differs from `value` (or is missing).
  void expect_meta(const std::string& key, const std::string& value) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::checkpoint
