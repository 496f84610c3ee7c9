// Checkpoints on disk: parts saved by every rank (threads of this process)
// and committed by a manifest, latest(), pruning, and every bad input.
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <tuple>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include "ddp/ddp_support.h"
#include "tandem/checkpoint/checkpoint.h"

using namespace tandem;
using test::error_of;
using test::Groups;
using test::on_ranks;
using test::TempDir;
namespace fs = std::filesystem;

namespace {

// Rank r's bytes: text, a newline, a NUL and more.
std::string note_of(int r) {
  std::string b = "rank " + std::to_string(r) + "\n";
  b.push_back('\0');
  return b + "binary";
}

// Rank r's part: a float and an int tensor, and bytes.
checkpoint::Part part_of(int r, int64_t step) {
  checkpoint::Part p;
  p.add("w" + std::to_string(r), at::arange(6, at::kFloat).view({2, 3}) * (r + 1) + step);
  p.add("ids" + std::to_string(r), at::arange(4, at::kLong) + r);
  p.add_bytes("note" + std::to_string(r), note_of(r));
  return p;
}

void save_on(Groups& g, const std::string& dir, int64_t step, int keep = 2) {
  on_ranks(g.size(), [&](int r) {
    checkpoint::SaveOptions o;
    o.group = g.groups[r];
    o.keep = keep;
    o.meta = {{"layout", "dp=" + std::to_string(g.size())}, {"model", "mlp 2x3"}};
    checkpoint::save(dir, step, part_of(r, step), o);
  });
}

// Replaces byte `at` of `file` (negative: from the end) or cuts it to `size`.
void flip_byte(const std::string& file, long at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at, at < 0 ? std::ios::end : std::ios::beg);
  char c;
  f.get(c);
  f.seekp(at, at < 0 ? std::ios::end : std::ios::beg);
  f.put(static_cast<char>(c ^ 0x5a));
}

}  // namespace

TEST_CASE("checkpoint: three ranks save their parts, one manifest commits them, any rank reads") {
  TempDir tmp;
  Groups g(3);
  save_on(g, tmp.path, 10);
  auto found = checkpoint::latest(tmp.path);
  REQUIRE(found);
  CHECK(found->step == 10);
  CHECK(found->skipped.empty());
  CHECK(found->path == checkpoint::step_path(tmp.path, 10));
  for (int r = 0; r < 3; ++r)
    CHECK(fs::exists(found->path + "/part-" + std::to_string(r) + ".bin"));
  CHECK_FALSE(fs::exists(found->path + "/MANIFEST.tmp"));
  checkpoint::Reader rd(found->path);
  CHECK(rd.step() == 10);
  CHECK(rd.world_size() == 3);
  CHECK(rd.names().size() == 9);
  for (int r = 0; r < 3; ++r) {
    const std::string s = std::to_string(r);
    CHECK(rd.rank_of("w" + s) == r);
    CHECK(at::equal(rd.tensor("w" + s), at::arange(6, at::kFloat).view({2, 3}) * (r + 1) + 10));
    CHECK(at::equal(rd.tensor("ids" + s), at::arange(4, at::kLong) + r));
    CHECK(rd.bytes("note" + s) == note_of(r));
  }
  CHECK(rd.meta().at("layout") == "dp=3");
  rd.expect_meta("model", "mlp 2x3");
  CHECK(error_of([&] {
          rd.expect_meta("model", "gpt");
        }).find("its model is 'mlp 2x3', this job's 'gpt'") != std::string::npos);
  CHECK(error_of([&] { rd.tensor("nope"); }).find("holds no 'nope'") != std::string::npos);
  CHECK(error_of([&] { rd.bytes("w0"); }).find("is a tensor, not bytes") != std::string::npos);
}

TEST_CASE("checkpoint: the last K are kept, and latest() passes over an incomplete newer step") {
  TempDir tmp;
  Groups g(2);
  for (int64_t step : {1, 2, 3, 4}) save_on(g, tmp.path, step, /*keep=*/2);
  CHECK_FALSE(fs::exists(checkpoint::step_path(tmp.path, 1)));
  CHECK_FALSE(fs::exists(checkpoint::step_path(tmp.path, 2)));
  CHECK(fs::exists(checkpoint::step_path(tmp.path, 3)));
  // A save that died before its manifest: parts, no MANIFEST.
  const std::string dead = checkpoint::step_path(tmp.path, 5);
  fs::create_directories(dead);
  fs::copy_file(checkpoint::step_path(tmp.path, 4) + "/part-0.bin", dead + "/part-0.bin");
  auto found = checkpoint::latest(tmp.path);
  REQUIRE(found);
  CHECK(found->step == 4);
  REQUIRE(found->skipped.size() == 1);
  CHECK(found->skipped[0].find("step-0000000005/MANIFEST is missing") != std::string::npos);
  // The next complete save removes the dead one (older than it) with the rest.
  save_on(g, tmp.path, 6, 2);
  CHECK_FALSE(fs::exists(dead));
  CHECK(checkpoint::latest(tmp.path)->step == 6);
  CHECK_FALSE(checkpoint::latest(tmp.path + "/none"));
}

