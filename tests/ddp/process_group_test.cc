// Process groups and their collectives, several ranks as threads of this process.
#include "ddp_support.h"

using namespace tandem;
using namespace std::chrono_literals;
using test::error_of;
using test::Groups;
using test::on_ranks;

namespace {

// What rank r holds before a collective: r + 1 in every element.
at::Tensor rank_tensor(int r) { return at::full_like(at::zeros({2, 3}), r + 1); }

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("ddp: all_reduce, broadcast, all_gather and barrier across three ranks") {
  Groups g(3);
  on_ranks(3, [&](int r) {
    auto& pg = g[r];
    REQUIRE(pg.rank() == r);
    REQUIRE(pg.size() == 3);
    at::Tensor t = rank_tensor(r);
    pg.all_reduce(t);  // 1 + 2 + 3
    CHECK(at::equal(t, at::full_like(t, 6)));
    t = rank_tensor(r);
    pg.all_reduce(t, ddp::ReduceOp::kAvg);
    CHECK(at::allclose(t, at::full_like(t, 2)));
    t = rank_tensor(r);
    pg.all_reduce(t, ddp::ReduceOp::kMax);
    CHECK(at::equal(t, at::full_like(t, 3)));
    t = rank_tensor(r);
    pg.all_reduce(t, ddp::ReduceOp::kMin);
    CHECK(at::equal(t, at::full_like(t, 1)));
    t = rank_tensor(r);
    pg.all_reduce(t, ddp::ReduceOp::kProduct);
    CHECK(at::equal(t, at::full_like(t, 6)));
    at::Tensor ints = at::arange(4, at::kLong) * (r + 1);
    pg.all_reduce(ints);
    CHECK(at::equal(ints, at::arange(4, at::kLong) * 6));

    t = rank_tensor(r);
    pg.broadcast(t, 1);
    CHECK(at::equal(t, rank_tensor(1)));

    auto all = pg.all_gather(rank_tensor(r));
    REQUIRE(all.size() == 3);
    for (int k = 0; k < 3; ++k) CHECK(at::equal(all[k], rank_tensor(k)));
    pg.barrier();

    // The asynchronous form: several in flight, waited in order.
    at::Tensor a = rank_tensor(r), b = rank_tensor(r) * 10;
    auto pa = pg.all_reduce_async(a);
    auto pb = pg.all_reduce_async(b);
    pa.wait();
    pb.wait();
    CHECK(at::equal(a, at::full_like(a, 6)));
    CHECK(at::equal(b, at::full_like(b, 60)));
    CHECK_THROWS_AS(pa.wait(), std::logic_error);  // once only
  });
}

TEST_CASE("ddp: release_buffer gives a storage's memory back while another holds it") {
  at::Tensor t = at::ones({1024});
  at::Tensor other = t.view({32, 32});  // (as a backend's finished work holds it)
  const c10::Storage storage = t.storage();
  ddp::release_buffer(t);
  CHECK(storage.nbytes() == 0);
  CHECK(storage.data() == nullptr);
  CHECK(other.storage().nbytes() == 0);  // (the same storage: nothing may read it now)
  ddp::release_buffer(at::Tensor());     // (nothing to do)
  // A reduce-scatter over Gloo still sums right (its received buffer goes back).
  Groups g(2);
  on_ranks(2, [&](int r) {
    at::Tensor in = at::arange(4, at::kFloat) * (r + 1), out = at::empty({2});
    g[r].reduce_scatter_async(in, out, ddp::ReduceOp::kSum).wait();
    CHECK(at::equal(out, (at::arange(4, at::kFloat) * 3).narrow(0, 2 * r, 2)));
  });
}

TEST_CASE("ddp: bad arguments are refused naming what was wrong") {
  auto opts = [](auto tweak) {
    ddp::ProcessGroupOptions o;
    o.rank = 0;
    o.world_size = 1;
    o.timeout = 5s;
    tweak(o);
    return o;
  };
  auto store = support::store_server();
  auto fails = [&](ddp::ProcessGroupOptions o) {
    if (!o.store) o.store = support::store_client(store->getPort());
    return error_of([&] { ddp::ProcessGroup::create(o); });
  };
  CHECK(contains(fails(opts([](auto& o) { o.backend = "mpi"; })),
                 "unknown process group backend 'mpi'"));
  if (!ddp::nccl_available()) {  // (TANDEM_WITH_NCCL is the library's, not the tests')
    CHECK(contains(fails(opts([](auto& o) { o.backend = "nccl"; })),
                   "needs a LibTorch built with CUDA"));
  }
  CHECK(contains(fails(opts([](auto& o) {
                   o.rank = 3;
                   o.world_size = 2;
                 })),
                 "rank 3 is not in [0, world size 2)"));
  CHECK(contains(fails(opts([](auto& o) { o.timeout = 0ms; })), "timeout must be > 0"));
  CHECK(contains(error_of([&] {
                   auto o = opts([](auto& o) { o.init_method = "udp://x:1"; });
                   ddp::ProcessGroup::create(o);
                 }),
                 "udp://x:1"));

  // A group of one: collectives on bad tensors.
  auto o = opts([](auto&) {});
  o.store = support::store_client(store->getPort());
  auto pg = ddp::ProcessGroup::create(o);
  at::Tensor ints = at::arange(4, at::kLong);
  CHECK(contains(error_of([&] { pg->all_reduce(ints, ddp::ReduceOp::kAvg); }),
                 "avg needs a floating-point tensor, not Long"));
  at::Tensor strided = at::zeros({4, 4}).t();
  CHECK(contains(error_of([&] { pg->all_reduce(strided); }),
                 "all_reduce: the tensor must be contiguous"));
  at::Tensor undefined;
  CHECK(contains(error_of([&] { pg->broadcast(undefined, 0); }),
                 "broadcast: the tensor is undefined"));
  at::Tensor t = at::ones({2});
  CHECK(contains(error_of([&] { pg->broadcast(t, 1); }), "source rank 1 is not in [0, 1)"));
  // Still serves afterwards.
  pg->all_reduce(t);
  CHECK(at::equal(t, at::ones({2})));
  CHECK_THROWS_AS(ddp::ProcessGroup::Pending().wait(), std::logic_error);
}

TEST_CASE("ddp: the default group needs init_process_group, once") {
  REQUIRE_FALSE(ddp::is_initialized());
  at::Tensor t = at::ones({2});
  CHECK(contains(error_of([&] { ddp::all_reduce(t); }), "call ddp::init_process_group first"));
  CHECK_THROWS_AS(ddp::get_rank(), std::logic_error);
  auto store = support::store_server();
  ddp::ProcessGroupOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.store = store;
  ddp::init_process_group(o);
  CHECK(ddp::is_initialized());
  CHECK(ddp::get_rank() == 0);
  CHECK(ddp::get_world_size() == 1);
  CHECK(contains(error_of([&] { ddp::init_process_group(o); }), "exists already"));
  ddp::all_reduce(t, ddp::ReduceOp::kAvg);
  CHECK(at::equal(t, at::ones({2})));
  CHECK(ddp::all_gather(t).size() == 1);
  ddp::broadcast(t, 0);
  ddp::barrier();
  ddp::destroy_process_group();
  CHECK_FALSE(ddp::is_initialized());
  ddp::destroy_process_group();  // twice is harmless
}

TEST_CASE("ddp: a collective a peer never joins times out naming itself") {
  // The engine's own operation runs on until the group's timeout (destroying
  // the group waits for it): keep that short here.
  Groups g(2, 2s);
  at::Tensor t = at::ones({3});
  auto t0 = std::chrono::steady_clock::now();
  std::string err = error_of([&] { g[0].all_reduce(t, ddp::ReduceOp::kSum, 300ms); });
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(contains(err, "all_reduce(sum) on rank 0 of 2 failed (timeout 300 ms)"));
  CHECK(took >= 250ms);
  CHECK(took < 5s);
  err = error_of([&] { g[0].barrier(200ms); });
  CHECK(contains(err, "barrier on rank 0 of 2 failed (timeout 200 ms)"));
}

TEST_CASE("ddp: a group whose peers never come fails within its timeout") {
  auto store = support::store_server();
  ddp::ProcessGroupOptions o;
  o.rank = 0;
  o.world_size = 2;
  o.timeout = 500ms;
  o.store = support::store_client(store->getPort());
  auto t0 = std::chrono::steady_clock::now();
  std::string err = error_of([&] { ddp::ProcessGroup::create(o); });
  CHECK(contains(
      err, "process group 'default' (gloo, rank 0 of 2) could not meet its peers within 500 ms"));
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
}
