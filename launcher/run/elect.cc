// --rdzv-endpoint: the launchers elect their coordinator in etcd, so that no
// node's loss ends the job (launcher/run/nodes.cc runs the rounds once the
// coordinator is known; this file only decides who it is).
//
// Under "tandem/launch/<rdzv-id>/" etcd holds:
//   coordinator  "GEN ADDR:PORT": the launcher that coordinates, listening
//                at ADDR:PORT; GEN counts the coordinators so far;
//   state        "round NUMBER RESTARTS NNODES" as the last round started,
//                then "exit CODE" once the job ended.
// A launcher that finds no coordinator claims the key (an atomic create);
// one that finds one joins it as node 0's launcher is joined (the same
// handshake, the same cluster token). When the coordinator is lost (its
// connection closed or silent, or unreachable for 5 s), its followers stop
// their workers and each tries to replace the value it knew by its own
// (compare-and-set: one wins, the others follow the winner). The new
// coordinator goes on from the state: the lost round counts as failed
// (a restart of --max-restarts), and the next round starts with the nodes
// that are left (--nnodes MIN:MAX). A coordinator checks every second that
// etcd still names it; one that finds another named (it was cut off long
// enough to be replaced) stops its workers and leaves the job. etcd out of
// reach costs nothing while the coordinator lives (its calls from the loop
// wait 400 ms at most, and after a failure it asks every 5 s); etcd is
// needed only to start, and to replace a lost coordinator.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "launcher/run/io.h"
#include "launcher/run/join.h"
#include "launcher/run/launcher.h"

namespace tandem::launcher {

namespace {

// The address of this host's interface that routes to `host` (a UDP
// socket's connect sends nothing); empty when it cannot tell.
std::string address_towards(const std::string& host, const std::string& port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* list = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &list) != 0 || !list) return "";
  std::string out;
  const int fd = ::socket(list->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, list->ai_addr, list->ai_addrlen) == 0) {
    sockaddr_storage me{};
    socklen_t length = sizeof me;
    char text[INET6_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &length) == 0) {
      const void* raw = me.ss_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&me)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&me)->sin_addr);
      if (::inet_ntop(me.ss_family, raw, text, sizeof text)) out = text;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(list);
  return out;
}

// "GEN ADDR:PORT" -> its parts; false when it is not shaped so.
bool parse_coordinator(const std::string& value, int& gen, std::string& addr, int& port) {
  const std::vector<std::string> w = words_of(value);
  if (w.size() != 2) return false;
  const std::optional<int> g = integer(w[0]);
  const size_t colon = w[1].rfind(':');
  if (!g || colon == std::string::npos) return false;
  const std::optional<int> p = integer(w[1].substr(colon + 1));
  if (!p || *p < 1 || *p > 65535) return false;
  gen = *g;
  addr = w[1].substr(0, colon);
  port = *p;
  return true;
}

}  // namespace

std::string Launcher::etcd_key(const std::string& name) const {
  return "tandem/launch/" + options_.rdzv_id + "/" + name;
}

void Launcher::elect(const std::string& lost) {
  const Clock::time_point now = Clock::now();
  try {
    if (!etcd_) {
      etcd_ = std::make_unique<rpc::EtcdClient>(options_.rdzv_endpoint);
      elect_deadline_ = now + std::chrono::seconds(options_.join_timeout_s);
    }
    if (now >= elect_deadline_) {
      report("no coordinator could be elected or reached in etcd within --join-timeout " +
             std::to_string(options_.join_timeout_s) + " s");
      finish(kExitFailure);
      return;
    }
    if (options_.local_addr.empty()) {
      const std::string& first = etcd_->endpoints().front();
      const size_t colon = first.rfind(':');
      options_.local_addr = address_towards(first.substr(0, colon), first.substr(colon + 1));
      if (options_.local_addr.empty()) {
        report("cannot tell this host's address towards etcd (" + first + "): pass --local-addr");
        finish(kExitFailure);
        return;
      }
    }
    // This launcher's listener: the coordinator's if it wins.
    if (listen_fd_ < 0) listen_fd_ = listen_on(options_.local_addr, 0);
    const std::string mine_at = options_.local_addr + ":" + std::to_string(bound_port(listen_fd_));
    const std::string key = etcd_key("coordinator");
    for (int tries = 0; tries < 100; ++tries) {
      const std::optional<std::string> current = etcd_->get(key);
      int gen = 0, port = 0;
      std::string addr;
      if (current && !parse_coordinator(*current, gen, addr, port)) {
        report("etcd's " + key + " holds " + quoted(*current) +
               ", not a coordinator: another program's key? pass another --rdzv-id");
        finish(kExitFailure);
        return;
      }
      if (!current || (!lost.empty() && *current == lost)) {
        const std::string claim = std::to_string(gen + 1) + " " + mine_at;
        if (etcd_->swap(key, current, claim)) {
          become_coordinator(claim, gen + 1);
          return;
        }
        continue;  // another claimed it first: follow that one
      }
      // Follow it (this launcher's listener is not needed then).
      ::close(listen_fd_);
      listen_fd_ = -1;
      followed_ = *current;
      options_.node_rank = -1;
      options_.master_addr = addr;
      options_.master_port = port;
      // (unreachable for as long as a silent one is given: lost)
      connect_deadline_ = now + kCoordinatorSilence;
      next_connect_ = now;
      report("following the coordinator in etcd at " + addr + ":" + std::to_string(port) +
             " (generation " + std::to_string(gen) + ")");
      return;
    }
    report("etcd's " + key + " kept changing under 100 tries to claim or follow it");
  } catch (const std::exception& e) {
    report("electing a coordinator in etcd: " + std::string(e.what()));
  }
  finish(kExitFailure);
}

