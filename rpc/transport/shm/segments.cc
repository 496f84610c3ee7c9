#include "tandem/rpc/transport/shm/segments.h"

#include <ATen/ops/from_blob.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>

namespace tandem::rpc {
namespace {

constexpr uint32_t kBlockMagic = 0x42485354;  // "TSHB"
constexpr uint64_t kHeaderBytes = 64;
constexpr uint64_t kFirstSegmentBytes = 16ull << 20;
constexpr uint64_t kSegmentBytes = 64ull << 20;
constexpr uint64_t kSegmentRound = 2ull << 20;
constexpr unsigned kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

enum BlockState : uint32_t { kFree = 0, kSent = 1, kHeld = 2 };

// Sits in the segment, just before the block's bytes; both sides map it.
struct BlockHeader {
  uint32_t magic;
  std::atomic<uint32_t> state;
  uint64_t bytes;  // the block's usable length, as the sender made it
  char pad[kHeaderBytes - 16];
};
static_assert(sizeof(BlockHeader) == kHeaderBytes, "block header layout");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "state word shared across processes");

uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

std::mutex g_fail_mu;
std::string g_fail_why;

std::string failing() {
  std::lock_guard<std::mutex> lock(g_fail_mu);
  return g_fail_why;
}

}  // namespace

namespace testing {
void fail_shared_segments(const std::string& why) {
  std::lock_guard<std::mutex> lock(g_fail_mu);
  g_fail_why = why;
}
std::string shared_segments_failure() { return failing(); }
}  // namespace testing

// ---- SegmentWriter ---------------------------------------------------------------

struct SegmentWriter::Segment {
  int fd = -1;
  char* base = nullptr;
  uint64_t size = 0;
  std::map<uint64_t, uint64_t> free;         // offset -> length, coalesced
  std::map<uint64_t, uint64_t> outstanding;  // header offset -> block length (with header)
  ~Segment() {
    if (base) ::munmap(base, size);
    if (fd >= 0) ::close(fd);
  }
  BlockHeader* header(uint64_t at) { return reinterpret_cast<BlockHeader*>(base + at); }

  void release(uint64_t at, uint64_t len) {
    auto next = free.lower_bound(at);
    if (next != free.end() && at + len == next->first) {  // merge with the following run
      len += next->second;
      next = free.erase(next);
    }
    if (next != free.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == at) {  // and with the preceding one
        prev->second += len;
        return;
      }
    }
    free.emplace(at, len);
  }
  // Takes back every block whose receiver let go of it.
  void reclaim() {
    for (auto it = outstanding.begin(); it != outstanding.end();) {
      if (header(it->first)->state.load(std::memory_order_acquire) == kFree) {
        release(it->first, it->second);
        it = outstanding.erase(it);
      } else {
        ++it;
      }
    }
  }
  // First fit, lowest offset first: a steady stream keeps reusing warm pages.
  std::optional<uint64_t> take(uint64_t len) {
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->second < len) continue;
      const uint64_t at = it->first;
      const uint64_t rest = it->second - len;
      free.erase(it);
      if (rest) free.emplace(at + len, rest);
      outstanding.emplace(at, len);
      return at;
    }
    return std::nullopt;
  }
};

SegmentWriter::SegmentWriter(const Limits& limits) : limits_(limits) {}
SegmentWriter::~SegmentWriter() = default;

bool SegmentWriter::grow(uint64_t need, std::vector<int>& announce) {
  if (!unavailable_.empty()) return false;
  if (segments_.size() >= limits_.max_shared_segments) return false;
  uint64_t size = round_up(std::max(segments_.empty() ? kFirstSegmentBytes : kSegmentBytes, need),
                           kSegmentRound);
  if (mapped_bytes_ + size > limits_.max_shared_bytes) {
    if (mapped_bytes_ + need > limits_.max_shared_bytes) return false;
    size = limits_.max_shared_bytes - mapped_bytes_;
  }
  const std::string fail = failing();
  if (!fail.empty()) {
    unavailable_ = fail;
    return false;
  }
  auto seg = std::make_unique<Segment>();
  seg->fd = ::memfd_create("tandem-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (seg->fd < 0) {
    unavailable_ = std::string("memfd_create: ") + std::strerror(errno);
    return false;
  }
  if (::ftruncate(seg->fd, static_cast<off_t>(size)) != 0) {
    unavailable_ = std::string("ftruncate of a ") + std::to_string(size >> 20) +
                   " MiB segment: " + std::strerror(errno);
    return false;
  }
  if (::fcntl(seg->fd, F_ADD_SEALS, kSeals) != 0) {
    unavailable_ = std::string("sealing a segment: ") + std::strerror(errno);
    return false;
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, seg->fd, 0);
  if (p == MAP_FAILED) {
    unavailable_ = std::string("mapping a segment: ") + std::strerror(errno);
    return false;
  }
  seg->base = static_cast<char*>(p);
  seg->size = size;
  seg->free.emplace(0, size);
  announce.push_back(seg->fd);
  mapped_bytes_ += size;
  segments_.push_back(std::move(seg));
  return true;
}

