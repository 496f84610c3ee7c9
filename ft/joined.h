// A replica's join of a quorum, as the members' record gives it (internal
// to ft/: manager.cc forms quorums of them, heal.cc heals by them).
#pragma once

#include <cstdint>
#include <string>

#include "tandem/ft/manager.h"

namespace tandem::ft {

struct Manager::Joined {
  int id = 0;  // the process's index: replica id * replica_size + replica_rank
  int64_t step = 0;    // its committed steps
  int64_t cursor = 0;  // its position in the sample stream
  std::string signature;
  // Its process (ft/heartbeat.h): where, which, and since when.
  std::string host;
  int64_t pid = 0;
  std::string start;
};

}  // namespace tandem::ft
