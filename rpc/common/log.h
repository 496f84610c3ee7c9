// What Tandem writes to stderr about its peers, made safe to read.
//
// Everything a peer chose (worker names, function names, error messages,
// bytes of a bad frame) may hold newlines, terminal escape sequences or
// bytes that are not UTF-8: printed raw, a hostile peer could forge log
// lines or repaint the operator's terminal. printable() escapes such
// characters and cuts long strings; every log line that quotes a peer goes
// through it. ProtocolLog bounds how many lines bad peers can make.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace tandem::rpc {

// `s` with control characters (newline, ESC, DEL, ...) and bytes outside
// printable ASCII written as \n, \r, \t or \xNN, cut after `max_chars`
// input characters with "...(N more bytes)" appended. A backslash stays as
// it is, so that escaping twice changes nothing (a reason escaped where it
// was made is escaped again where it is logged).
std::string printable(const std::string& s, size_t max_chars = 512);

// Writes lines about protocol errors to stderr, at most `burst` in each
// `window`; the lines held back are counted and reported by the next line
// written after the window rolls over. Thread-safe.
class ProtocolLog {
 public:
  explicit ProtocolLog(int burst = 10, std::chrono::milliseconds window = std::chrono::seconds(10))
      : burst_(burst), window_(window) {}
  // `line` is written as it is (escape what a peer chose first); returns
  // whether it was written.
  bool write(const std::string& line);
  uint64_t suppressed_total() const;

 private:
  const int burst_;
  const std::chrono::milliseconds window_;
  mutable std::mutex mu_;
  std::chrono::steady_clock::time_point window_start_{};
  int written_in_window_ = 0;
  uint64_t held_back_ = 0;  // since the last line written
  uint64_t suppressed_total_ = 0;
};

}  // namespace tandem::rpc
