#include "tandem/rpc/rendezvous/worker_entry.h"

#include <sstream>
#include <stdexcept>

#include "tandem/rpc/common/log.h"

namespace tandem::rpc {
namespace {

std::string cuda(int i) { return "cuda:" + std::to_string(i); }

const std::map<int, int>* find_map(const std::map<std::string, std::map<int, int>>& maps,
                                   const std::string& to) {
  auto it = maps.find(to);
  return it == maps.end() ? nullptr : &it->second;
}

std::map<int, int> inverse(const std::map<int, int>& map) {
  std::map<int, int> out;
  for (auto [from, dst] : map) out[dst] = from;
  return out;
}

}  // namespace

std::string join_worker(const WorkerInfo& w) {
  std::string s = w.name + "\t" + w.host + "\t" + std::to_string(w.port) + "\t" + w.local + "\n" +
                  std::to_string(w.cuda_devices) + "\t" + w.process;
  for (const auto& [to, map] : w.device_maps) {
    s += "\n" + to;
    for (auto [from, dst] : map) s += "\t" + std::to_string(from) + "\t" + std::to_string(dst);
  }
  return s;
}

WorkerInfo split_worker(const std::string& s, int rank) {
  std::istringstream in(s);
  WorkerInfo w;
  std::string port;
  if (!std::getline(in, w.name, '\t') || !std::getline(in, w.host, '\t') ||
      !std::getline(in, port, '\t')) {
    throw std::runtime_error("malformed rendezvous entry for rank " + std::to_string(rank));
  }
  std::getline(in, w.local);  // absent or empty: no same-host path
  w.rank = rank;
  try {
    w.port = std::stoi(port);
  } catch (const std::exception&) {
    throw std::runtime_error("malformed rendezvous entry for rank " + std::to_string(rank) +
                             ": port '" + printable(port) + "'");
  }
  std::string line;
  try {
    if (std::getline(in, line)) {
      const auto tab = line.find('\t');
      w.cuda_devices = std::stoi(line.substr(0, tab));
      if (tab != std::string::npos) w.process = line.substr(tab + 1);
    }
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string to, from, dst;
      std::getline(fields, to, '\t');
      auto& map = w.device_maps[to];
      while (std::getline(fields, from, '\t') && std::getline(fields, dst, '\t')) {
        map[std::stoi(from)] = std::stoi(dst);
      }
    }
  } catch (const std::exception&) {
    throw std::runtime_error("malformed rendezvous entry for rank " + std::to_string(rank) +
                             ": devices '" + printable(line) + "'");
  }
  return w;
}

void check_device_maps(const std::vector<WorkerInfo>& workers,
                       const std::unordered_map<std::string, int>& rank_of) {
  for (const WorkerInfo& w : workers) {
    for (const auto& [to, map] : w.device_maps) {
      const std::string whose = w.name + "'s device map to '" + printable(to) + "'";
      auto r = rank_of.find(to);
      if (r == rank_of.end()) throw std::invalid_argument(whose + ": there is no such worker");
      if (r->second == w.rank) throw std::invalid_argument(whose + ": a map to itself");
      const WorkerInfo& peer = workers[r->second];
      std::map<int, int> back;
      for (auto [from, dst] : map) {
        if (from >= w.cuda_devices) {
          throw std::invalid_argument(whose + " names " + cuda(from) + ", but " + w.name + " has " +
                                      std::to_string(w.cuda_devices) + " CUDA device(s)");
        }
        if (dst >= peer.cuda_devices) {
          throw std::invalid_argument(whose + " maps " + cuda(from) + " to " + cuda(dst) +
                                      ", but " + peer.name + " has " +
                                      std::to_string(peer.cuda_devices) + " CUDA device(s)");
        }
        auto [it, fresh] = back.emplace(dst, from);
        if (!fresh) {
          throw std::invalid_argument(whose + " maps both " + cuda(it->second) + " and " +
                                      cuda(from) + " to " + cuda(dst) +
                                      ": answers could not find their way back");
        }
      }
    }
  }
}

void route_device_maps(const std::vector<WorkerInfo>& workers, int rank,
                       std::vector<DeviceMap>& send, std::vector<DeviceMap>& answer) {
  const int world = static_cast<int>(workers.size());
  send.assign(world, {});
  answer.assign(world, {});
  const std::string& self = workers[rank].name;
  for (int r = 0; r < world; ++r) {
    const auto* mine = find_map(workers[rank].device_maps, workers[r].name);
    const auto* theirs = find_map(workers[r].device_maps, self);
    send[r].peer = answer[r].peer = workers[r].name;
    send[r].cuda = mine ? *mine : theirs ? inverse(*theirs) : std::map<int, int>();
    answer[r].cuda = theirs ? inverse(*theirs) : mine ? *mine : std::map<int, int>();
  }
}

}  // namespace tandem::rpc
