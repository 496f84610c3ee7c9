// Coordinated jobs (launcher/run/launcher.h): several nodes that restart
// together, or an elastic number of them (--nnodes MIN:MAX).
//
// Node 0's launcher is the coordinator. It listens on MASTER_ADDR:MASTER_PORT
// for the other nodes' launchers, which connect and join: both prove the
// cluster token to each other, node 0 first, and MAC every line after
// (launcher/run/join.h has the steps, join.cc runs them).
// Each round node 0 admits the nodes that are there, gives them their
// group ranks in --node-rank order, hosts a fresh rendezvous store on a
// free port, and tells every node to start its workers ("round NUMBER
// RESTARTS NNODES GROUP_RANK STORE_PORT"). A node reports a failed worker
// ("failed ..."), that all its workers exited 0 ("done N") or that they
// are gone after a stop ("stopped N"). When a worker fails anywhere, or a
// node's launcher is gone (its connection closed, or 5 s without a word;
// both sides send "ping" every second), the coordinator stops every node's
// workers ("stop N"), waits until they are gone, and starts the next round,
// up to --max-restarts times after failures; then the job ends ("exit
// CODE"). A round waits for --nnodes MAX nodes, or goes on with MIN or more
// once --last-call has passed (a node of the last round that is gone is
// given that long to come back); a node that joins while a round runs with
// fewer than MAX starts a new round with it, as torchrun's agent does, and
// that does not count as a restart. A node that loses the coordinator stops
// its workers and exits 1: the job cannot go on without its store.
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <sstream>

#include "launcher/run/io.h"
#include "launcher/run/join.h"
#include "launcher/run/launcher.h"
#include "tandem/rpc/common/log.h"