TEST_CASE("checkpoint: missing, truncated, altered and foreign parts, and an altered manifest") {
  TempDir tmp;
  Groups g(2);
  save_on(g, tmp.path, 7);
  save_on(g, tmp.path, 8);
  const std::string seven = checkpoint::step_path(tmp.path, 7);
  const std::string eight = checkpoint::step_path(tmp.path, 8);
  {
    // Altered: a byte of a tensor.
    flip_byte(eight + "/part-1.bin", -3);
    checkpoint::Reader rd(eight);
    CHECK(
        at::equal(rd.tensor("w0"), at::arange(6, at::kFloat).view({2, 3}) + 8));  // part 0 is fine
    CHECK(error_of([&] { rd.tensor("w1"); }).find("part-1.bin: its checksum does not match") !=
          std::string::npos);
    flip_byte(eight + "/part-1.bin", -3);  // back
    CHECK(at::equal(checkpoint::Reader(eight).tensor("w1"),
                    at::arange(6, at::kFloat).view({2, 3}) * 2 + 8));
  }
  {
    // Foreign: step 7's part in step 8 (same size, other values).
    fs::copy_file(seven + "/part-0.bin", eight + "/part-0.bin",
                  fs::copy_options::overwrite_existing);
    CHECK(error_of([&] {
            checkpoint::Reader(eight).tensor("w0");
          }).find("part-0.bin: its checksum does not match the manifest's") != std::string::npos);
  }
  {
    // Truncated, and missing.
    fs::resize_file(seven + "/part-1.bin", 20);
    CHECK(error_of([&] {
            checkpoint::Reader(seven).bytes("note1");
          }).find("part-1.bin has 20 bytes, the manifest says") != std::string::npos);
    fs::remove(seven + "/part-1.bin");
    CHECK(error_of([&] {
            checkpoint::Reader(seven).tensor("ids1");
          }).find("part-1.bin is missing") != std::string::npos);
  }
  {
    // An altered manifest is refused whole, and latest() passes over it.
    flip_byte(eight + "/MANIFEST", 30);
    CHECK(error_of([&] {
            checkpoint::Reader rd(eight);
          }).find("MANIFEST: its checksum does not match") != std::string::npos);
    auto found = checkpoint::latest(tmp.path);
    REQUIRE(found);
    CHECK(found->step == 7);
    CHECK(found->skipped.size() == 1);
  }
}

