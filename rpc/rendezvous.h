// How a worker learns who it is and where the others are.
//
// world_from_env() reads the launcher's variables in this order:
//   RANK / WORLD_SIZE (tandem-run, torchrun), then SLURM_PROCID / SLURM_NTASKS,
//   then OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE; LOCAL_RANK and
//   LOCAL_WORLD_SIZE (or their Slurm / Open MPI twins) when present;
//   MASTER_ADDR / MASTER_PORT for the store.
// make_store() opens the c10d::TCPStore every worker meets at: rank 0 hosts it.
// init_method is "env://" (MASTER_ADDR/MASTER_PORT) or "tcp://host:port".
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <utility>

namespace tandem::rpc {

struct WorldEnv {
  int rank = -1;
  int world_size = -1;
  int local_rank = -1;
  int local_world_size = -1;
  std::string master_addr;
  int master_port = -1;
};

// Fills what the environment has; fields it lacks stay at -1 / empty.
WorldEnv world_from_env();

// The rank and world size given (>= 0), or else the environment's. Throws
// std::invalid_argument when the size is unknown or the rank outside it,
// naming how to set them (`options`: "AgentOptions", say).
std::pair<int, int> rank_and_size(int rank, int world_size, const WorldEnv& env,
                                  const std::string& options);

// Parses "env://" or "tcp://host:port" into host and port (env:// reads the
// environment). Throws std::invalid_argument naming what is missing or wrong.
std::pair<std::string, int> master_from_init_method(const std::string& init_method);

// Rank 0 hosts the store (with LibTorch 1.x on its own server, bound to
// store_bind_host(host); with 2.x c10d's, on every interface), unless the launcher does (torchrun
// sets TORCHELASTIC_USE_AGENT_STORE=True when it hosts one on MASTER_PORT): then every rank joins
// it as a client. A client waits (retrying every few ms, up to `timeout`) until the store listens
// before it connects.
c10::intrusive_ptr<c10d::Store> make_store(const std::string& host, int port, int rank,
                                           int world_size, std::chrono::milliseconds timeout);
// Where rank 0's store listens (with LibTorch 1.x, rpc/rendezvous/store_server.h):
// $TANDEM_STORE_BIND if set, else loopback when the master is on this host,
// else the master's address.
std::string store_bind_host(const std::string& master_host);
// Whether the launcher hosts the store (TORCHELASTIC_USE_AGENT_STORE).
bool store_hosted_by_launcher();
// Returns once something listens at host:port, or the address stops
// refusing (c10d then reports what is wrong); throws TimeoutError when it
// still refuses after `timeout`.
void wait_for_listener(const std::string& host, int port, std::chrono::milliseconds timeout);

bool is_loopback_host(const std::string& host);
// The local address that routes towards `host` (no packet is sent).
std::string local_address_towards(const std::string& host);

}  // namespace tandem::rpc
