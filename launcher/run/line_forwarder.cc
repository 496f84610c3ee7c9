// Labelled output (launcher/run/line_forwarder.h).
#include "launcher/run/line_forwarder.h"

#include <cerrno>

#include "launcher/run/io.h"

namespace tandem::launcher {

namespace {

constexpr size_t kReadChunk = 64 * 1024;

}  // namespace

void LineForwarder::read_some() {
  char buffer[kReadChunk];
  const ssize_t n = ::read(fd_, buffer, sizeof(buffer));
  if (n > 0) {
    pending_.append(buffer, static_cast<size_t>(n));
    emit_complete_lines();
    return;
  }
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  finish();
}

void LineForwarder::emit_complete_lines() {
  std::string out;
  size_t start = 0;
  size_t newline;
  while ((newline = pending_.find('\n', scanned_)) != std::string::npos) {
    out += prefix_;
    out.append(pending_, start, newline + 1 - start);
    start = newline + 1;
    scanned_ = start;
  }
  pending_.erase(0, start);
  scanned_ = pending_.size();
  if (!out.empty()) write_all(sink_, out);  // one write per batch: whole lines only
}

void LineForwarder::finish() {
  if (fd_ < 0) return;
  if (!pending_.empty()) write_all(sink_, prefix_ + pending_ + "\n");
  pending_.clear();
  scanned_ = 0;
  ::close(fd_);
  fd_ = -1;
}

}  // namespace tandem::launcher
