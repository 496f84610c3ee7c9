// Checkpoints on disk (checkpoint/checkpoint.h): a part per rank, committed
// by rank 0's manifest; latest(); the checked reader.
#include "tandem/checkpoint/checkpoint.h"

#include <ATen/ops/empty.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tandem/checkpoint/manifest.h"
#include "tandem/ddp/process_group.h"

namespace tandem::checkpoint {
namespace fs = std::filesystem;
using detail::EntryIndex;
using detail::Manifest;
using detail::PartIndex;

namespace {

void check_name(const std::string& name, const char* what) {
  if (name.empty() || std::any_of(name.begin(), name.end(), [](char c) {
        return std::isspace(static_cast<unsigned char>(c)) != 0;
      })) {
    throw std::invalid_argument(std::string("checkpoint: ") + what + " '" + name +
                                "' is empty or holds whitespace");
  }
}

std::string errno_text() { return std::strerror(errno); }

// Writes `chunks` to `path` and flushes it to disk; throws naming the path.
void write_durably(const std::string& path,
                   const std::vector<std::pair<const char*, size_t>>& chunks) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("checkpoint: cannot create " + path + ": " + errno_text());
  for (const auto& [data, size] : chunks) {
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::write(fd, data + done, size - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string why = errno_text();
        ::close(fd);
        throw std::runtime_error("checkpoint: cannot write " + path + ": " + why);
      }
      done += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    throw std::runtime_error("checkpoint: cannot flush " + path + ": " + errno_text());
  }
}

void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(what + " is missing");
  std::ostringstream s;
  s << in.rdbuf();
  return std::move(s).str();
}

// Step directories under `dir`, newest first.
std::vector<std::pair<int64_t, std::string>> step_dirs(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step-", 0) != 0) continue;
    try {
      size_t used = 0;
      const long long step = std::stoll(name.substr(5), &used);
      if (used == name.size() - 5) out.emplace_back(step, e.path().string());
    } catch (const std::logic_error&) {
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

// Every rank's error text ("" for none); throws on every rank when any is not empty.
void agree(ddp::ProcessGroup* group, const std::string& mine) {
  std::vector<std::string> all =
      group ? group->all_gather_bytes(mine) : std::vector<std::string>{mine};
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) {
      throw std::runtime_error(
          all.size() > 1 ? "checkpoint: rank " + std::to_string(r) + ": " + all[r] : all[r]);
    }
  }
}

}  // namespace

Part& Part::add(const std::string& name, const at::Tensor& tensor) {
  check_name(name, "entry");
  if (!tensor.defined())
    throw std::invalid_argument("checkpoint: entry '" + name + "' is undefined");
  Entry e;
  e.name = name;
  e.is_tensor = true;
  e.tensor = tensor.detach().to(at::kCPU).contiguous().clone();
  entries_.push_back(std::move(e));
  return *this;
}

Part& Part::add_bytes(const std::string& name, std::string bytes) {
  check_name(name, "entry");
  Entry e;
  e.name = name;
  e.bytes = std::move(bytes);
  entries_.push_back(std::move(e));
  return *this;
}

Part& Part::add_bytes_later(const std::string& name, std::function<std::string()> make) {
  check_name(name, "entry");
  if (!make) throw std::invalid_argument("checkpoint: entry '" + name + "' has no maker");
  Entry e;
  e.name = name;
  e.later = std::move(make);
  entries_.push_back(std::move(e));
  return *this;
}

