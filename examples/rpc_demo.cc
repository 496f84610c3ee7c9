// rpc_demo: a parameter service and a distributed reduction over Tandem RPC.
//
// Run it with the launcher (any number of workers):
//   build/bin/tandem-run --nproc-per-node 2 build/bin/rpc_demo
//
// Every worker holds one shard of an embedding table (rows r with
// r % world == rank). Worker 0 then
//   1. looks rows up wherever they live ("lookup", asynchronous fan-out),
//   2. asks every worker for the column sums of its shard ("shard_sum") and
//      reduces them, and checks both against the table built locally,
//   3. keeps a result on the last worker behind a remote reference and asks
//      that worker about it (a method proxy),
//   4. shows a typed remote error.
#include <ATen/TensorOperators.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/max.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sum.h>

#include <cstdio>

#include "rpc/api.h"
#include "rpc/rendezvous.h"
#include "rpc/rref.h"

namespace rpc = tandem::rpc;

namespace {

constexpr int64_t kRows = 1000;
constexpr int64_t kDim = 16;

// The whole table, as a formula: each worker materialises only its rows.
at::Tensor table_rows(const at::Tensor& ids) {
  auto f = ids.to(at::kFloat).unsqueeze(1);
  auto cols = at::arange(kDim, at::TensorOptions().dtype(at::kFloat)).unsqueeze(0);
  return f * 0.01 + cols;
}

}  // namespace

int main() {
  try {
    auto registry = std::make_shared<rpc::Registry>();
    at::Tensor shard;  // this worker's rows, filled once we know our rank
    registry->def("lookup", [&shard](std::vector<int64_t> rows) {
      const int64_t world = rpc::current_agent()->world_size();
      std::vector<int64_t> local;
      for (int64_t r : rows) local.push_back(r / world);
      return at::index_select(shard, 0, at::tensor(local));
    });
    registry->def("shard_sum", [&shard]() { return at::sum(shard, 0); });
    registry->def("max_of", [](at::Tensor t) { return t.max().item<double>(); });
    registry->def("check_row", [](int64_t row) -> int64_t {
      if (row < 0 || row >= kRows) throw std::out_of_range("row " + std::to_string(row) + " does not exist");
      return row;
    });

    // Listen and meet the others only after the shard exists: calls can
    // arrive as soon as init returns on any worker.
    rpc::WorldEnv env = rpc::world_from_env();
    if (env.rank < 0 || env.world_size < 1) {
      std::fprintf(stderr, "rpc_demo: start me with tandem-run (RANK/WORLD_SIZE unset)\n");
      return 2;
    }
    shard = table_rows(at::arange(env.rank, kRows, env.world_size));
    auto agent = rpc::init(registry);
    const int world = agent->world_size();
    std::printf("%s up: %d rows of %d workers\n", agent->name().c_str(),
                static_cast<int>(shard.size(0)), world);

    if (agent->rank() == 0) {
      // 1. Lookups fan out to the owners concurrently.
      std::vector<int64_t> wanted = {3, 141, 592, 653, 999};
      std::vector<rpc::Future<at::Tensor>> parts;
      for (int64_t id : wanted) {
        parts.push_back(rpc::rpc_async<at::Tensor>("worker" + std::to_string(id % world), "lookup",
                                                   std::vector<int64_t>{id}));
      }
      std::vector<at::Tensor> rows;
      for (auto& p : parts) rows.push_back(p.wait()[0]);
      bool lookups_ok = at::allclose(at::stack(rows), table_rows(at::tensor(wanted)));
      std::printf("lookup of %zu rows from their owners: %s\n", wanted.size(),
                  lookups_ok ? "matches" : "WRONG");

      // 2. A reduction: each worker sums its shard, worker 0 adds them up.
      std::vector<rpc::Future<at::Tensor>> sums;
      for (int r = 0; r < world; ++r) {
        sums.push_back(rpc::rpc_async<at::Tensor>("worker" + std::to_string(r), "shard_sum"));
      }
      at::Tensor total = sums[0].wait();
      for (int r = 1; r < world; ++r) total = total + sums[r].wait();
      at::Tensor expect = at::sum(table_rows(at::arange(kRows)), 0);
      bool sum_ok = at::allclose(total, expect, 1e-4);
      std::printf("column sums reduced over %d workers: %s (first: %.2f)\n", world,
                  sum_ok ? "matches" : "WRONG", total[0].item<float>());

      // 3. A value that stays where it was made, used through a reference.
      const std::string last = "worker" + std::to_string(world - 1);
      rpc::RRef<at::Tensor> remote_sum = rpc::remote<at::Tensor>(last, "shard_sum");
      double remote_max = remote_sum.rpc_sync<double>("max_of");
      bool rref_ok = remote_max == sums[world - 1].wait().max().item<double>();
      std::printf("max of %s's column sums, computed where they live: %.2f (%s)\n",
                  remote_sum.owner_name().c_str(), remote_max, rref_ok ? "matches" : "WRONG");
      remote_sum = rpc::RRef<at::Tensor>();  // let the owner free it

      // 4. Errors come back typed, naming the worker.
      try {
        rpc::rpc_sync("worker" + std::to_string(world - 1), "check_row", 5000);
      } catch (const rpc::RemoteError& e) {
        std::printf("remote error, as expected: %s\n", e.what());
      }
      rpc::shutdown();
      return lookups_ok && sum_ok && rref_ok ? 0 : 1;
    }
    rpc::shutdown();  // serve until everyone is done
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rpc_demo: %s\n", e.what());
    return 1;
  }
}
