// DistributedSampler against the indices PyTorch's gives (tests/ddp/data).
#include "ddp_support.h"

#include <torch/data/dataloader.h>
#include <torch/data/datasets/base.h>
#include <torch/data/datasets/map.h>
#include <torch/data/example.h>
#include <torch/data/transforms/stack.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "tandem/ddp/sampler.h"

using namespace tandem;

namespace {

struct Fixture {
  size_t size;
  int replicas, rank;
  bool shuffle;
  uint64_t seed;
  bool drop_last;
  int64_t epoch;
  std::vector<size_t> indices;
};

std::vector<Fixture> fixtures() {
  std::ifstream in(std::string(TANDEM_TEST_DATA) + "/sampler_fixtures.txt");
  REQUIRE(in.good());
  std::vector<Fixture> out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    Fixture f{};
    int shuffle = 0, drop_last = 0;
    std::string colon;
    s >> f.size >> f.replicas >> f.rank >> shuffle >> f.seed >> drop_last >> f.epoch >> colon;
    REQUIRE(colon == ":");
    f.shuffle = shuffle != 0;
    f.drop_last = drop_last != 0;
    size_t i;
    while (s >> i) f.indices.push_back(i);
    out.push_back(std::move(f));
  }
  return out;
}

// Sample i is the tensor {i}: a data loader's batches show which indices came.
struct Numbers : torch::data::datasets::Dataset<Numbers> {
  explicit Numbers(size_t n) : n(n) {}
  torch::data::Example<> get(size_t i) override {
    at::Tensor x = at::full_like(at::zeros({1}, at::kLong), static_cast<int64_t>(i));
    return {x, x};
  }
  c10::optional<size_t> size() const override { return n; }
  size_t n;
};

}  // namespace

TEST_CASE("ddp: DistributedSampler gives PyTorch's indices") {
  auto all = fixtures();
  REQUIRE(all.size() >= 50);
  for (const auto& f : all) {
    ddp::DistributedSampler s(f.size, f.replicas, f.rank, f.shuffle, f.seed, f.drop_last);
    s.set_epoch(f.epoch);
    INFO("size " << f.size << " replicas " << f.replicas << " rank " << f.rank << " shuffle "
                 << f.shuffle << " seed " << f.seed << " drop_last " << f.drop_last << " epoch "
                 << f.epoch);
    CHECK(s.num_samples() == f.indices.size());
    CHECK(s.indices() == f.indices);
  }
}

TEST_CASE("ddp: DistributedSampler's shares cover the dataset and feed a data loader") {
  // Without drop_last every index appears, the padding repeats the first ones.
  std::multiset<size_t> seen;
  for (int r = 0; r < 3; ++r) {
    ddp::DistributedSampler s(11, 3, r, true, 5);
    s.set_epoch(2);
    for (size_t i : s.indices()) seen.insert(i);
  }
  CHECK(seen.size() == 12);
  for (size_t i = 0; i < 11; ++i) CHECK(seen.count(i) >= 1);

  // Through LibTorch's data loader: the batches carry exactly the indices.
  Numbers data(10);
  ddp::DistributedSampler sampler(10, 2, 1, true, 0);
  sampler.set_epoch(1);
  auto expected = sampler.indices();
  auto loader = torch::data::make_data_loader(data.map(torch::data::transforms::Stack<>()),
                                              std::move(sampler),
                                              torch::data::DataLoaderOptions().batch_size(2));
  std::vector<size_t> got;
  for (auto& batch : *loader) {
    for (int64_t k = 0; k < batch.data.size(0); ++k) {
      got.push_back(static_cast<size_t>(batch.data[k][0].template item<int64_t>()));
    }
  }
  CHECK(got == expected);

  // A saved position resumes where it was.
  ddp::DistributedSampler a(100, 4, 2, true, 9);
  a.set_epoch(3);
  a.reset();
  auto first = a.next(7);
  REQUIRE(first);
  torch::serialize::OutputArchive out;
  a.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  ddp::DistributedSampler b(100, 4, 2, true, 9);
  torch::serialize::InputArchive in;
  std::istringstream is(bytes.str());
  in.load_from(is);
  b.load(in);
  CHECK(b.epoch() == 3);
  CHECK(b.next(5) == a.next(5));
}

TEST_CASE("ddp: DistributedSampler refuses a rank outside its replicas") {
  CHECK_THROWS_WITH_AS(ddp::DistributedSampler(10, 2, 2),
                       doctest::Contains("rank 2 is not in [0, num_replicas 2)"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(ddp::DistributedSampler(10, 0, 0),
                       doctest::Contains("num_replicas must be >= 1"), std::invalid_argument);
  // Without a default group, the defaults have nothing to read.
  CHECK_THROWS_WITH_AS(ddp::DistributedSampler(10), doctest::Contains("init_process_group"),
                       std::logic_error);
}