int restart_count() {
  for (const char* name : {"TANDEM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}) {
    const char* v = std::getenv(name);
    if (v && *v) return std::atoi(v);
  }
  return 0;
}

int remove_steps(const std::string& dir) {
  int removed = 0;
  for (const auto& [step, path] : step_dirs(dir)) {
    std::error_code ec;
    fs::remove_all(path, ec);
    if (!ec) ++removed;
  }
  return removed;
}

std::string step_path(const std::string& dir, int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%010lld", static_cast<long long>(step));
  return (fs::path(dir) / buf).string();
}

namespace {

void check_save(int64_t step, const SaveOptions& options) {
  if (options.keep < 1) throw std::invalid_argument("checkpoint::save: keep must be >= 1");
  if (step < 0) throw std::invalid_argument("checkpoint::save: a negative step");
  for (const auto& [k, v] : options.meta) {
    check_name(k, "meta key");
    if (v.find('\n') != std::string::npos) {
      throw std::invalid_argument("checkpoint::save: meta '" + k + "' holds a newline");
    }
  }
}

}  // namespace

std::string write_part(const std::string& dir, int64_t step, int part, const Part& state) {
  if (step < 0) throw std::invalid_argument("checkpoint::write_part: a negative step");
  if (part < 0) throw std::invalid_argument("checkpoint::write_part: a negative part");
  const std::string path = step_path(dir, step);
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) throw std::runtime_error("checkpoint: cannot make " + path + ": " + ec.message());
  PartIndex index;
  index.rank = part;
  index.file = "part-" + std::to_string(part) + ".bin";
  std::vector<std::pair<const char*, size_t>> chunks{{detail::kPartMagic, detail::kPartHeader}};
  std::vector<EntryIndex> entries;
  uint64_t offset = detail::kPartHeader;
  uint64_t fnv = detail::fnv1a(detail::kPartMagic, detail::kPartHeader);
  std::deque<std::string> made;  // bytes made now (add_bytes_later), kept until written
  for (const auto& e : state.entries()) {
    EntryIndex x;
    x.rank = part;
    x.name = e.name;
    x.is_tensor = e.is_tensor;
    const std::string& bytes = e.later ? made.emplace_back(e.later()) : e.bytes;
    const char* data = e.is_tensor ? static_cast<const char*>(e.tensor.data_ptr()) : bytes.data();
    const size_t size = e.is_tensor ? e.tensor.nbytes() : bytes.size();
    if (e.is_tensor) {
      x.dtype = static_cast<int64_t>(e.tensor.scalar_type());
      x.shape = e.tensor.sizes().vec();
    }
    x.offset = offset;
    x.bytes = size;
    offset += size;
    fnv = detail::fnv1a(data, size, fnv);
    chunks.emplace_back(data, size);
    entries.push_back(std::move(x));
  }
  index.bytes = offset;
  index.fnv = fnv;
  const std::string final_path = (fs::path(path) / index.file).string();
  write_durably(final_path + ".tmp", chunks);
  if (::rename((final_path + ".tmp").c_str(), final_path.c_str()) != 0) {
    throw std::runtime_error("checkpoint: cannot rename " + final_path + ".tmp: " + errno_text());
  }
  return detail::part_lines(index, entries);
}

