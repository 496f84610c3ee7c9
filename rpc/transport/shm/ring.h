// Byte rings: how the shm backend moves frames (preambles, envelopes and the
// tensors below Limits::min_shared_tensor_bytes) between two processes on
// one host without a system call on the way.
//
//  1. Each direction of a same-host connection has one ring, made by its
//     writer: a sealed memfd (nothing in /dev/shm; gone with the last
//     process that maps it, also after a SIGKILL) holding a header page and
//     `capacity` bytes (a power of two). Its descriptor goes to the reader
//     once, as the first byte on the connection's socket ('R' with
//     SCM_RIGHTS). A writer that could not make one says 'N' instead, and
//     that direction carries its frames through the socket, as TCP does.
//  2. The ring is a byte stream: the writer copies a frame's bytes in and
//     then publishes `head` (release); the reader copies them out into its
//     frame decoder (the same one TCP uses, with the same bounds) and
//     publishes `tail`. Both are counts of bytes since the start, so the
//     ring never confuses full with empty.
//  3. Wake-ups. The socket stays: the reader's loop thread sleeps on it, and
//     the kernel closes it when either process dies, however it dies. A
//     reader about to sleep sets `need_wake` and looks at the ring once
//     more; a writer that published bytes sends one 'W' byte when it finds
//     `need_wake` set (taking it back to 0), unless a reader thread is
//     polling the ring right now (`pollers`). A poller that stops checks
//     the ring once more and hands what is left to its loop thread. Both
//     sides order their store and the other's load with a full fence, so at
//     least one of them always sees the other: no byte is left unread.
//     A writer that finds the ring full sets `writer_waiting` and looks
//     again; a reader that frees space and finds it set sends 'W' back.
//     A reader that could make no ring of its own ('N') writes frames on
//     its socket, so it sends no codes at all: its peer's writer then
//     looks for space again every millisecond instead.
//  3a. Sleeping on the ring. A poller whose spin ran out may sleep on the
//     ring itself instead of behind its loop thread: still counted in
//     `pollers` (so no 'W'), it counts itself in `sleepers`, reads `bell`,
//     looks at the ring once more and waits for `bell` to move (a futex on
//     the shared page: the kernel matches both processes' mappings). A
//     writer that published bytes and finds every poller asleep bumps
//     `bell` and wakes them (FUTEX_WAKE) in place of the 'W', and they read
//     the ring themselves; while one poller is awake, it reads, and nobody
//     is woken (each looks at the ring again before it sleeps or stops). Its own process rings
//     the bell too (ring_bell), to wake it for what comes another way (its
//     answer read by another thread, its call failed, a task for its pool).
//     Every sleep has a bound, so a peer that never rings (a hostile one
//     can clear `sleepers`) costs latency, never a hang.
//  4. A frame that brings new shared-memory segments (segments.h) sends
//     their descriptors first ('F' with SCM_RIGHTS on the socket) and counts
//     them in `announced` before its bytes enter the ring; a reader that
//     sees more announced than it has adopted reads them off the socket
//     before it decodes further.
//  5. The header is written by the other process too, so nothing read from
//     it is trusted: the reader keeps its own tail and capacity and checks
//     that `head` never runs backwards or past a full ring; the writer
//     checks `tail` likewise; the memfd must be sealed, of the size its
//     header says, with a capacity in bounds. A violation throws
//     ProtocolError, which closes that connection.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace tandem::rpc {

// The socket's one-byte codes on a same-host connection (1., 3., 4.).
constexpr char kRingHello = 'R';    // with the writer's ring descriptor
constexpr char kNoRingHello = 'N';  // no ring: frames follow on the socket
constexpr char kRingWake = 'W';
constexpr char kRingFds = 'F';  // with segment descriptors

struct RingHeader;

// The writer's side; made by create(). Used under the connection's write
// lock only.
class RingWriter {
 public:
  // A ring of `capacity` bytes (a power of two), or null with `why`.
  static std::unique_ptr<RingWriter> create(uint64_t capacity, std::string& why);
  ~RingWriter();
  RingWriter(const RingWriter&) = delete;
  RingWriter& operator=(const RingWriter&) = delete;

