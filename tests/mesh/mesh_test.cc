// Mesh: the layout (row-major, last dimension fastest), coordinates, worker
// names, sub-meshes and one group per dimension; shapes that cannot be,
// ranks that disagree, and unknown dimensions fail on every rank, named;
// two meshes of one job keep their groups apart. Ranks are threads of this
// process, each with its own agent (a World).
#include "tandem/mesh/mesh.h"

#include <ATen/ops/full.h>

#include <mutex>

#include "ddp/ddp_support.h"
#include "tandem/rpc/agent.h"
#include "test_util.h"

using namespace tandem;
using namespace std::chrono_literals;
using test::error_of;
using test::on_ranks;
using test::World;

namespace {

MeshOptions options_for(World& w, int r, const std::string& name = "mesh") {
  MeshOptions o;
  o.name = name;
  o.agent = w.agents[static_cast<size_t>(r)];
  o.store = support::store_client(w.port);
  o.timeout = 20s;
  return o;
}

// One mesh per rank, made at once (construction is collective).
std::vector<std::unique_ptr<Mesh>> make_meshes(World& w, const Mesh::Shape& shape,
                                               const std::string& name = "mesh") {
  const int n = static_cast<int>(w.agents.size());
  std::vector<std::unique_ptr<Mesh>> m(static_cast<size_t>(n));
  on_ranks(n, [&](int r) { m[r] = std::make_unique<Mesh>(shape, options_for(w, r, name)); });
  return m;
}

// All at once: a group's closing waits for its peers.
void drop(std::vector<std::unique_ptr<Mesh>>& m) {
  on_ranks(static_cast<int>(m.size()), [&](int r) { m[r].reset(); });
}

double sum_over(ddp::ProcessGroup& g, double x) {
  at::Tensor t = at::full({3}, x, at::kDouble);
  g.all_reduce(t);
  return t[0].item<double>();
}

}  // namespace

TEST_CASE("mesh: ranks laid out row-major, coordinates, workers, sub-meshes and groups") {
  World w(4);
  {
    auto m = make_meshes(w, {{"pp", 2}, {"dp", 2}});
    for (int r = 0; r < 4; ++r) {
      const Mesh& mesh = *m[r];
      CAPTURE(r);
      CHECK(mesh.rank() == r);
      CHECK(mesh.size() == 4);
      CHECK(mesh.ndim() == 2);
      CHECK(mesh.size("pp") == 2);
      CHECK(mesh.size("dp") == 2);
      CHECK(mesh.coordinate("pp") == r / 2);
      CHECK(mesh.coordinate("dp") == r % 2);
      CHECK(mesh.coordinates() == std::vector<int>{r / 2, r % 2});
      CHECK(mesh.rank_at({1, 0}) == 2);
      CHECK(mesh.rank_at({0, 1}) == 1);
      // Some coordinates by name; the others are this rank's own.
      CHECK(mesh.rank_at({{"pp", 1}}) == 2 + r % 2);
      CHECK(mesh.rank_at({{"dp", 0}}) == (r / 2) * 2);
      CHECK(mesh.worker_at({{"pp", 1}}) == "worker" + std::to_string(2 + r % 2));
      CHECK(mesh.ranks_along("dp") == std::vector<int>{(r / 2) * 2, (r / 2) * 2 + 1});
      CHECK(mesh.ranks_along("pp") == std::vector<int>{r % 2, 2 + r % 2});
      CHECK(mesh.to_string() == "mesh 'mesh' (pp=2, dp=2)");
      CHECK(mesh.group_name("dp") == m[0]->group_name("dp"));  // one name, each rank's own group
      CHECK(mesh.group_name("dp") != mesh.group_name("pp"));
      CHECK(ddp::find_group(*w.agents[r], mesh.group_name("dp")) == mesh.group("dp"));
      CHECK(mesh.group("dp")->rank() == r % 2);
      CHECK(mesh.group("pp")->rank() == r / 2);
      CHECK(mesh.group("dp")->members()[0].name == "worker" + std::to_string((r / 2) * 2));

      const Mesh dp = mesh["dp"];
      CHECK(dp.ndim() == 1);
      CHECK(dp.size() == 2);
      CHECK(dp.rank() == r);
      CHECK(dp.coordinate("dp") == r % 2);
      CHECK(dp.ranks() == mesh.ranks_along("dp"));
      CHECK(dp.group("dp") == mesh.group("dp"));
      CHECK(dp.worker_at({0}) == "worker" + std::to_string((r / 2) * 2));
      const Mesh whole = mesh[{"pp", "dp"}];
      CHECK(whole.ranks() == std::vector<int>{0, 1, 2, 3});
      CHECK(whole.rank() == r);
    }
    // Each group sums over its own peers: dp over {0,1} and {2,3}, pp over {0,2} and {1,3}.
    std::vector<double> dp_sum(4), pp_sum(4);
    on_ranks(4, [&](int r) {
      dp_sum[r] = sum_over(*m[r]->group("dp"), r + 1);
      pp_sum[r] = sum_over(*m[r]->group("pp"), 10 * (r + 1));
    });
    CHECK(dp_sum == std::vector<double>{3, 3, 7, 7});
    CHECK(pp_sum == std::vector<double>{40, 60, 40, 60});
    drop(m);
  }
  w.shutdown();
}