TEST_CASE("checkpoint: a verified latest() goes back past a damaged step, or refuses it") {
  TempDir tmp;
  Groups g(2);
  save_on(g, tmp.path, 3);
  save_on(g, tmp.path, 4);
  const std::string four = checkpoint::step_path(tmp.path, 4);
  CHECK_NOTHROW(checkpoint::Reader(four).verify());
  // Whole: the newest is taken, verified or not.
  CHECK(checkpoint::latest(tmp.path, checkpoint::LatestOptions::verified())->step == 4);
  for (const auto& [what, damage, message] :
       std::vector<std::tuple<std::string, std::function<void()>, std::string>>{
           {"altered", [&] { flip_byte(four + "/part-1.bin", 40); },
            "part-1.bin: its checksum does not match the manifest's"},
           {"truncated", [&] { fs::resize_file(four + "/part-0.bin", 33); },
            "part-0.bin has 33 bytes, the manifest says"},
           {"missing", [&] { fs::remove(four + "/part-1.bin"); }, "part-1.bin is missing"}}) {
    CAPTURE(what);
    TempDir copy;
    fs::copy(tmp.path, copy.path, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    damage();
    CHECK(error_of([&] { checkpoint::Reader(four).verify(); }).find(message) != std::string::npos);
    // Unverified, the manifest alone: step 4 (the damage shows when read).
    CHECK(checkpoint::latest(tmp.path)->step == 4);
    std::vector<std::string> passed_over;
    checkpoint::LatestOptions o = checkpoint::LatestOptions::verified();
    o.passed_over = &passed_over;
    auto found = checkpoint::latest(tmp.path, o);
    REQUIRE(found);
    CHECK(found->step == 3);
    REQUIRE(found->skipped.size() == 1);
    CHECK(found->skipped[0].find("step-0000000004: ") != std::string::npos);
    CHECK(found->skipped[0].find(message) != std::string::npos);
    CHECK(passed_over == found->skipped);
    // Refused: the step and the file named.
    CHECK(error_of([&] {
            checkpoint::latest(tmp.path, checkpoint::LatestOptions::verified(/*refuse=*/true));
          }).find("the newest checkpoint, step 4, is damaged: " + four) != std::string::npos);
    // (the step back as it was)
    fs::remove_all(tmp.path);
    fs::copy(copy.path, tmp.path, fs::copy_options::recursive);
  }
  // Every step damaged: none found, each one said.
  flip_byte(four + "/part-0.bin", 40);
  flip_byte(checkpoint::step_path(tmp.path, 3) + "/part-0.bin", 40);
  std::vector<std::string> passed_over;
  checkpoint::LatestOptions o = checkpoint::LatestOptions::verified();
  o.passed_over = &passed_over;
  CHECK_FALSE(checkpoint::latest(tmp.path, o));
  CHECK(passed_over.size() == 2);
  // An incomplete newer step is passed over even when refusing damaged ones.
  const std::string dead = checkpoint::step_path(tmp.path, 9);
  fs::create_directories(dead);
  flip_byte(four + "/part-0.bin", 40);  // (whole again)
  CHECK(checkpoint::latest(tmp.path, checkpoint::LatestOptions::verified(true))->step == 4);
}

TEST_CASE("checkpoint: bad arguments, and two ranks saving one name, fail on every rank") {
  TempDir tmp;
  CHECK(error_of([] { checkpoint::Part().add("a b", at::ones({1})); }).find("holds whitespace") !=
        std::string::npos);
  CHECK(error_of([] { checkpoint::Part().add_bytes("", "x"); }).find("is empty") !=
        std::string::npos);
  checkpoint::SaveOptions bad;
  bad.keep = 0;
  CHECK(error_of([&] { checkpoint::save(tmp.path, 1, {}, bad); }).find("keep must be >= 1") !=
        std::string::npos);
  Groups g(2);
  std::vector<std::string> errors(2);
  on_ranks(2, [&](int r) {
    checkpoint::Part p;
    p.add("same", at::ones({2}) * r);
    checkpoint::SaveOptions o;
    o.group = g.groups[r];
    errors[r] = error_of([&] { checkpoint::save(tmp.path, 3, p, o); });
  });
  for (const auto& e : errors) CHECK(e.find("ranks 0 and 1 both save 'same'") != std::string::npos);
  CHECK_FALSE(checkpoint::latest(tmp.path));  // nothing was committed
  // Alone (no group): world 1.
  checkpoint::save(tmp.path, 4, part_of(0, 4));
  CHECK(checkpoint::Reader(checkpoint::latest(tmp.path)->path).world_size() == 1);
}

TEST_CASE("checkpoint: an asynchronous save holds the values of its step while training goes on") {
  TempDir tmp;
  Groups train(2);
  Groups saving(2);  // the savers' own: their collectives run beside training's
  on_ranks(2, [&](int r) {
    checkpoint::SaveOptions o;
    o.group = saving.groups[r];
    o.keep = 2;
    checkpoint::AsyncSaver saver(tmp.path, o);
    at::Tensor w = at::ones({64, 64}) * r;
    for (int64_t step = 1; step <= 3; ++step) {
      checkpoint::Part part;
      part.add("w" + std::to_string(r), w);  // the copy is made here
      saver.save(step, std::move(part));
      CHECK(saver.in_flight() + 1 > 0);  // (either; it may be done already)
      // Training goes on: the parameter changes, a collective runs.
      w.add_(10);
      at::Tensor g = at::ones({1024});
      train[r].all_reduce(g);
      CHECK(g[0].item<float>() == 2);
    }
    saver.wait();
    CHECK_FALSE(saver.in_flight());
    saver.wait();  // nothing in flight: returns
  });
  auto found = checkpoint::latest(tmp.path);
  REQUIRE(found);
  CHECK(found->step == 3);
  checkpoint::Reader reader(found->path);
  // Step 3 was saved after two changes of 10.
  CHECK(at::equal(reader.tensor("w0"), at::full({64, 64}, 20.0f)));
  CHECK(at::equal(reader.tensor("w1"), at::full({64, 64}, 21.0f)));
  CHECK_FALSE(fs::exists(checkpoint::step_path(tmp.path, 1)));  // keep 2
  CHECK(fs::exists(checkpoint::step_path(tmp.path, 2)));
}

TEST_CASE("checkpoint: a background save that fails says so at the next save or wait") {
  TempDir tmp;
  const std::string blocked = tmp.path + "/a-file";
  std::ofstream(blocked) << "not a directory";
  checkpoint::AsyncSaver saver(blocked + "/ckpt");
  checkpoint::Part p;
  p.add("x", at::ones({3}));
  saver.save(1, p);  // returns: the write has begun
  const std::string e = error_of([&] { saver.wait(); });
  CHECK(e.find("cannot make " + blocked + "/ckpt/step-0000000001") != std::string::npos);
  saver.wait();  // the error was taken once
  saver.save(2, p);
  CHECK(error_of([&] { saver.save(3, p); }).find("cannot make") != std::string::npos);
  CHECK(error_of([] {
          checkpoint::AsyncSaver("x", checkpoint::SaveOptions{nullptr, 0, {}});
        }).find("keep must be >= 1") != std::string::npos);
  // A good one after: its steps are committed.
  checkpoint::AsyncSaver good(tmp.path + "/ok");
  good.save(5, p);
  good.save(6, p);
  CHECK(good.last_wait_ms() >= 0);
  good.wait();
  CHECK(checkpoint::latest(tmp.path + "/ok")->step == 6);
}

TEST_CASE("checkpoint: restart_count() reads tandem-run's round, else torchrun's") {
  ::unsetenv("TANDEM_RESTART_COUNT");
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  CHECK(checkpoint::restart_count() == 0);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "2", 1);
  CHECK(checkpoint::restart_count() == 2);
  ::setenv("TANDEM_RESTART_COUNT", "3", 1);
  CHECK(checkpoint::restart_count() == 3);
  ::unsetenv("TANDEM_RESTART_COUNT");
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
}