  int fd() const { return fd_; }
  uint64_t capacity() const { return capacity_; }
  // Copies up to `n` bytes of `p` in (not yet visible); returns how many fit.
  // Throws ProtocolError when the reader's tail is impossible.
  size_t write(const char* p, size_t n);
  // Makes what write() copied visible to the reader (2.).
  void publish();
  // After publish(): whether the reader must be sent a 'W' (3.); a
  // reader sleeping on the ring is woken here instead (3a.), and
  // `futex_woken` says so.
  bool reader_needs_wake(bool* futex_woken = nullptr);
  // The ring is full: asks the reader for a 'W' once it frees space, then
  // looks again; true when there is space after all.
  bool wait_for_space();
  // `n` more segment descriptors went out on the socket (4.).
  void announce(uint64_t n);

 private:
  RingWriter() = default;
  uint64_t free_space();
  int fd_ = -1;
  char* base_ = nullptr;
  uint64_t mapped_ = 0;
  uint64_t capacity_ = 0;
  RingHeader* header_ = nullptr;
  char* data_ = nullptr;
  uint64_t head_ = 0;       // written, published or not
  uint64_t tail_seen_ = 0;  // the reader's tail, last read
};

// The reader's side: the peer's ring, adopted from its descriptor. Used by
// whichever thread holds the connection's read lock, except the pollers'
// count (enter/leave), which any thread may change.
class RingReader {
 public:
  // Takes ownership of `fd` (closes it on error). Throws ProtocolError for
  // anything but a sealed memfd holding a well-formed ring within
  // `max_capacity`.
  explicit RingReader(int fd, uint64_t max_capacity);
  ~RingReader();
  RingReader(const RingReader&) = delete;
  RingReader& operator=(const RingReader&) = delete;

  // Bytes waiting (checked: throws ProtocolError).
  uint64_t readable();
  // Cheap and unchecked, for pollers deciding whether to take the lock.
  bool maybe_readable() const;
  // Copies `n` <= readable() bytes out and frees their space.
  void read(char* dst, size_t n);
  // After read(): whether the writer waits for space and must get a 'W'.
  bool writer_needs_wake();
  // The loop thread is about to sleep (3.): true when bytes came meanwhile.
  bool arm();
  // A polling thread starts or stops reading this ring (3.).
  void enter_polling();
  void leave_polling();
  // Sleeping on the ring (3a.), by a thread that polls it: enter_sleep()
  // counts it among the sleepers and returns the bell to wait on; sleep()
  // waits until the bell moves from `seen` or `timeout` passes (true when
  // it moved); leave_sleep() undoes enter_sleep(). ring_bell() wakes every
  // sleeper, from any thread of this process.
  uint32_t enter_sleep();
  bool sleep(uint32_t seen, std::chrono::microseconds timeout);
  void leave_sleep();
  void ring_bell();
  // Segment descriptors the writer has announced so far (4.).
  uint64_t announced() const;

 private:
  void adopt(uint64_t max_capacity);  // the constructor's checks
  int fd_ = -1;
  char* base_ = nullptr;
  uint64_t mapped_ = 0;
  uint64_t capacity_ = 0;
  RingHeader* header_ = nullptr;
  const char* data_ = nullptr;
  uint64_t tail_ = 0;       // ours; the header's copy is for the writer
  uint64_t head_seen_ = 0;  // the writer's head, last read
};

namespace testing {
// The shared header of a ring, laid out as both sides map it (for tests
// that play a hostile writer).
struct RingLayout {
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr uint32_t kMagic = 0x474e5254;  // "TRNG"
  static constexpr uint32_t kVersion = 2;  // 2: the sleepers' bell (3a.)
  // magic (u32) at 0, version (u32) at 4, capacity (u64) at 8, then:
  static uint64_t head_offset();
  static uint64_t tail_offset();
  static uint64_t need_wake_offset();
  static uint64_t announced_offset();
};
}  // namespace testing

}  // namespace tandem::rpc