TEST_CASE("mesh: a bad shape, disagreeing ranks and unknown dimensions fail on every rank") {
  World w(4);
  {
    // Sizes that do not multiply to the world: every rank says so.
    std::vector<std::string> errors(4);
    on_ranks(4, [&](int r) {
      errors[r] = error_of([&] { Mesh({{"pp", 3}, {"dp", 2}}, options_for(w, r)); });
    });
    for (const auto& e : errors) {
      CHECK(e == "mesh 'mesh': shape (pp=3, dp=2) holds 6 ranks, but the world has 4");
    }
    // Rank 3 was given another shape: all four fail, naming who made which.
    on_ranks(4, [&](int r) {
      Mesh::Shape shape = r == 3 ? Mesh::Shape{{"dp", 4}} : Mesh::Shape{{"pp", 2}, {"dp", 2}};
      errors[r] = error_of([&] { Mesh(shape, options_for(w, r)); });
    });
    for (const auto& e : errors) {
      CHECK(e ==
            "mesh 'mesh': the ranks disagree on its shape: rank 3 made it (dp=4); ranks 0, 1, 2 "
            "made it (pp=2, dp=2)");
    }
    on_ranks(4, [&](int r) {
      errors[r] = error_of([&] { Mesh({{"pp", 0}, {"dp", 2}}, options_for(w, r)); });
    });
    for (const auto& e : errors) CHECK(e == "mesh 'mesh': dimension 'pp' has size 0 (at least 1)");
    on_ranks(4, [&](int r) {
      errors[r] = error_of([&] { Mesh({{"dp", 2}, {"dp", 2}}, options_for(w, r)); });
    });
    for (const auto& e : errors) {
      CHECK(e == "mesh 'mesh': dimension 'dp' appears twice in (dp=2, dp=2)");
    }

    // After all that, a good mesh is made: the failed ones left nothing behind.
    auto m = make_meshes(w, {{"pp", 2}, {"dp", 2}});
    const Mesh& mesh = *m[1];
    const std::string unknown =
        "mesh 'mesh' (pp=2, dp=2) has no dimension 'tp' (its dimensions: "
        "pp, dp)";
    CHECK(error_of([&] { mesh.size("tp"); }) == unknown);
    CHECK(error_of([&] { mesh.coordinate("tp"); }) == unknown);
    CHECK(error_of([&] { mesh.group("tp"); }) == unknown);
    CHECK(error_of([&] { mesh["tp"]; }) == unknown);
    CHECK(error_of([&] { mesh.rank_at({{"tp", 0}}); }) == unknown);
    CHECK(error_of([&] {
            mesh.rank_at({2, 0});
          }) == "mesh 'mesh' (pp=2, dp=2): coordinate 2 of dimension 'pp' is not in [0, 2)");
    CHECK(error_of([&] { mesh.rank_at({0}); }) ==
          "mesh 'mesh' (pp=2, dp=2): rank_at takes 2 coordinates, not 1");
    CHECK(error_of([&] {
            mesh[std::vector<std::string>{"dp", "pp"}];
          }) ==
          "mesh 'mesh' (pp=2, dp=2): a sub-mesh's dimensions go in the mesh's order, once each "
          "('pp' is out of place)");
    drop(m);
  }
  w.shutdown();
}