std::optional<SharedRef> SegmentWriter::place(const at::Tensor& t, uint32_t index,
                                              std::vector<int>& announce) {
  const uint64_t n = t.nbytes();
  const uint64_t len = kHeaderBytes + round_up(n, kTensorAlignment);
  std::optional<uint64_t> at;
  uint32_t which = 0;
  for (; which < segments_.size(); ++which) {
    segments_[which]->reclaim();
    if ((at = segments_[which]->take(len))) break;
  }
  if (!at) {
    if (!grow(len, announce)) return std::nullopt;
    which = static_cast<uint32_t>(segments_.size() - 1);
    at = segments_[which]->take(len);
    if (!at) return std::nullopt;  // cannot happen: a fresh segment fits `len`
  }
  Segment& seg = *segments_[which];
  BlockHeader* h = seg.header(*at);
  h->magic = kBlockMagic;
  h->bytes = len - kHeaderBytes;
  std::memcpy(seg.base + *at + kHeaderBytes, t.data_ptr(), n);
  // Published before the frame that names it is written (release).
  h->state.store(kSent, std::memory_order_release);
  return SharedRef{index, which, *at + kHeaderBytes};
}

// ---- SegmentReader ---------------------------------------------------------------

struct SegmentReader::Mapping {
  int fd = -1;
  char* base = nullptr;
  uint64_t size = 0;
  ~Mapping() {
    if (base) ::munmap(base, size);
    if (fd >= 0) ::close(fd);
  }
};

void SegmentReader::adopt(int fd) {
  auto m = std::make_shared<Mapping>();
  m->fd = fd;  // closed by ~Mapping on every path
  if (mappings_.size() >= limits_.max_shared_segments) {
    throw ProtocolError("peer announced more than " + std::to_string(limits_.max_shared_segments) +
                        " shared segments");
  }
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    throw ProtocolError("peer sent a descriptor that is not a memfd sealed against shrinking");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) {
    throw ProtocolError("peer sent an unusable shared segment");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > limits_.max_shared_bytes - std::min(mapped_bytes_, limits_.max_shared_bytes)) {
    throw ProtocolError("peer's shared segments exceed " +
                        std::to_string(limits_.max_shared_bytes) + " bytes");
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw ProtocolError(std::string("cannot map the peer's shared segment: ") +
                        std::strerror(errno));
  }
  m->base = static_cast<char*>(p);
  m->size = size;
  mapped_bytes_ += size;
  mappings_.push_back(std::move(m));
}

at::Tensor SegmentReader::tensor(const SharedRef& ref, c10::ScalarType dtype,
                                 const std::vector<int64_t>& shape, uint64_t nbytes) {
  const std::string which = "shared tensor " + std::to_string(ref.tensor) + ": ";
  if (ref.segment >= mappings_.size()) {
    throw ProtocolError(which + "names segment " + std::to_string(ref.segment) + " of " +
                        std::to_string(mappings_.size()) + " announced");
  }
  const auto& m = mappings_[ref.segment];
  uint64_t end = 0;
  if (ref.offset < kHeaderBytes || ref.offset % kTensorAlignment != 0 ||
      __builtin_add_overflow(ref.offset, nbytes, &end) || end > m->size) {
    throw ProtocolError(which + "offset " + std::to_string(ref.offset) + " and " +
                        std::to_string(nbytes) + " bytes do not fit its segment of " +
                        std::to_string(m->size));
  }
  auto* h = reinterpret_cast<BlockHeader*>(m->base + ref.offset - kHeaderBytes);
  if (h->magic != kBlockMagic || h->bytes < nbytes) {
    throw ProtocolError(which + "no block of " + std::to_string(nbytes) + " bytes at offset " +
                        std::to_string(ref.offset));
  }
  uint32_t expect = kSent;
  if (!h->state.compare_exchange_strong(expect, kHeld, std::memory_order_acq_rel)) {
    throw ProtocolError(which + "block at offset " + std::to_string(ref.offset) +
                        " was not freshly sent (state " + std::to_string(expect) + ")");
  }
  // The tensor keeps the mapping alive; when it dies, the block goes back
  // to the sender (which may be gone by then: the mapping outlives it).
  auto keep = m;
  return at::from_blob(
      m->base + ref.offset, shape,
      [keep, h](void*) { h->state.store(kFree, std::memory_order_release); },
      at::TensorOptions().dtype(dtype));
}

}  // namespace tandem::rpc
