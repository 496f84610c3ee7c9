#include "tandem/rpc/common/log.h"

#include <cstdio>

namespace tandem::rpc {

std::string printable(const std::string& s, size_t max_chars) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  const size_t n = std::min(s.size(), max_chars);
  out.reserve(n + 16);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c >= 0x20 && c < 0x7f) {
          out += static_cast<char>(c);
        } else {
          out += "\\x";
          out += digits[c >> 4];
          out += digits[c & 15];
        }
    }
  }
  if (s.size() > n) out += "...(" + std::to_string(s.size() - n) + " more bytes)";
  return out;
}

bool ProtocolLog::write(const std::string& line) {
  std::string note;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (now - window_start_ >= window_) {
      window_start_ = now;
      written_in_window_ = 0;
    }
    if (written_in_window_ >= burst_) {
      ++held_back_;
      ++suppressed_total_;
      return false;
    }
    ++written_in_window_;
    if (held_back_ > 0) {
      note = " (" + std::to_string(held_back_) + " similar line(s) held back before this one)";
      held_back_ = 0;
    }
  }
  std::fprintf(stderr, "%s%s\n", line.c_str(), note.c_str());
  return true;
}

uint64_t ProtocolLog::suppressed_total() const {
  std::lock_guard<std::mutex> lock(mu_);
  return suppressed_total_;
}

}  // namespace tandem::rpc