TEST_CASE("mesh: a mesh over some of the world's ranks, and its bad rank lists") {
  World w(4);
  {
    // Ranks 3 and 1 (in that order) make a mesh; 0 and 2 stay out of it.
    std::vector<std::unique_ptr<Mesh>> m(4);
    on_ranks(2, [&](int i) {
      const int r = i == 0 ? 3 : 1;
      MeshOptions o = options_for(w, r, "some");
      o.ranks = {3, 1};
      m[r] = std::make_unique<Mesh>(Mesh::Shape{{"dp", 2}}, o);
    });
    CHECK(m[3]->rank() == 3);
    CHECK(m[3]->coordinate("dp") == 0);
    CHECK(m[1]->coordinate("dp") == 1);
    CHECK(m[1]->ranks() == std::vector<int>{3, 1});
    CHECK(m[1]->rank_at({0}) == 3);
    CHECK(m[1]->worker_at({0}) == "worker3");
    std::vector<double> sums(4);
    on_ranks(2, [&](int i) {
      const int r = i == 0 ? 3 : 1;
      sums[r] = sum_over(*m[r]->group("dp"), r);
    });
    CHECK(sums[1] == 4);
    CHECK(sums[3] == 4);
    on_ranks(2, [&](int i) { m[i == 0 ? 3 : 1].reset(); });

    MeshOptions o = options_for(w, 0, "some");
    o.ranks = {1, 2};
    CHECK(error_of([&] {
            Mesh({{"dp", 2}}, o);
          }) == "mesh 'some': rank 0 is not one of MeshOptions::ranks, so it cannot make the mesh");
    o.ranks = {0, 4};
    CHECK(error_of([&] {
            Mesh({{"dp", 2}}, o);
          }) == "mesh 'some': rank 4 of MeshOptions::ranks is not in the world's 0 .. 3");
    o.ranks = {0, 0};
    CHECK(error_of([&] {
            Mesh({{"dp", 2}}, o);
          }) == "mesh 'some': rank 0 appears twice in MeshOptions::ranks");
    o.ranks = {0};
    CHECK(error_of([&] {
            Mesh({{"dp", 2}}, o);
          }) == "mesh 'some': shape (dp=2) holds 2 ranks, but MeshOptions::ranks has 1");
  }
  w.shutdown();
}

TEST_CASE("mesh: two meshes of one job keep their groups apart") {
  World w(4);
  {
    // Two meshes of one name and one of another, all alive at once.
    auto a = make_meshes(w, {{"pp", 2}, {"dp", 2}});
    auto b = make_meshes(w, {{"pp", 2}, {"dp", 2}});
    auto c = make_meshes(w, {{"dp", 4}}, "flat");
    CHECK(a[0]->group_name("dp") != b[0]->group_name("dp"));
    CHECK(ddp::find_group(*w.agents[0], a[0]->group_name("dp")) == a[0]->group("dp"));
    CHECK(ddp::find_group(*w.agents[0], b[0]->group_name("dp")) == b[0]->group("dp"));
    // Interleaved collectives on all three: each sums over its own members.
    std::vector<double> sa(4), sb(4), sc(4);
    on_ranks(4, [&](int r) {
      at::Tensor ta = at::full({2}, double(r + 1), at::kDouble);
      at::Tensor tb = at::full({2}, double(100 * (r + 1)), at::kDouble);
      at::Tensor tc = at::full({2}, double(1000 * (r + 1)), at::kDouble);
      auto pa = a[r]->group("dp")->all_reduce_async(ta);
      auto pb = b[r]->group("dp")->all_reduce_async(tb);
      auto pc = c[r]->group("dp")->all_reduce_async(tc);
      pc.wait();
      pb.wait();
      pa.wait();
      sa[r] = ta[0].item<double>();
      sb[r] = tb[0].item<double>();
      sc[r] = tc[0].item<double>();
    });
    CHECK(sa == std::vector<double>{3, 3, 7, 7});
    CHECK(sb == std::vector<double>{300, 300, 700, 700});
    CHECK(sc == std::vector<double>{10000, 10000, 10000, 10000});
    const std::string name = c[2]->group_name("dp");
    drop(c);
    CHECK(ddp::find_group(*w.agents[2], name) == nullptr);  // gone with its mesh
    drop(b);
    drop(a);
  }
  w.shutdown();
}
