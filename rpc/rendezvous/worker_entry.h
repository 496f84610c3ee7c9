// What each worker publishes at the rendezvous (its entry in the store under
// "tandem/worker/<rank>"), and the device maps read from everyone's entries.
//
// An entry is text: name, host, port and same-host endpoint on the first
// line, the number of CUDA devices and the process id on the second, then a
// line per device map (the worker it leads to, then pairs of device
// indices), tab-separated (names hold no tab or newline). Entries come from
// peers: split_worker() checks what it parses and names the rank whose
// entry is malformed.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "tandem/rpc/agent.h"
#include "tandem/rpc/wire/wire.h"

namespace tandem::rpc {

std::string join_worker(const WorkerInfo& w);
// Throws std::runtime_error naming `rank` for a malformed entry.
WorkerInfo split_worker(const std::string& s, int rank);

// Every worker's device maps, checked against both ends' devices
// (AgentOptions::device_maps). The same on every worker, so all refuse a
// bad map alike, naming whose it is (std::invalid_argument).
void check_device_maps(const std::vector<WorkerInfo>& workers,
                       const std::unordered_map<std::string, int>& rank_of);

// Where CUDA tensors go from worker `rank` to each worker, by rank: calls
// go by this worker's map, else back along the peer's; answers go back
// along the caller's map, else by ours.
void route_device_maps(const std::vector<WorkerInfo>& workers, int rank,
                       std::vector<DeviceMap>& send, std::vector<DeviceMap>& answer);

// A string as the bytes a c10d store keeps.
inline std::vector<uint8_t> store_bytes(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace tandem::rpc