void Launcher::become_coordinator(const std::string& claim, int gen) {
  options_.node_rank = 0;
  options_.master_addr = options_.local_addr;
  options_.master_port = bound_port(listen_fd_);
  leading_ = claim;
  next_leadership_check_ = Clock::now() + kCoordinatorHeartbeat;
  report("this node's launcher coordinates the job (elected in etcd, generation " +
         std::to_string(gen) + ") on " + options_.master_addr + ":" +
         std::to_string(options_.master_port) + "; waiting for " + nodes_wanted());
  // Where the job stands: a coordinator before this one ran its rounds.
  const std::optional<std::string> state = etcd_->get(etcd_key("state"));
  const std::vector<std::string> w = state ? words_of(*state) : std::vector<std::string>{};
  if (w.size() == 2 && w[0] == "exit" && integer(w[1])) {
    report("the job had ended already (exit " + w[1] + ")");
    finish(*integer(w[1]));
    return;
  }
  if (w.size() == 4 && w[0] == "round" && integer(w[1]) && integer(w[2]) && integer(w[3])) {
    // The round the lost coordinator ran failed with it.
    round_.number = *integer(w[1]) + 1;
    round_.restarts = *integer(w[2]) + 1;
    last_round_nodes_ = *integer(w[3]);
    if (round_.restarts > options_.max_restarts || stopped_by_user_) {
      report("round " + w[1] + "'s coordinator was lost, and no restarts are left (--max-restarts " +
             std::to_string(options_.max_restarts) + ")");
      finish(kExitFailure);
      return;
    }
    report("round " + w[1] + "'s coordinator was lost; the job goes on (restart " +
           std::to_string(round_.restarts) + " of " + std::to_string(options_.max_restarts) + ")");
  }
  phase_ = Phase::kJoining;
  joining_since_ = Clock::now();
  enough_since_.reset();
}

// The coordinator's calls from its loop (the checks, the state) wait at most
// this long: the loop must go on pinging the nodes while etcd is away.
constexpr auto kLoopCallLimit = std::chrono::milliseconds(400);
// After a check that failed, the next waits this long.
constexpr auto kRecheckAfterTrouble = std::chrono::seconds(5);

rpc::EtcdClient& Launcher::loop_etcd() {
  if (!loop_etcd_) {
    loop_etcd_ = std::make_unique<rpc::EtcdClient>(options_.rdzv_endpoint, kLoopCallLimit);
  }
  return *loop_etcd_;
}

void Launcher::record_state(const std::string& state) {
  if (!etcd_ || leading_.empty()) return;
  try {
    loop_etcd().put(etcd_key("state"), state);
  } catch (const std::exception& e) {
    report("writing the job's state to etcd: " + std::string(e.what()) +
           " (a coordinator lost now could not be replaced)");
  }
}

void Launcher::check_leadership(Clock::time_point now) {
  if (leading_.empty() || now < next_leadership_check_ || finished_) return;
  next_leadership_check_ = now + kCoordinatorHeartbeat;
  std::optional<std::string> current;
  try {
    current = loop_etcd().get(etcd_key("coordinator"));
    etcd_trouble_logged_ = false;
  } catch (const std::exception& e) {
    next_leadership_check_ = now + kRecheckAfterTrouble;
    if (!etcd_trouble_logged_) {
      report("etcd is out of reach (" + std::string(e.what()) +
             "); the job goes on, but a coordinator lost now could not be replaced");
      etcd_trouble_logged_ = true;
    }
    return;
  }
  if (current && *current == leading_) return;
  // Replaced: this launcher was cut off long enough for the others to
  // elect another. Its node leaves the job.
  report("etcd names another coordinator (" + (current ? quoted(*current) : "none") +
         "): this launcher was replaced; its node leaves the job");
  leading_.clear();
  nodes_.clear();
  final_code_ = kExitFailure;
  phase_ = Phase::kStopping;
  if (round_active_) begin_shutdown(kExitFailure);
  check_round_over();
}

void Launcher::coordinator_lost(const std::string& why) {
  report("lost the coordinator at " + options_.master_addr + ":" +
         std::to_string(options_.master_port) + " (" + why +
         "); stopping this node's workers, then electing another in etcd");
  coordinator_.close();
  coordinator_nonce_.clear();
  joined_ = admitted_ = false;
  if (round_active_) {
    reelect_ = true;  // (once they are gone: local_round_over)
    begin_shutdown(kExitFailure);
  } else {
    elect(followed_);
  }
}

}  // namespace tandem::launcher
