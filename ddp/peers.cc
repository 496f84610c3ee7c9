// Meeting a group's members and watching them (ddp/peers.h).
#include "tandem/ddp/peers.h"

#include <unistd.h>

#include <condition_variable>
#include <fstream>
#include <sstream>

#include "tandem/rpc/api.h"

namespace tandem::ddp {

std::string this_host() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

std::pair<std::string, char> proc_start_and_state(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string line;
  if (!std::getline(in, line)) return {"", 0};
  const auto close = line.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return {"", 0};
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  char state = 0;
  // After the name: state is field 3, start time field 22.
  for (int f = 3; f <= 22 && rest >> field; ++f) {
    if (f == 3) state = field.empty() ? 0 : field[0];
    if (f == 22) return {field, state};
  }
  return {"", state};
}

std::string wait_watching(c10d::Work& work, const std::function<std::string()>& stalled,
                          std::chrono::milliseconds limit) {
  struct Ended {
    std::mutex mu;
    std::condition_variable cv;
    bool ended = false;
  };
  auto ended = std::make_shared<Ended>();
  try {
    work.getFuture()->addCallback([ended](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(ended->mu);
      ended->ended = true;
      ended->cv.notify_all();
    });
  } catch (const std::exception&) {
    return {};  // this backend's work has no future: only Work::wait knows
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::unique_lock<std::mutex> lock(ended->mu);
  while (!ended->ended) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return {};
    ended->cv.wait_for(lock, std::min<std::chrono::steady_clock::duration>(
                                 std::chrono::milliseconds(200), deadline - now));
    if (ended->ended) break;
    lock.unlock();
    std::string why = stalled();
    lock.lock();
    if (!why.empty()) return why;
  }
  return {};
}

std::shared_ptr<ProcessGroup::Peers> ProcessGroup::meet_peers(c10d::Store& store, int rank,
                                                              int size, std::string name) {
  auto peers = std::make_shared<Peers>();
  peers->rank = rank;
  peers->my_host = this_host();
  peers->store = c10::intrusive_ptr<c10d::Store>::reclaim_copy(&store);
  // Each incarnation of a group name adds `size`: every rank adds once
  // before any waits on the others, so all agree on the incarnation.
  peers->incarnation = (store.add("incarnations", 1) - 1) / size;
  if (name.empty()) {
    try {
      name = rpc::current_agent()->name();
    } catch (const std::logic_error&) {
      // no agent in this process: the rank alone names it
    }
  }
  const std::string pid = std::to_string(::getpid());
  const std::string me =
      name + "\n" + peers->my_host + "\n" + pid + "\n" + proc_start_and_state(pid).first;
  store.set(peers->key("who", rank), std::vector<uint8_t>(me.begin(), me.end()));
  for (int r = 0; r < size; ++r) {
    const auto bytes = store.get(peers->key("who", r));
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    Member m;
    std::string pid_text, start;
    std::getline(in, m.name);
    std::getline(in, m.host);
    std::getline(in, pid_text);
    std::getline(in, start);
    m.pid = std::strtoll(pid_text.c_str(), nullptr, 10);
    peers->members.push_back(std::move(m));
    peers->starts.push_back(std::move(start));
  }
  return peers;
}

void ProcessGroup::watch_peers() {
  if (backend_ != "gloo") return;  // (NCCL has its own watchdog)
  std::shared_ptr<rpc::Agent> agent;
  try {
    agent = rpc::current_agent();
  } catch (const std::logic_error&) {
    return;  // no agent in this process: collectives wait out their timeout
  }
  const std::string pid = std::to_string(::getpid());
  bool any = false;
  for (int r = 0; r < size_; ++r) {
    const Member& m = peers_->members[static_cast<size_t>(r)];
    // (ranks that are threads of this process cannot stall alone)
    if (r == rank_ || m.name.empty() || (m.host == peers_->my_host && std::to_string(m.pid) == pid)) {
      continue;
    }
    try {
      agent->watch(m.name);
      any = true;
    } catch (const std::exception&) {
      // (not a worker of this agent's world)
    }
  }
  if (any) peers_->watcher = agent;
}

}  // namespace tandem::ddp