namespace tandem::launcher {

namespace {

constexpr auto kHeartbeat = kCoordinatorHeartbeat;
constexpr auto kSilenceLimit = kCoordinatorSilence;
constexpr auto kConnectRetry = std::chrono::milliseconds(250);
// How long a node has to report its workers gone after a stop: the
// launcher's SIGKILL after 5 s and its 2 s drain, and a margin.
constexpr auto kStopLimit = std::chrono::seconds(15);

}  // namespace

int Launcher::run_coordinated() {
  const Clock::time_point now = Clock::now();
  if (elected()) {
    elect("");  // node 0 or a follower, or the job ended (elect.cc)
  } else {
    if (options_.node_rank < 0) {
      // No --node-rank: node 0 is the launcher that can listen at the
      // master's address; the others join and are numbered by it.
      // (in use: node 0 is up; not this host's address: node 0 is elsewhere;
      // anything else is this host's trouble, thrown as it is)
      int in_use_or_elsewhere = 0;
      listen_fd_ = listen_on(options_.master_addr, options_.master_port, &in_use_or_elsewhere);
      if (listen_fd_ >= 0) options_.node_rank = 0;
    }
    if (options_.node_rank == 0) {
      if (listen_fd_ < 0) listen_fd_ = listen_on(options_.master_addr, options_.master_port);
      report("node 0 coordinates the job on " + options_.master_addr + ":" +
             std::to_string(options_.master_port) + "; waiting for " + nodes_wanted());
      phase_ = Phase::kJoining;
      joining_since_ = now;
      maybe_start_round();
    } else {
      connect_deadline_ = now + std::chrono::seconds(options_.join_timeout_s);
      next_connect_ = now;
    }
  }
  if (!finished_) node_tick();
  while (!finished_) {
    poll_once(node_descriptors());
    reap_workers();
    check_deadlines();
    if (round_active_ && live_workers_ == 0 && !has_open_pipes()) local_round_over();
    if (!finished_) node_tick();
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  // The last lines reach the peers whole: half-close, and read until they
  // close (briefly), so that nothing unread turns the close into a reset.
  const Clock::time_point until = Clock::now() + std::chrono::milliseconds(500);
  std::vector<Channel*> open;
  for (Node& node : nodes_) open.push_back(&node.channel);
  open.push_back(&coordinator_);
  for (Channel* c : open) {
    if (c->is_open()) ::shutdown(c->fd(), SHUT_WR);
  }
  while (Clock::now() < until) {
    std::vector<pollfd> fds;
    for (Channel* c : open) {
      if (c->is_open()) fds.push_back({c->fd(), POLLIN, 0});
    }
    if (fds.empty() || ::poll(fds.data(), fds.size(), 50) < 0) break;
    for (Channel* c : open) {
      if (c->is_open()) c->read_some();  // closes it at the peer's end
    }
  }
  if (!options_.trace_dir.empty()) join_traces();
  return exit_code_;
}

std::vector<std::pair<int, std::function<void()>>> Launcher::node_descriptors() {
  std::vector<std::pair<int, std::function<void()>>> out;
  // (not watched for a moment after accept() ran out of descriptors)
  if (listen_fd_ >= 0 && Clock::now() >= accept_paused_until_) {
    out.emplace_back(listen_fd_, [this] { accept_nodes(); });
  }
  // Reads only: what was read is acted on in node_tick(), which may drop
  // connections.
  for (Pending& pending : pending_) {
    const int fd = pending.channel.fd();
    out.emplace_back(fd, [this, fd] {
      for (Pending& p : pending_) {
        if (p.channel.fd() == fd) p.channel.read_some();
      }
    });
  }
  for (Node& node : nodes_) {
    const int fd = node.channel.fd();
    out.emplace_back(fd, [this, fd] {
      for (Node& n : nodes_) {
        if (n.channel.fd() == fd) n.channel.read_some();
      }
    });
  }
  if (coordinator_.is_open())
    out.emplace_back(coordinator_.fd(), [this] { coordinator_.read_some(); });
  return out;
}

void Launcher::node_tick() {
  const Clock::time_point now = Clock::now();
  if (options_.node_rank != 0) {
    // Another node: keep to node 0's launcher, or find it.
    // What arrived before the connection closed is read first (a refusal,
    // the job's end).
    while (std::optional<std::string> line = coordinator_.next_line()) {
      on_coordinator_line(*line);
      if (finished_) return;
    }
    report_refused_lines(coordinator_, "node 0's launcher");
    if (reelect_) return;  // (its workers are being stopped; elect.cc goes on then)
    if (!coordinator_.is_open()) {
      if (joined_ && elected()) {
        coordinator_lost(coordinator_.why().empty() ? "connection closed" : coordinator_.why());
      } else if (joined_) {
        if (!final_code_) {
          report("lost node 0's launcher at " + options_.master_addr + ":" +
                 std::to_string(options_.master_port) + " (" + coordinator_.why() +
                 "); stopping this node's workers");
          final_code_ = kExitFailure;
          if (round_active_) {
            begin_shutdown(kExitFailure);
          } else {
            finish(kExitFailure);
          }
        }
      } else if (now >= next_connect_) {
        connect_to_coordinator();
      }
      return;
    }
    if (now - coordinator_.heard() > kSilenceLimit) {
      // (what is waiting counts, this loop may have been held up: read and
      // taken, since only lines that verify are heard)
      coordinator_.read_some();
      while (std::optional<std::string> line = coordinator_.next_line()) {
        on_coordinator_line(*line);
        if (finished_) return;
      }
    }
    if (coordinator_.is_open() && now - coordinator_.heard() > kSilenceLimit && !joined_ &&
        coordinator_nonce_.empty()) {
      // Something listens at the master's port but never greeted: node 0's
      // tandem-run is not coordinating (its store, or its rank 0's, is there).
      if (elected()) {
        coordinator_lost("it sent no greeting");
        return;
      }
      report("the launcher at " + options_.master_addr + ":" +
             std::to_string(options_.master_port) + " sent no tandem-run greeting in " +
             seconds_text(std::chrono::duration_cast<std::chrono::seconds>(kSilenceLimit)) +
             ": node 0's tandem-run does not coordinate this job: " + coordination_rule(options_) +
             ": start every node's launcher with the same --nnodes and --max-restarts");
      coordinator_.close();
      finish(kExitFailure);
      return;
    }
    if (coordinator_.is_open() && now - coordinator_.heard() > kSilenceLimit) {
      report("node 0's launcher has been silent for " +
             seconds_text(std::chrono::duration_cast<std::chrono::seconds>(kSilenceLimit)));
      coordinator_.close();
      joined_ = true;  // handled as a loss on the next tick
      return;
    }
    if (joined_ && now - coordinator_.sent() >= kHeartbeat) coordinator_.send("ping");
    return;
  }

  // Node 0: still the coordinator etcd names (elect.cc)?
  check_leadership(now);
  if (finished_) return;
  // The connections that have not joined yet (join.cc).
  tick_pending(now);
  if (finished_) return;
  // The nodes: their messages, their silence, our heartbeat.
  for (size_t i = 0; i < nodes_.size();) {
    // (what arrived before a connection closed is read first)
    while (std::optional<std::string> line = nodes_[i].channel.next_line()) {
      on_node_line(nodes_[i], *line);
      if (finished_) return;
    }
    Node& node = nodes_[i];
    report_refused_lines(node.channel, "node " + std::to_string(node.node_rank));
    // (what is waiting in the socket counts: this loop may have been held
    // up; read and taken, since only lines that verify are heard)
    if (node.channel.is_open() && now - node.channel.heard() > kSilenceLimit) {
      node.channel.read_some();
      while (std::optional<std::string> line = nodes_[i].channel.next_line()) {
        on_node_line(nodes_[i], *line);
        if (finished_) return;
      }
    }
    std::string why;
    if (!node.channel.is_open()) {
      why = node.channel.why().empty() ? "connection closed" : node.channel.why();
    } else if (now - node.channel.heard() > kSilenceLimit) {
      why = "silent for " +
            seconds_text(std::chrono::duration_cast<std::chrono::seconds>(kSilenceLimit));
    }
    if (!why.empty()) {
      const int rank = node.node_rank;
      nodes_.erase(nodes_.begin() + static_cast<long>(i));
      on_node_lost(rank, why);
      if (finished_) return;
      continue;
    }
    if (now - node.channel.sent() >= kHeartbeat) node.channel.send("ping");
    ++i;
  }
  // A node that does not report its workers gone within the stop's grace
  // (a worker stuck in the kernel) is dropped, as a lost one.
  if (phase_ == Phase::kStopping && stop_deadline_ && now >= *stop_deadline_) {
    for (size_t i = 0; i < nodes_.size();) {
      if (nodes_[i].in_round && !nodes_[i].stopped) {
        report("node " + std::to_string(nodes_[i].node_rank) +
               "'s workers did not stop in time; it is dropped from the job");
        nodes_[i].channel.send("exit " + std::to_string(kExitFailure));
        nodes_.erase(nodes_.begin() + static_cast<long>(i));
        continue;
      }
      ++i;
    }
  }
  if (!finished_ && phase_ != Phase::kJoining) check_round_over();
  if (!finished_ && phase_ == Phase::kJoining) maybe_start_round();
}

void Launcher::on_node_line(Node& node, const std::string& line) {
  const std::vector<std::string> w = words_of(line, 4);
  if (w.empty() || w[0] == "ping") return;
  const std::string name = "node " + std::to_string(node.node_rank);
  // (-1: not a number; every number of the protocol is 0 or more)
  const int number = w.size() >= 2 ? integer(w[1]).value_or(-1) : -1;
  if (w[0] == "failed" && w.size() == 4 && number >= 0 && integer(w[2])) {
    if (number == round_.number && phase_ == Phase::kRunning) {
      round_failed(rpc::printable(w[3], 300) + " (" + name + ")",
                   integer(w[2]).value_or(kExitFailure), true);
    } else if (number == round_.number) {
      report(rpc::printable(w[3], 300) + " (" + name + "), while the round was being stopped");
    }
  } else if (w[0] == "done" && number >= 0) {
    if (number == round_.number && node.in_round) node.done = true;
  } else if (w[0] == "stopped" && number >= 0) {
    if (number == round_.number && node.in_round) {
      node.stopped = true;
      // (unasked: its workers were stopped without a failure reported)
      if (phase_ == Phase::kRunning) round_failed(name + "'s workers stopped", kExitFailure, true);
    }
  } else if (w[0] == "quit" && number >= 0) {
    stopped_by_user_ = true;
    if (phase_ == Phase::kRunning) {
      round_failed(name + "'s launcher was stopped by a signal", number, false);
    } else if (phase_ == Phase::kStopping) {
      final_code_ = number;
    } else {
      report(name + "'s launcher was stopped by a signal");
      finish(number);
    }
  } else {
    report("unexpected message from " + name + ": " + quoted(line));
  }
}

std::string Launcher::nodes_wanted() const {
  return (options_.min_nodes == options_.nnodes
              ? std::to_string(options_.nnodes)
              : std::to_string(options_.min_nodes) + " to " + std::to_string(options_.nnodes)) +
         " node(s)";
}

int Launcher::nodes_in_round() const {
  int count = 1;  // node 0
  for (const Node& node : nodes_) count += node.in_round ? 1 : 0;
  return count;
}

void Launcher::on_node_lost(int node_rank, const std::string& why) {
  const std::string what =
      "node " + std::to_string(node_rank) + "'s launcher is gone (" + why + ")";
  // (erased already: the count tells whether it was in the round)
  if (phase_ == Phase::kRunning && nodes_in_round() < round_.nnodes) {
    round_failed(what, kExitFailure, true);
  } else {
    report(what);
  }
}

void Launcher::on_coordinator_line(const std::string& line) {
  const std::vector<std::string> w = words_of(line, 2);
  if (w.empty() || w[0] == "ping") return;
  const int number = w.size() >= 2 ? integer(w[1]).value_or(-1) : -1;
  if (on_coordinator_handshake(w, line)) return;  // (join.cc)
  if (w[0] == "round") {
    const std::vector<std::string> r = words_of(line);
    std::vector<int> v;
    for (size_t i = 1; i < r.size(); ++i) {
      if (const std::optional<int> x = integer(r[i])) v.push_back(*x);
    }
    if (r.size() != 6 || v.size() != 5) {
      report("a bad round from node 0's launcher: " + quoted(line));
      return;
    }
    round_.number = v[0];
    round_.restarts = v[1];
    round_.nnodes = v[2];
    round_.group_rank = v[3];
    round_.store_port = v[4];
    report("round " + std::to_string(round_.number) + ": node " +
           std::to_string(options_.node_rank) + " is group rank " +
           std::to_string(round_.group_rank) + " of " + std::to_string(round_.nnodes) +
           "; starting " + std::to_string(options_.nproc_per_node) + " worker(s)");
    begin_local_round();
  } else if (w[0] == "stop" && number >= 0) {
    if (number != round_.number) return;
    if (round_active_) {
      begin_shutdown(0);
    } else {
      coordinator_.send("stopped " + std::to_string(round_.number));
    }
  } else if (w[0] == "exit" && number >= 0) {
    if (round_active_) {
      final_code_ = number;
      begin_shutdown(number);
    } else {
      finish(number);
    }
  } else {
    report("unexpected message from node 0's launcher: " + quoted(line));
  }
}

void Launcher::connect_to_coordinator() {
  std::string error;
  std::optional<Channel> channel = connect_channel(options_.master_addr, options_.master_port,
                                                   std::chrono::milliseconds(1000), error);
  const Clock::time_point now = Clock::now();
  if (!channel) {
    if (now >= connect_deadline_ && elected()) {
      // Unreachable as long as a silent one is given: lost; replace it.
      report("cannot reach the coordinator at " + options_.master_addr + ":" +
             std::to_string(options_.master_port) + ": " + error);
      elect(followed_);
      return;
    }
    if (now >= connect_deadline_) {
      report("cannot reach node 0's launcher at " + options_.master_addr + ":" +
             std::to_string(options_.master_port) + " within --join-timeout " +
             std::to_string(options_.join_timeout_s) + " s: " + error);
      finish(kExitFailure);
    }
    next_connect_ = now + kConnectRetry;
    return;
  }
  coordinator_ = std::move(*channel);
}

void Launcher::maybe_start_round() {
  if (finished_ || final_code_) return;
  const Clock::time_point now = Clock::now();
  const int count = 1 + static_cast<int>(nodes_.size());
  if (count < options_.min_nodes) {
    enough_since_.reset();
    if (now - joining_since_ >= std::chrono::seconds(options_.join_timeout_s)) {
      report("only " + std::to_string(count) + " of the " + std::to_string(options_.min_nodes) +
             " node(s) needed joined within --join-timeout " +
             std::to_string(options_.join_timeout_s) + " s");
      finish(exit_code_ != 0 ? exit_code_ : kExitFailure);
    }
    return;
  }
  if (!enough_since_) enough_since_ = now;
  const bool everyone = count >= options_.nnodes;
  // After a restart, every node of the last round back: no reason to wait.
  const bool all_back = round_.number > 0 && count >= last_round_nodes_;
  const bool last_call_over = now - *enough_since_ >= std::chrono::seconds(options_.last_call_s);
  if (everyone || all_back || last_call_over) start_round();
}

void Launcher::open_round_store() {
#ifdef TANDEM_RUN_HOSTS_STORE
  store_.reset();
  hosts_store_ = false;
  const char* store_choice = std::getenv("TANDEM_STORE");
  if (!(store_choice && std::string(store_choice) == "c10d")) {
    const char* bind = std::getenv("TANDEM_STORE_BIND");
    try {
      store_ =
          std::make_unique<tandem::rpc::StoreServer>(bind ? bind : options_.master_addr, 0, true);
      hosts_store_ = true;
      round_.store_port = store_->port();
      return;
    } catch (const std::exception& e) {
      report(std::string(e.what()) + "; rank 0 hosts the store instead");
    }
  }
#endif
  // Rank 0 hosts it, on a port free now.
  const int fd = listen_on(options_.master_addr, 0);
  round_.store_port = bound_port(fd);
  ::close(fd);
}

void Launcher::start_round() {
  std::sort(nodes_.begin(), nodes_.end(),
            [](const Node& a, const Node& b) { return a.node_rank < b.node_rank; });
  const int count = 1 + static_cast<int>(nodes_.size());
  round_.nnodes = count;
  round_.group_rank = 0;
  open_round_store();
  std::string ranks = "0";
  int group_rank = 1;
  for (Node& node : nodes_) {
    node.in_round = true;
    node.done = node.stopped = false;
    node.channel.send("round " + std::to_string(round_.number) + " " +
                      std::to_string(round_.restarts) + " " + std::to_string(count) + " " +
                      std::to_string(group_rank++) + " " + std::to_string(round_.store_port));
    ranks += ", " + std::to_string(node.node_rank);
  }
  std::string message = "round " + std::to_string(round_.number) + ": " + std::to_string(count) +
                        " of " + std::to_string(options_.nnodes) + " node(s) (" + ranks +
                        "), WORLD_SIZE " + std::to_string(count * options_.nproc_per_node);
  if (round_.number > 0 && count < last_round_nodes_) {
    message += ", " + std::to_string(last_round_nodes_ - count) +
               " fewer than the last round: the program reshards";
  }
  report(message);
  record_state("round " + std::to_string(round_.number) + " " + std::to_string(round_.restarts) +
               " " + std::to_string(count));
  last_round_nodes_ = count;
  phase_ = Phase::kRunning;
  begin_local_round();
}

void Launcher::begin_local_round() {
  // Whatever a stopped round's workers left in their process groups must
  // not live on beside the next round.
  for (const Worker& worker : workers_) {
    if (!worker.replaced) ::kill(-worker.pid, SIGKILL);
  }
  shutting_down_ = false;
  kill_deadline_.reset();
  drain_deadline_.reset();
  workers_.clear();
  live_workers_ = 0;
  round_active_ = true;
  local_done_ = local_stopped_ = false;
  start_workers();
}

void Launcher::round_failed(const std::string& what, int code, bool restart) {
  if (phase_ != Phase::kRunning) return;  // stopping already: a consequence
  if (restart && !stopped_by_user_ && round_.restarts < options_.max_restarts) {
    report(what + "; stopping every node to start again (restart " +
           std::to_string(round_.restarts + 1) + " of " + std::to_string(options_.max_restarts) +
           ")");
    count_restart_ = true;
  } else {
    report(what);
    final_code_ = code;
  }
  stop_round();
}

void Launcher::stop_round() {
  phase_ = Phase::kStopping;
  stop_deadline_ = Clock::now() + kStopLimit;
  for (Node& node : nodes_) {
    if (node.in_round) node.channel.send("stop " + std::to_string(round_.number));
  }
  if (round_active_) begin_shutdown(final_code_.value_or(0));
  check_round_over();
}

void Launcher::check_round_over() {
  if (phase_ == Phase::kRunning) {
    if (!local_done_) return;
    for (const Node& node : nodes_) {
      if (node.in_round && !node.done) return;
    }
    if (nodes_in_round() < round_.nnodes) return;  // a node's loss is being handled
    report("every node's workers exited 0");
    finish(0);
    return;
  }
  if (phase_ != Phase::kStopping || round_active_) return;
  for (const Node& node : nodes_) {
    if (node.in_round && !node.stopped) return;
  }
  if (final_code_) {
    finish(*final_code_);
    return;
  }
  ++round_.number;
  if (count_restart_) ++round_.restarts;
  count_restart_ = false;
  for (Node& node : nodes_) node.in_round = false;
  phase_ = Phase::kJoining;
  joining_since_ = Clock::now();
  enough_since_.reset();
  stop_deadline_.reset();
  // (the next round starts from node_tick, once this pass over the nodes is done)
}

void Launcher::finish(int code) {
  record_state("exit " + std::to_string(code));
  for (Node& node : nodes_) node.channel.send("exit " + std::to_string(code));
  for (Pending& p : pending_) p.channel.send("refused the job has ended");
  exit_code_ = code;
  finished_ = true;
}

void Launcher::local_worker_failed(const Worker& worker, int code, const std::string& what) {
  const std::string text = "worker " + std::to_string(worker.rank) + " " + what;
  if (options_.node_rank == 0) {
    round_failed(text, code, true);
    return;
  }
  report(text);
  coordinator_.send("failed " + std::to_string(round_.number) + " " + std::to_string(code) + " " +
                    text);
  begin_shutdown(code);
}

void Launcher::local_round_over() {
  round_active_ = false;
  const bool stopped = shutting_down_;
  if (options_.node_rank == 0) {
    (stopped ? local_stopped_ : local_done_) = true;
    // (stopped without a failure reported: its workers could not all start)
    if (stopped && phase_ == Phase::kRunning) {
      round_failed("node 0's workers stopped", kExitFailure, true);
    }
    check_round_over();
    return;
  }
  coordinator_.send((stopped ? "stopped " : "done ") + std::to_string(round_.number));
  if (final_code_) {
    finish(*final_code_);
  } else if (reelect_) {
    reelect_ = false;
    elect(followed_);
  }
}

}  // namespace tandem::launcher