void commit(const std::string& dir, int64_t step, int ranks,
            const std::vector<std::string>& indexes, const SaveOptions& options) {
  check_save(step, options);
  const std::string path = step_path(dir, step);
  // Every rank's part, no part twice, each name once.
  std::map<std::string, size_t> owner;
  std::set<int> seen;
  for (size_t r = 0; r < indexes.size(); ++r) {
    std::istringstream in(indexes[r]);
    for (std::string l; std::getline(in, l);) {
      std::istringstream f(l);
      std::string kind, rk, name;
      f >> kind >> rk >> name;
      if (kind == "part") {
        const int part = std::atoi(rk.c_str());
        if (part < 0 || !seen.insert(part).second) {
          throw std::invalid_argument("checkpoint::commit: part " + rk +
                                      " is negative or given twice");
        }
        continue;
      }
      auto [it, fresh] = owner.emplace(name, r);
      if (!fresh) {
        throw std::invalid_argument(
            indexes.size() > 1 ? "checkpoint::save: ranks " + std::to_string(it->second) + " and " +
                                     std::to_string(r) + " both save '" + name + "'"
                               : "checkpoint::save: two parts save '" + name + "'");
      }
    }
  }
  for (int r = 0; r < ranks; ++r) {
    if (!seen.count(r)) {
      throw std::invalid_argument("checkpoint::commit: no part of rank " + std::to_string(r) +
                                  " (of " + std::to_string(ranks) + ")");
    }
  }
  if (seen.empty()) throw std::invalid_argument("checkpoint::commit: no part");
  Manifest head;
  head.step = step;
  head.world = *seen.rbegin() + 1;
  head.meta = options.meta;
  const std::string text = detail::encode(head, indexes);
  const std::string manifest = (fs::path(path) / "MANIFEST").string();
  write_durably(manifest + ".tmp", {{text.data(), text.size()}});
  if (::rename((manifest + ".tmp").c_str(), manifest.c_str()) != 0) {
    throw std::runtime_error("checkpoint: cannot rename " + manifest + ".tmp: " + errno_text());
  }
  sync_dir(path);
  // Keep the newest `keep` complete ones; drop anything older.
  int complete = 0;
  for (const auto& [s, p] : step_dirs(dir)) {
    bool valid = false;
    try {
      detail::decode(read_file((fs::path(p) / "MANIFEST").string(), p), p);
      valid = true;
    } catch (const std::exception&) {
    }
    if (valid && complete < options.keep) {
      ++complete;
      continue;
    }
    if (complete > 0 && s < step) {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  }
  sync_dir(dir);
}

namespace detail {

RemoteStart start_remote(const std::string& dir, int64_t step,
                         const std::vector<RemotePartWriter>& remote, const SaveOptions& options) {
  check_save(step, options);
  ddp::ProcessGroup* group = options.group.get();
  const int rank = group ? group->rank() : 0;
  const int world = group ? group->size() : 1;
  // Parts: one per rank (its rank), then rank r's k-th remote one is
  // world * (k + 1) + r: numbers no rank needs to ask the others about.
  RemoteStart out;
  out.ranks = world;
  std::vector<std::optional<RemotePart>> parts(remote.size());
  // All asked at once; the step goes on once every copy is made.
  const auto start = [&](const std::vector<size_t>& which) {
    for (size_t k : which) {
      try {
        parts[k] = remote[k](dir, step, world * (static_cast<int>(k) + 1) + rank);
      } catch (const std::exception& e) {
        if (out.error.empty()) out.error = e.what();
      }
    }
    for (size_t k : which) {
      try {
        if (parts[k]) parts[k]->copied();
      } catch (const std::exception& e) {
        if (out.error.empty()) out.error = e.what();
      }
    }
  };
  std::vector<size_t> all(remote.size());
  for (size_t k = 0; k < all.size(); ++k) all[k] = k;
  start(all);
  // A worker's parts of several moments (a step fell between their
  // copies) are made again, each once its first write is done, until
  // they agree.
  constexpr int kTries = 8;
  for (int tries = 1; out.error.empty(); ++tries) {
    std::map<std::string, std::set<int64_t>> moments;
    for (auto& part : parts) {
      if (!part || part->where.empty() || !part->moment) continue;
      try {
        moments[part->where].insert(part->moment());
      } catch (const std::exception& e) {
        if (out.error.empty()) out.error = e.what();
      }
    }
    std::set<std::string> mixed;
    for (const auto& [where, seen] : moments) {
      if (seen.size() > 1) mixed.insert(where);
    }
    if (mixed.empty() || !out.error.empty()) break;
    if (tries == kTries) {
      const auto& seen = moments.at(*mixed.begin());
      out.error = "checkpoint: steps on " + *mixed.begin() +
                  " kept falling between the copies of " + "its parts of step " +
                  std::to_string(step) + " (" + std::to_string(kTries) +
                  " tries, last at its steps " + std::to_string(*seen.begin()) + " to " +
                  std::to_string(*seen.rbegin()) + ")";
      break;
    }
    std::vector<size_t> again;
    for (size_t k = 0; k < parts.size(); ++k) {
      if (!parts[k] || !mixed.count(parts[k]->where)) continue;
      try {
        parts[k]->written();  // (then replaced: one write of a part at a time)
      } catch (const std::exception&) {
      }
      parts[k].reset();
      again.push_back(k);
    }
    start(again);
  }
  for (auto& part : parts) {
    if (part) out.started.push_back(std::move(*part));
  }
  return out;
}

void finish_save(const std::string& dir, int64_t step, const Part& mine, RemoteStart remote,
                 const SaveOptions& options) {
  ddp::ProcessGroup* group = options.group.get();
  const int rank = group ? group->rank() : 0;
  // 1. This rank's part durably, and the remote ones it asked for; their indexes.
  std::string error = remote.error, lines;
  try {
    lines = write_part(dir, step, rank, mine);
  } catch (const std::exception& e) {
    if (error.empty()) error = e.what();
  }
  for (auto& part : remote.started) {  // every one waited for, even after an error
    try {
      lines += part.written();
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
  }
  agree(group, error);
  // 2. Rank 0 commits the step with its manifest, then prunes.
  std::vector<std::string> all =
      group ? group->gather_bytes(lines, 0) : std::vector<std::string>{lines};
  error.clear();
  if (rank == 0) {
    try {
      commit(dir, step, remote.ranks, all, options);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  agree(group, error);
}

}  // namespace detail

void save(const std::string& dir, int64_t step, const Part& mine, const SaveOptions& options) {
  save_parts(dir, step, mine, {}, options);
}

void save_parts(const std::string& dir, int64_t step, const Part& mine,
                const std::vector<RemotePartWriter>& remote, const SaveOptions& options) {
  detail::finish_save(dir, step, mine, detail::start_remote(dir, step, remote, options), options);
}

std::optional<Found> latest(const std::string& dir, const LatestOptions& options) {
  Found found;
  for (const auto& [step, path] : step_dirs(dir)) {
    try {
      const std::string manifest = (fs::path(path) / "MANIFEST").string();
      if (options.verify) {
        Reader(path).verify();
      } else {
        detail::decode(read_file(manifest, manifest), manifest);
      }
      found.step = step;
      found.path = path;
      return found;
    } catch (const std::exception& e) {
      const bool complete = fs::exists(fs::path(path) / "MANIFEST");
      // (a step without a manifest was never committed: passed over either way)
      if (options.verify && options.refuse_damaged && complete) {
        throw std::invalid_argument("the newest checkpoint, step " + std::to_string(step) +
                                    ", is damaged: " + e.what());
      }
      found.skipped.push_back(path + ": " + e.what());
      if (options.passed_over) options.passed_over->push_back(found.skipped.back());
    }
  }
  return std::nullopt;
}

struct Reader::Impl {
  std::string path;
  Manifest m;
  std::map<std::string, const EntryIndex*> by_name;
  std::map<int, const PartIndex*> parts;
  mutable std::mutex mu;
  mutable std::map<int, std::string> verified;  // rank -> its part's bytes, once checked

  const std::string& part_bytes(int rank) const {
    std::lock_guard<std::mutex> lock(mu);
    auto it = verified.find(rank);
    if (it != verified.end()) return it->second;
    const PartIndex& p = *parts.at(rank);
    const std::string file = (fs::path(path) / p.file).string();
    std::string data = read_file(file, file);
    if (data.size() != p.bytes) {
      throw std::invalid_argument(file + " has " + std::to_string(data.size()) +
                                  " bytes, the manifest says " + std::to_string(p.bytes) +
                                  " (truncated, or another checkpoint's)");
    }
    if (data.compare(0, detail::kPartHeader, detail::kPartMagic) != 0 ||
        detail::fnv1a(data.data(), data.size()) != p.fnv) {
      throw std::invalid_argument(file +
                                  ": its checksum does not match the manifest's (altered, "
                                  "or another checkpoint's part)");
    }
    return verified.emplace(rank, std::move(data)).first->second;
  }

  const EntryIndex& entry(const std::string& name) const {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      throw std::invalid_argument(path + " holds no '" + name + "'");
    }
    return *it->second;
  }
};

Reader::Reader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  const std::string manifest = (fs::path(path) / "MANIFEST").string();
  impl_->m = detail::decode(read_file(manifest, manifest), manifest);
  for (const auto& p : impl_->m.parts) impl_->parts[p.rank] = &p;
  for (const auto& e : impl_->m.entries) impl_->by_name[e.name] = &e;
}

Reader::~Reader() = default;

void Reader::verify() const {
  std::vector<char> buffer(1 << 20);
  for (const auto& p : impl_->m.parts) {
    const std::string file = (fs::path(impl_->path) / p.file).string();
    std::ifstream in(file, std::ios::binary);
    if (!in) throw std::invalid_argument(file + " is missing");
    uint64_t size = 0;
    uint64_t fnv = detail::fnv1a(nullptr, 0);
    bool magic = true;
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      const auto n = static_cast<size_t>(in.gcount());
      if (n == 0) break;
      if (size < detail::kPartHeader) {
        const size_t k = std::min<size_t>(n, detail::kPartHeader - size);
        magic = magic && std::memcmp(buffer.data(), detail::kPartMagic + size, k) == 0;
      }
      fnv = detail::fnv1a(buffer.data(), n, fnv);
      size += n;
    }
    if (in.bad()) throw std::invalid_argument(file + " cannot be read: " + std::strerror(errno));
    if (size != p.bytes) {
      throw std::invalid_argument(file + " has " + std::to_string(size) +
                                  " bytes, the manifest says " + std::to_string(p.bytes) +
                                  " (truncated, or another checkpoint's)");
    }
    if (!magic || fnv != p.fnv) {
      throw std::invalid_argument(file +
                                  ": its checksum does not match the manifest's (altered, "
                                  "or another checkpoint's part)");
    }
  }
}

int64_t Reader::step() const { return impl_->m.step; }
int Reader::world_size() const { return impl_->m.world; }
const std::string& Reader::path() const { return impl_->path; }

std::vector<std::string> Reader::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : impl_->by_name) out.push_back(name);
  return out;
}