TEST_CASE("checkpoint: a saver killed by SIGKILL mid-save leaves the step before as latest") {
  TempDir tmp;
  std::mt19937 random(std::random_device{}());
  int mid_save = 0;
  for (int round = 0; round < 6; ++round) {
    const std::string dir = tmp.path + "/r" + std::to_string(round);
    // The saver: this binary again (TANDEM_TEST_WORKER=save_loop), saving
    // 32 MiB a step for ever.
    // (posix_spawn, not fork: fork's handlers would stop OpenBLAS's threads here)
    std::vector<std::string> env{"TANDEM_TEST_WORKER=save_loop", "TANDEM_TEST_DIR=" + dir};
    for (char** e = environ; *e; ++e) env.emplace_back(*e);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string exe = support::self_exe();
    char* argv[] = {exe.data(), nullptr};
    pid_t pid = -1;
    REQUIRE(::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()) == 0);
    // Killed at a random moment once two steps are in.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::optional<checkpoint::Found> found;
    while (std::chrono::steady_clock::now() < deadline) {
      found = checkpoint::latest(dir);
      if (found && found->step >= 2) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(random() % 40));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    REQUIRE(WIFSIGNALED(status));
    found = checkpoint::latest(dir);
    REQUIRE(found);
    // What latest() names reads whole and checks out: the values of its step.
    checkpoint::Reader r(found->path);
    CHECK(r.step() == found->step);
    CHECK(r.tensor("step").item<float>() == static_cast<float>(found->step));
    CHECK(at::equal(r.tensor("big"), at::full({8 << 20}, 1.0f)));
    // Anything newer was caught mid-save: passed over, and said why.
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      if (name > fs::path(found->path).filename().string()) {
        ++mid_save;
        bool said = false;
        for (const auto& why : found->skipped) said = said || why.find(name) != std::string::npos;
        CHECK_MESSAGE(said, name);
      }
    }
  }
  MESSAGE("killed mid-save in " << mid_save << " of 6 rounds");
}

namespace tandem::test {
// save_loop: saves step 1, 2, ... into $TANDEM_TEST_DIR until killed, each
// a 32 MiB tensor of ones and the step's number.
int worker_main(const std::string& mode) {
  if (mode == "save_loop") {
    const std::string dir = std::getenv("TANDEM_TEST_DIR");
    const at::Tensor big = at::full({8 << 20}, 1.0f);
    for (int64_t step = 1;; ++step) {
      checkpoint::Part p;  // (the big copy first, so that most of a round is the save)
      p.add("big", big);
      p.add("step", at::full({1}, static_cast<float>(step)));
      checkpoint::save(dir, step, p);
    }
  }
  std::fprintf(stderr, "test_checkpoint has no worker mode '%s'\n", mode.c_str());
  return 2;
}
}  // namespace tandem::test
