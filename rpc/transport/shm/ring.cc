#include "tandem/rpc/transport/shm/ring.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>
#include <ctime>

#include "tandem/rpc/errors.h"

namespace tandem::rpc {

using testing::RingLayout;

struct RingHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t capacity;
  alignas(64) std::atomic<uint64_t> head;            // the writer's
  alignas(64) std::atomic<uint64_t> tail;            // the reader's
  alignas(64) std::atomic<uint32_t> need_wake;       // the reader sleeps: wake it
  alignas(64) std::atomic<uint32_t> pollers;         // reader threads polling now
  alignas(64) std::atomic<uint32_t> writer_waiting;  // the writer waits for space
  alignas(64) std::atomic<uint64_t> announced;       // segment descriptors sent
  alignas(64) std::atomic<uint32_t> bell;            // moves to wake sleepers (3a.)
  alignas(64) std::atomic<uint32_t> sleepers;        // reader threads asleep on `bell`
};
static_assert(sizeof(RingHeader) <= RingLayout::kHeaderBytes, "ring header fits its page");
static_assert(offsetof(RingHeader, version) == 4 && offsetof(RingHeader, capacity) == 8,
              "the layout RingLayout describes");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "ring counters shared across processes");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the bell is a futex word");

namespace {

constexpr uint32_t kVersion = RingLayout::kVersion;
constexpr uint64_t kMinCapacity = 4096;
constexpr unsigned kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

bool power_of_two(uint64_t n) { return n != 0 && (n & (n - 1)) == 0; }

// The bell as a futex. Not FUTEX_PRIVATE: the word is in a shared mapping,
// and the kernel keys it by the memfd's page, which both processes map.
uint32_t* futex_word(std::atomic<uint32_t>& a) { return reinterpret_cast<uint32_t*>(&a); }

void wake_all(std::atomic<uint32_t>& bell) {
  bell.fetch_add(1, std::memory_order_seq_cst);
  ::syscall(SYS_futex, futex_word(bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Copies `n` bytes between the ring's data at logical position `pos` and
// `flat`, in one or two pieces around the end.
void copy_out(const char* data, uint64_t capacity, uint64_t pos, char* flat, size_t n) {
  const uint64_t at = pos & (capacity - 1);
  const size_t first = static_cast<size_t>(std::min<uint64_t>(n, capacity - at));
  std::memcpy(flat, data + at, first);
  if (first < n) std::memcpy(flat + first, data, n - first);
}
void copy_in(char* data, uint64_t capacity, uint64_t pos, const char* flat, size_t n) {
  const uint64_t at = pos & (capacity - 1);
  const size_t first = static_cast<size_t>(std::min<uint64_t>(n, capacity - at));
  std::memcpy(data + at, flat, first);
  if (first < n) std::memcpy(data, flat + first, n - first);
}

}  // namespace

uint64_t RingLayout::head_offset() { return offsetof(RingHeader, head); }
uint64_t RingLayout::tail_offset() { return offsetof(RingHeader, tail); }
uint64_t RingLayout::need_wake_offset() { return offsetof(RingHeader, need_wake); }
uint64_t RingLayout::announced_offset() { return offsetof(RingHeader, announced); }

// ---- RingWriter --------------------------------------------------------------------

std::unique_ptr<RingWriter> RingWriter::create(uint64_t capacity, std::string& why) {
  if (!power_of_two(capacity) || capacity < kMinCapacity) {
    why = "ring capacity " + std::to_string(capacity) + " is not a power of two >= 4096";
    return nullptr;
  }
  std::unique_ptr<RingWriter> w(new RingWriter());
  w->fd_ = ::memfd_create("tandem-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (w->fd_ < 0) {
    why = std::string("memfd_create: ") + std::strerror(errno);
    return nullptr;
  }
  w->mapped_ = RingLayout::kHeaderBytes + capacity;
  if (::ftruncate(w->fd_, static_cast<off_t>(w->mapped_)) != 0) {
    why = std::string("ftruncate of a ring: ") + std::strerror(errno);
    return nullptr;
  }
  if (::fcntl(w->fd_, F_ADD_SEALS, kSeals) != 0) {
    why = std::string("sealing a ring: ") + std::strerror(errno);
    return nullptr;
  }
  void* p = ::mmap(nullptr, w->mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, w->fd_, 0);
  if (p == MAP_FAILED) {
    why = std::string("mapping a ring: ") + std::strerror(errno);
    return nullptr;
  }
  w->base_ = static_cast<char*>(p);
  w->capacity_ = capacity;
  w->header_ = new (w->base_) RingHeader();  // the fresh memfd is zeroed
  w->header_->magic = RingLayout::kMagic;
  w->header_->version = kVersion;
  w->header_->capacity = capacity;
  w->header_->need_wake.store(1, std::memory_order_relaxed);  // nobody reads yet
  w->data_ = w->base_ + RingLayout::kHeaderBytes;
  return w;
}

RingWriter::~RingWriter() {
  if (base_) ::munmap(base_, mapped_);
  if (fd_ >= 0) ::close(fd_);
}

uint64_t RingWriter::free_space() {
  const uint64_t tail = header_->tail.load(std::memory_order_acquire);
  if (tail < tail_seen_ || tail > head_) {
    throw ProtocolError("ring tail " + std::to_string(tail) + " outside [" +
                        std::to_string(tail_seen_) + ", " + std::to_string(head_) + "]");
  }
  tail_seen_ = tail;
  return capacity_ - (head_ - tail);
}

size_t RingWriter::write(const char* p, size_t n) {
  const size_t k = static_cast<size_t>(std::min<uint64_t>(n, free_space()));
  if (k == 0) return 0;
  copy_in(data_, capacity_, head_, p, k);
  head_ += k;
  return k;
}

void RingWriter::publish() { header_->head.store(head_, std::memory_order_release); }

bool RingWriter::reader_needs_wake(bool* futex_woken) {
  // Our head store, then their flags: ordered against the reader's flag
  // store, then its look at head (3.).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const uint32_t pollers = header_->pollers.load(std::memory_order_relaxed);
  if (pollers != 0) {
    // A poller reads it: one awake does (each looks at the ring again before
    // it sleeps or stops); when every one sleeps, the bell wakes them (3a.).
    const uint32_t sleepers = header_->sleepers.load(std::memory_order_relaxed);
    if (sleepers != 0 && sleepers >= pollers) {
      wake_all(header_->bell);
      if (futex_woken) *futex_woken = true;
    }
    return false;
  }
  if (header_->need_wake.load(std::memory_order_relaxed) == 0) return false;
  return header_->need_wake.exchange(0, std::memory_order_acq_rel) != 0;
}

bool RingWriter::wait_for_space() {
  header_->writer_waiting.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (free_space() == 0) return false;
  header_->writer_waiting.store(0, std::memory_order_relaxed);
  return true;
}

void RingWriter::announce(uint64_t n) {
  header_->announced.store(header_->announced.load(std::memory_order_relaxed) + n,
                           std::memory_order_release);
}

// ---- RingReader --------------------------------------------------------------------

RingReader::RingReader(int fd, uint64_t max_capacity) : fd_(fd) {
  try {
    adopt(max_capacity);
  } catch (...) {
    // A throwing constructor runs no destructor: let go of the peer's ring here.
    if (base_) ::munmap(base_, mapped_);
    ::close(fd_);
    throw;
  }
}

void RingReader::adopt(uint64_t max_capacity) {
  const int seals = ::fcntl(fd_, F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    throw ProtocolError("peer's ring is not a memfd sealed against shrinking");
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<uint64_t>(st.st_size) < RingLayout::kHeaderBytes + kMinCapacity ||
      static_cast<uint64_t>(st.st_size) > RingLayout::kHeaderBytes + max_capacity) {
    throw ProtocolError("peer's ring has an unusable size (" + std::to_string(st.st_size) +
                        " bytes; at most " + std::to_string(max_capacity) + " of data allowed)");
  }
  void* p = ::mmap(nullptr, static_cast<uint64_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED,
                   fd_, 0);
  if (p == MAP_FAILED) {
    throw ProtocolError(std::string("cannot map the peer's ring: ") + std::strerror(errno));
  }
  mapped_ = static_cast<uint64_t>(st.st_size);
  base_ = static_cast<char*>(p);
  header_ = reinterpret_cast<RingHeader*>(base_);
  const uint64_t capacity = header_->capacity;
  if (header_->magic != RingLayout::kMagic || header_->version != kVersion ||
      !power_of_two(capacity) || capacity != mapped_ - RingLayout::kHeaderBytes) {
    throw ProtocolError("peer's ring header is malformed (magic, version or capacity " +
                        std::to_string(capacity) + ")");
  }
  capacity_ = capacity;
  data_ = base_ + RingLayout::kHeaderBytes;
  tail_ = head_seen_ = header_->tail.load(std::memory_order_acquire);
  if (tail_ != 0 || header_->head.load(std::memory_order_acquire) > capacity_) {
    throw ProtocolError("peer's ring does not start empty");
  }
}

RingReader::~RingReader() {
  if (base_) ::munmap(base_, mapped_);
  if (fd_ >= 0) ::close(fd_);
}

uint64_t RingReader::readable() {
  const uint64_t head = header_->head.load(std::memory_order_acquire);
  if (head < head_seen_ || head - tail_ > capacity_) {
    throw ProtocolError("ring head " + std::to_string(head) + " outside [" +
                        std::to_string(head_seen_) + ", " + std::to_string(tail_ + capacity_) +
                        "]");
  }
  head_seen_ = head;
  return head - tail_;
}

bool RingReader::maybe_readable() const {
  // The shared tail, not tail_: any thread may ask, without the read lock.
  return header_->head.load(std::memory_order_relaxed) !=
         header_->tail.load(std::memory_order_relaxed);
}

void RingReader::read(char* dst, size_t n) {
  copy_out(data_, capacity_, tail_, dst, n);
  tail_ += n;
  header_->tail.store(tail_, std::memory_order_release);
}

bool RingReader::writer_needs_wake() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (header_->writer_waiting.load(std::memory_order_relaxed) == 0) return false;
  return header_->writer_waiting.exchange(0, std::memory_order_acq_rel) != 0;
}

bool RingReader::arm() {
  header_->need_wake.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return header_->head.load(std::memory_order_relaxed) != tail_;
}

void RingReader::enter_polling() { header_->pollers.fetch_add(1, std::memory_order_seq_cst); }

void RingReader::leave_polling() {
  header_->pollers.fetch_sub(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

uint32_t RingReader::enter_sleep() {
  // Counted first, then the bell read, then (by the caller) the ring looked
  // at: a writer whose bytes that look misses finds us counted and moves
  // the bell after we read it (all seq_cst), so the sleep returns at once.
  header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
  return header_->bell.load(std::memory_order_seq_cst);
}

bool RingReader::sleep(uint32_t seen, std::chrono::microseconds timeout) {
  if (header_->bell.load(std::memory_order_seq_cst) != seen) return true;
  if (timeout.count() <= 0) return false;
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000) * 1000;
  // EAGAIN: it moved before we slept; EINTR, ETIMEDOUT: the caller looks again.
  ::syscall(SYS_futex, futex_word(header_->bell), FUTEX_WAIT, seen, &ts, nullptr, 0);
  return header_->bell.load(std::memory_order_seq_cst) != seen;
}

void RingReader::leave_sleep() { header_->sleepers.fetch_sub(1, std::memory_order_seq_cst); }

void RingReader::ring_bell() { wake_all(header_->bell); }

uint64_t RingReader::announced() const {
  return header_->announced.load(std::memory_order_acquire);
}

}  // namespace tandem::rpc