bool Reader::contains(const std::string& name) const { return impl_->by_name.count(name) > 0; }

int Reader::rank_of(const std::string& name) const { return impl_->entry(name).rank; }

at::Tensor Reader::tensor(const std::string& name) const {
  const EntryIndex& e = impl_->entry(name);
  if (!e.is_tensor)
    throw std::invalid_argument(impl_->path + ": '" + name + "' is bytes, not a tensor");
  const auto dtype = static_cast<at::ScalarType>(e.dtype);
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(dtype));
  if (t.nbytes() != e.bytes) {
    throw std::invalid_argument(impl_->path + ": '" + name + "' has " + std::to_string(e.bytes) +
                                " bytes, its shape and dtype " + std::to_string(t.nbytes()));
  }
  const std::string& data = impl_->part_bytes(e.rank);
  std::memcpy(t.data_ptr(), data.data() + e.offset, e.bytes);
  return t;
}

void Reader::check(const std::string& name) const { impl_->part_bytes(impl_->entry(name).rank); }

std::vector<int64_t> Reader::shape(const std::string& name) const {
  const EntryIndex& e = impl_->entry(name);
  if (!e.is_tensor)
    throw std::invalid_argument(impl_->path + ": '" + name + "' is bytes, not a tensor");
  return e.shape;
}

std::string Reader::bytes(const std::string& name) const {
  const EntryIndex& e = impl_->entry(name);
  if (e.is_tensor)
    throw std::invalid_argument(impl_->path + ": '" + name + "' is a tensor, not bytes");
  return impl_->part_bytes(e.rank).substr(e.offset, e.bytes);
}

const std::map<std::string, std::string>& Reader::meta() const { return impl_->m.meta; }

void Reader::expect_meta(const std::string& key, const std::string& value) const {
  auto it = impl_->m.meta.find(key);
  if (it == impl_->m.meta.end() || it->second != value) {
    throw std::invalid_argument(impl_->path + ": its " + key + " is '" +
                                (it == impl_->m.meta.end() ? std::string("(none)") : it->second) +
                                "', this job's '" + value + "'");
  }
}

}  // namespace tandem::checkpoint
