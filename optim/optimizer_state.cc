// The checkpoint format: one encoder (state_to_bytes), one decoder
// (state_from_bytes) that checks every field, and the file around them.
#include "tandem/optim/optimizer_state.h"

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace tandem::optim {
namespace {

constexpr char kMagic[] = "TANDEM-OPTIM-STATE\n";
constexpr size_t kMagicSize = sizeof(kMagic) - 1;
constexpr uint32_t kVersion = 1;
// The fewest bytes a part takes: its rank, two lengths and num_params.
constexpr uint64_t kMinPartSize = 32;

uint64_t fnv1a(const char* data, size_t size) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < size; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 1099511628211ull;
  }
  return h;
}

void put_uint(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_f64(std::string& out, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_uint(out, bits, 8);
}
void put_bytes(std::string& out, const std::string& s) {
  put_uint(out, s.size(), 8);
  out += s;
}

// A number for a message ("-1", "nan", "0.001").
std::string number(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// Reads the fields of a state whose hash matched, each by its name: one
// that runs past the end is still refused (a hash can be made to match),
// naming the field and the source.
class Reader {
 public:
  Reader(const std::string& data, size_t end, const std::string& source)
      : data_(data), end_(end), source_(source) {}
  uint64_t uint(int bytes, const std::string& field) {
    need(static_cast<uint64_t>(bytes), field);
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) {
      v |= static_cast<uint64_t>(static_cast<unsigned char>(data_[pos_ + i])) << (8 * i);
    }
    pos_ += static_cast<size_t>(bytes);
    return v;
  }
  int64_t i64(const std::string& field) { return static_cast<int64_t>(uint(8, field)); }
  double f64(const std::string& field) {
    uint64_t bits = uint(8, field);
    double v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  std::string bytes(const std::string& field) {
    uint64_t n = uint(8, field + "'s length");
    need(n, field + " (" + std::to_string(n) + " bytes)");
    std::string out = data_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return out;
  }
  size_t left() const { return end_ - pos_; }
  [[noreturn]] void bad(const std::string& why) const {
    throw std::invalid_argument(source_ + " is corrupt: " + why);
  }

 private:
  void need(uint64_t n, const std::string& field) const {
    if (n > end_ - pos_) bad(field + " runs past its end");
  }
  const std::string& data_;
  const size_t end_;
  const std::string& source_;
  size_t pos_ = kMagicSize;
};

}  // namespace

std::string state_to_bytes(const OptimizerState& state) {
  std::string out(kMagic, kMagicSize);
  put_uint(out, kVersion, 4);
  put_uint(out, static_cast<uint64_t>(state.kind), 8);
  put_f64(out, state.lr);
  put_uint(out, state.parts.size(), 8);
  for (const auto& p : state.parts) {
    put_uint(out, static_cast<uint64_t>(static_cast<int64_t>(p.rank)), 8);
    put_bytes(out, p.worker);
    put_uint(out, static_cast<uint64_t>(p.num_params), 8);
    put_bytes(out, p.bytes);
  }
  put_uint(out, fnv1a(out.data(), out.size()), 8);
  return out;
}

OptimizerState state_from_bytes(const std::string& data, const std::string& source) {
  if (data.size() < kMagicSize || data.compare(0, kMagicSize, kMagic, kMagicSize) != 0) {
    throw std::invalid_argument(source +
                                " is not an optimizer checkpoint (it does not "
                                "start with TANDEM-OPTIM-STATE)");
  }
  auto corrupt = [&](const std::string& why) {
    return std::invalid_argument(source + " is corrupt: " + why);
  };
  if (data.size() < kMagicSize + 8) throw corrupt("it is truncated");
  // The last 8 bytes hash everything before them.
  const size_t end = data.size() - 8;
  uint64_t stored = 0;
  for (size_t i = 0; i < 8; ++i) {
    stored |= static_cast<uint64_t>(static_cast<unsigned char>(data[end + i])) << (8 * i);
  }
  if (stored != fnv1a(data.data(), end)) {
    throw corrupt("its hash does not match (truncated or altered)");
  }
  Reader in(data, end, source);
  if (uint64_t version = in.uint(4, "its version"); version != kVersion) {
    in.bad("version " + std::to_string(version) + ", this build reads " + std::to_string(kVersion));
  }
  OptimizerState state;
  const int64_t kind = in.i64("its kind");
  if (auto k = kind_from_number(kind)) {
    state.kind = *k;
  } else {
    in.bad("unknown optimizer kind " + std::to_string(kind));
  }
  // No optimizer's rate is NaN or negative, so no state_dict() holds one.
  // (Infinity is let through: Options let it through, and load_state_dict
  // refuses it, naming it.)
  state.lr = in.f64("its learning rate");
  if (std::isnan(state.lr) || state.lr < 0) in.bad("its learning rate is " + number(state.lr));
  const uint64_t parts = in.uint(8, "its part count");
  if (parts > in.left() / kMinPartSize) in.bad(std::to_string(parts) + " parts cannot fit in it");
  std::set<int64_t> ranks;
  for (uint64_t i = 0; i < parts; ++i) {
    const std::string part = "part " + std::to_string(i) + "'s ";
    OptimizerState::Part p;
    // A rank is an int: one outside it would be read as another rank.
    const int64_t rank = in.i64(part + "rank");
    if (rank < 0 || rank > INT_MAX) in.bad(part + "rank is " + std::to_string(rank));
    if (!ranks.insert(rank).second) {
      in.bad(part + "rank " + std::to_string(rank) + " is another part's too");
    }
    p.rank = static_cast<int>(rank);
    p.worker = in.bytes(part + "worker name");
    p.num_params = in.i64(part + "parameter count");
    if (p.num_params < 0) in.bad(part + "parameter count is " + std::to_string(p.num_params));
    p.bytes = in.bytes(part + "optimizer state");
    state.parts.push_back(std::move(p));
  }
  if (in.left() != 0) in.bad(std::to_string(in.left()) + " bytes after its last part");
  return state;
}

void save_state(const OptimizerState& state, const std::string& path) {
  const std::string out = state_to_bytes(state);
  // Beside the target, then renamed over it: never half a checkpoint.
  const std::string tmp = path + ".tmp";
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    if (!file) {
      throw std::runtime_error("cannot write optimizer checkpoint '" + path +
                               "': " + std::strerror(errno));
    }
    file.write(out.data(), static_cast<std::streamsize>(out.size()));
    file.close();
    if (!file) {
      std::remove(tmp.c_str());
      throw std::runtime_error("cannot write optimizer checkpoint '" + path + "'");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot write optimizer checkpoint '" + path + "': " + why);
  }
}

OptimizerState load_state(const std::string& path) {
  std::string data;
  {
    std::ifstream file(path, std::ios::binary);
    if (!file) {
      throw std::runtime_error("cannot open optimizer checkpoint '" + path +
                               "': " + std::strerror(errno));
    }
    std::ostringstream all;
    all << file.rdbuf();
    if (file.bad()) throw std::runtime_error("cannot read optimizer checkpoint '" + path + "'");
    data = std::move(all).str();
  }
  return state_from_bytes(data, "'" + path + "'");
}

}  // namespace tandem::optim
