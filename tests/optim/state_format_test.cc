// The checkpoint format (optim/optimizer_state.h): state_to_bytes writes
// the documented layout, state_from_bytes reads it back, and a truncated,
// altered or lying checkpoint (one whose hash was made to match) is refused
// naming what is wrong, never read past its end.
#include "test_util.h"

#include <climits>
#include <cmath>
#include <cstring>
#include <limits>

#include "tandem/optim/optimizer_state.h"

using namespace tandem;

namespace {

// The format, written from its description: the test's own encoder, so
// that every field can be given a value state_to_bytes would never write.
struct Raw {
  uint32_t version = 1;
  int64_t kind = 2;
  double lr = 0.125;
  struct Part {
    int64_t rank;
    std::string worker;
    int64_t num_params;
    std::string bytes;
  };
  std::vector<Part> parts = {{0, "worker0", 2, std::string("state\0zero", 10)},
                             {3, "w3", 1, "three"}};
  uint64_t declared_parts = UINT64_MAX;  // parts.size() unless set
};

void put(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Appends the hash of everything before it, as a writer would.
std::string sealed(std::string body) {
  put(body, fnv1a(body), 8);
  return body;
}

std::string body_of(const Raw& r) {
  std::string out = "TANDEM-OPTIM-STATE\n";
  put(out, r.version, 4);
  put(out, static_cast<uint64_t>(r.kind), 8);
  uint64_t bits;
  std::memcpy(&bits, &r.lr, sizeof bits);
  put(out, bits, 8);
  put(out, r.declared_parts == UINT64_MAX ? r.parts.size() : r.declared_parts, 8);
  for (const auto& p : r.parts) {
    put(out, static_cast<uint64_t>(p.rank), 8);
    put(out, p.worker.size(), 8);
    out += p.worker;
    put(out, static_cast<uint64_t>(p.num_params), 8);
    put(out, p.bytes.size(), 8);
    out += p.bytes;
  }
  return out;
}

std::string bytes_of(const Raw& r) { return sealed(body_of(r)); }

void refused(const std::string& data, const std::string& text) {
  CHECK_THROWS_WITH_AS(optim::state_from_bytes(data, "ckpt"), doctest::Contains(text.c_str()),
                       std::invalid_argument);
}

}  // namespace

TEST_CASE("optim state format: state_to_bytes writes the documented layout, and it reads back") {
  optim::OptimizerState s;
  s.kind = optim::Kind::kAdamW;
  s.lr = 0.125;
  s.parts = {{0, "worker0", 2, std::string("state\0zero", 10)}, {3, "w3", 1, "three"}};
  const std::string bytes = optim::state_to_bytes(s);
  CHECK(bytes == bytes_of(Raw{}));
  const optim::OptimizerState back = optim::state_from_bytes(bytes);
  CHECK(back.kind == optim::Kind::kAdamW);
  CHECK(back.lr == 0.125);
  REQUIRE(back.parts.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CAPTURE(i);
    CHECK(back.parts[i].rank == s.parts[i].rank);
    CHECK(back.parts[i].worker == s.parts[i].worker);
    CHECK(back.parts[i].num_params == s.parts[i].num_params);
    CHECK(back.parts[i].bytes == s.parts[i].bytes);
  }
  // No parts; every kind; a rate of infinity is a checkpoint's to hold
  // (Options let it through; load_state_dict refuses it, naming it).
  for (int k = 0; k <= 4; ++k) {
    CAPTURE(k);
    optim::OptimizerState e;
    e.kind = static_cast<optim::Kind>(k);
    e.lr = std::numeric_limits<double>::infinity();
    const optim::OptimizerState b = optim::state_from_bytes(optim::state_to_bytes(e));
    CHECK(b.kind == e.kind);
    CHECK(b.lr == e.lr);
    CHECK(b.parts.empty());
  }
  Raw top;
  top.parts = {{INT_MAX, "", 0, ""}};
  CHECK(optim::state_from_bytes(bytes_of(top)).parts.at(0).rank == INT_MAX);
}

TEST_CASE("optim state format: every truncation and every flipped byte is refused") {
  const std::string good = bytes_of(Raw{});
  const std::string body = body_of(Raw{});
  for (size_t n = 0; n < good.size(); ++n) {
    CAPTURE(n);
    CHECK_THROWS_AS(optim::state_from_bytes(good.substr(0, n)), std::invalid_argument);
  }
  // Cut, with a hash made to match: the field that runs out is refused.
  for (size_t n = 19; n < body.size(); ++n) {
    CAPTURE(n);
    CHECK_THROWS_AS(optim::state_from_bytes(sealed(body.substr(0, n))), std::invalid_argument);
  }
  for (size_t i = 0; i < good.size(); ++i) {
    CAPTURE(i);
    std::string flipped = good;
    flipped[i] = static_cast<char>(flipped[i] ^ 0x04);
    CHECK_THROWS_AS(optim::state_from_bytes(flipped), std::invalid_argument);
  }
  refused("PNG\r\n", "ckpt is not an optimizer checkpoint");
  refused("TANDEM-OPTIM-STATE\n1234567", "ckpt is corrupt: it is truncated");
  refused(good.substr(0, good.size() - 1),
          "ckpt is corrupt: its hash does not match (truncated or altered)");
}

TEST_CASE(
    "optim state format: a sealed checkpoint with a field no checkpoint holds is refused, naming "
    "it") {
  // Cut short, each field named. (Part 0 is long, so that the part count
  // fits what is left wherever part 1 is cut.) The offsets: 19 bytes of
  // magic, the version at 19, the kind at 23, lr at 31, the part count at
  // 39; part 0 from 47 (its state's 100 bytes from 86), part 1 from 186.
  Raw long_first;
  long_first.parts[0].bytes = std::string(100, 'x');
  const std::string cut = body_of(long_first);
  REQUIRE(cut.size() == 225);
  refused(sealed(cut.substr(0, 21)), "ckpt is corrupt: its version runs past its end");
  refused(sealed(cut.substr(0, 26)), "ckpt is corrupt: its kind runs past its end");
  refused(sealed(cut.substr(0, 38)), "ckpt is corrupt: its learning rate runs past its end");
  refused(sealed(cut.substr(0, 40)), "ckpt is corrupt: its part count runs past its end");
  refused(sealed(cut.substr(0, 128)), "part 0's optimizer state (100 bytes) runs past its end");
  refused(sealed(cut.substr(0, 191)), "ckpt is corrupt: part 1's rank runs past its end");
  refused(sealed(cut.substr(0, 197)), "part 1's worker name's length runs past its end");
  refused(sealed(cut.substr(0, 203)), "part 1's worker name (2 bytes) runs past its end");
  refused(sealed(cut.substr(0, 208)), "part 1's parameter count runs past its end");
  refused(sealed(cut.substr(0, 214)), "part 1's optimizer state's length runs past its end");
  refused(sealed(cut.substr(0, 223)), "part 1's optimizer state (5 bytes) runs past its end");
  CHECK(optim::state_from_bytes(sealed(cut)).parts.at(1).bytes == "three");

  const std::string body = body_of(Raw{});
  refused(sealed(body + "xyz"), "ckpt is corrupt: 3 bytes after its last part");
  auto with = [](auto change) {
    Raw r;
    change(r);
    return bytes_of(r);
  };
  refused(with([](Raw& r) { r.version = 2; }), "ckpt is corrupt: version 2, this build reads 1");
  refused(with([](Raw& r) { r.kind = 5; }), "ckpt is corrupt: unknown optimizer kind 5");
  refused(with([](Raw& r) { r.kind = -1; }), "unknown optimizer kind -1");
  refused(with([](Raw& r) { r.lr = std::nan(""); }), "ckpt is corrupt: its learning rate is nan");
  refused(with([](Raw& r) { r.lr = -0.5; }), "ckpt is corrupt: its learning rate is -0.5");
  refused(with([](Raw& r) { r.lr = -std::numeric_limits<double>::infinity(); }),
          "its learning rate is -inf");
  refused(with([](Raw& r) { r.declared_parts = 3; }), "ckpt is corrupt: 3 parts cannot fit in it");
  refused(with([](Raw& r) { r.declared_parts = UINT64_MAX - 1; }), "parts cannot fit in it");
  refused(with([](Raw& r) { r.declared_parts = 1; }), "bytes after its last part");
  refused(with([](Raw& r) { r.parts[1].rank = -1; }), "ckpt is corrupt: part 1's rank is -1");
  refused(with([](Raw& r) { r.parts[0].rank = int64_t(1) << 32; }),
          "part 0's rank is 4294967296");  // not read as rank 0
  refused(with([](Raw& r) { r.parts[1].rank = 0; }),
          "ckpt is corrupt: part 1's rank 0 is another part's too");
  refused(with([](Raw& r) { r.parts[0].num_params = -2; }),
          "ckpt is corrupt: part 0's parameter count is -2");
  // A length that claims more than there is, however large (part 0's
  // worker name's length is at 55).
  for (uint64_t n : {uint64_t(8), uint64_t(1) << 40, UINT64_MAX}) {
    CAPTURE(n);
    std::string b = body;
    for (int i = 0; i < 8; ++i) b[55 + i] = static_cast<char>((n >> (8 * i)) & 0xff);
    CHECK_THROWS_WITH_AS(optim::state_from_bytes(sealed(b), "ckpt"), doctest::Contains("part 0's "),
                         std::invalid_argument);
  }
}
