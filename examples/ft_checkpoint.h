// A replica's checkpoint under tandem::ft::Manager (--checkpoint-every N),
// shared by ft_mlp and gpt --ft: every N committed steps the quorum's
// first replica writes it, and a job restarted as a whole (no quorum left:
// tandem-run --max-restarts) reads the newest back, and its Manager goes
// on from that step and sample stream.
//
//   examples::RankState mine{names, params, &adam};
//   examples::ReplicaCheckpoint ck{dir, every, "hsdp 2", /*per_rank=*/true};
//   examples::resume_newest(ck, manager, mine);   // before the first step
//   ...
//   if (committed) examples::save_every(ck, manager, mine);
//
// Each tensor goes under its name, its Adam state under "adam/<name>",
// both under "rank<r>/" when a replica is several processes (per_rank:
// its ranks write together, over replica_group(); a partner gone means no
// checkpoint that time, said on stdout, the step still committed); the
// replica's first rank adds "samples_done". `layout`, non-empty, is kept in
// the metadata and a checkpoint of another layout is refused by name.
#pragma once

#include <torch/optim/adam.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "examples/ft_lines.h"
#include "tandem/checkpoint/checkpoint.h"
#include "tandem/ft/manager.h"
#include "tandem/optim/param_state.h"

namespace examples {

// One process's share of a replica: its tensors by name, and their optimizer.
struct RankState {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  torch::optim::Adam* opt = nullptr;
};

// "p0", "p1", ...: names for a list of parameters.
inline std::vector<std::string> indexed_names(size_t n) {
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) out.push_back("p" + std::to_string(i));
  return out;
}

struct ReplicaCheckpoint {
  std::string dir;
  int64_t every = 0;   // 0: none written, none read
  std::string layout;  // "" for a replica of one process
  bool per_rank = false;
  std::string program;  // kept in the metadata when set
};

inline tandem::checkpoint::Part state_part(const RankState& s, const std::string& prefix = "") {
  tandem::checkpoint::Part part;
  for (size_t i = 0; i < s.names.size(); ++i) {
    part.add(prefix + s.names[i], s.params[i]);
    part.add_bytes(prefix + "adam/" + s.names[i],
                   tandem::optim::param_state_bytes(*s.opt, s.params[i]));
  }
  return part;
}

inline void load_state(const tandem::checkpoint::Reader& r, const RankState& s,
                       const std::string& prefix = "") {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < s.names.size(); ++i) {
    const_cast<at::Tensor&>(s.params[i]).copy_(r.tensor(prefix + s.names[i]));
    tandem::optim::load_param_state(*s.opt, s.params[i], r.bytes(prefix + "adam/" + s.names[i]));
  }
}

inline std::string rank_prefix(const ReplicaCheckpoint& c, const tandem::ft::Manager& m) {
  return c.per_rank ? "rank" + std::to_string(m.replica_rank()) + "/" : "";
}

// After a committed step: the checkpoint, when the step is one of every N
// and this process is of the quorum's first replica.
inline void save_every(const ReplicaCheckpoint& c, const tandem::ft::Manager& m,
                       const RankState& s) {
  if (c.every <= 0 || m.step() % c.every != 0 || m.participant_rank() != 0) return;
  tandem::checkpoint::Part part = state_part(s, rank_prefix(c, m));
  if (m.replica_rank() == 0) part.add_bytes("samples_done", std::to_string(m.samples_done()));
  tandem::checkpoint::SaveOptions so;
  if (c.per_rank) so.group = m.replica_group();
  if (!c.program.empty()) so.meta["program"] = c.program;
  if (!c.layout.empty()) so.meta["layout"] = c.layout;
  try {
    tandem::checkpoint::save(c.dir, m.step(), part, so);
  } catch (const std::exception& e) {
    if (!c.per_rank) throw;  // (one process: nobody else's failure to blame)
    std::printf("checkpoint of step %lld not written: %s\n", static_cast<long long>(m.step()),
                e.what());
    std::fflush(stdout);
  }
}

// The newest checkpoint read back into `s` and the Manager's step and
// sample stream ("resumed S" printed). False when there is none.
inline bool resume_newest(const ReplicaCheckpoint& c, tandem::ft::Manager& m,
                          const RankState& s) {
  if (c.every <= 0) return false;
  const auto found = tandem::checkpoint::latest(c.dir);
  if (!found) return false;
  const tandem::checkpoint::Reader r(found->path);
  if (!c.layout.empty()) r.expect_meta("layout", c.layout);
  load_state(r, s, rank_prefix(c, m));
  m.restore(found->step, std::stoll(r.bytes("samples_done")));
  std::printf("resumed %lld t %lld\n", static_cast<long long>(found->step),
              static_cast<long long>(wall_ms()));
  std::fflush(stdout);
  return true;
}

}  // namespace examples
