// The MANIFEST's encoder and checked decoder (checkpoint/manifest.h).
#include "tandem/checkpoint/manifest.h"

#include <cinttypes>
#include <cstdio>
#include <set>
#include <sstream>
#include <stdexcept>

namespace tandem::checkpoint::detail {
namespace {

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, v);
  return buf;
}

std::vector<std::string> fields_of(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  for (std::string f; in >> f;) out.push_back(f);
  return out;
}

}  // namespace

uint64_t fnv1a(const char* data, size_t size, uint64_t h) {
  for (size_t i = 0; i < size; ++i) {
    h ^= static_cast<unsigned char>(data[i]);
    h *= 1099511628211ull;
  }
  return h;
}

std::string part_lines(const PartIndex& part, const std::vector<EntryIndex>& entries) {
  std::string out = "part " + std::to_string(part.rank) + " " + part.file + " " +
                    std::to_string(part.bytes) + " " + hex(part.fnv) + "\n";
  for (const auto& e : entries) {
    if (e.is_tensor) {
      out += "tensor " + std::to_string(e.rank) + " " + e.name + " " + std::to_string(e.dtype) +
             " " + std::to_string(e.shape.size());
      for (int64_t d : e.shape) out += " " + std::to_string(d);
    } else {
      out += "blob " + std::to_string(e.rank) + " " + e.name;
    }
    out += " " + std::to_string(e.offset) + " " + std::to_string(e.bytes) + "\n";
  }
  return out;
}

std::string encode(const Manifest& head, const std::vector<std::string>& rank_lines) {
  std::string out = "tandem-checkpoint 1\nstep " + std::to_string(head.step) + "\nworld " +
                    std::to_string(head.world) + "\n";
  for (const auto& [k, v] : head.meta) out += "meta " + k + " " + v + "\n";
  for (const auto& l : rank_lines) out += l;
  out += "fnv " + hex(fnv1a(out.data(), out.size())) + "\n";
  return out;
}

Manifest decode(const std::string& text, const std::string& source) {
  // The checksum first: an altered manifest is refused whole.
  const size_t last = text.rfind("fnv ");
  if (last == std::string::npos || (last > 0 && text[last - 1] != '\n')) {
    throw std::invalid_argument(source + ": no checksum line (not a manifest, or cut short)");
  }
  const std::string sum = text.substr(last + 4, 16);
  if (sum != hex(fnv1a(text.data(), last)) || text.size() != last + 4 + 16 + 1) {
    throw std::invalid_argument(source + ": its checksum does not match (altered or cut short)");
  }
  Manifest m;
  std::istringstream in(text.substr(0, last));
  std::string line;
  size_t number = 0;
  auto bad = [&](const std::string& why) {
    throw std::invalid_argument(source + ": line " + std::to_string(number) + " ('" + line +
                                "'): " + why);
  };
  auto integer = [&](const std::string& f, const char* what) -> int64_t {
    try {
      size_t used = 0;
      const long long v = std::stoll(f, &used);
      if (used != f.size()) bad(std::string(what) + " is not a number");
      return v;
    } catch (const std::logic_error&) {
      bad(std::string(what) + " is not a number");
    }
    return 0;
  };
  auto count = [&](const std::string& f, const char* what) -> uint64_t {
    const int64_t v = integer(f, what);
    if (v < 0) bad(std::string(what) + " is negative");
    return static_cast<uint64_t>(v);
  };
  std::set<std::string> names;
  std::set<int> part_ranks;
  bool saw_step = false, saw_world = false;
  while (std::getline(in, line)) {
    ++number;
    const auto f = fields_of(line);
    if (number == 1) {
      if (line != "tandem-checkpoint 1") bad("not a Tandem checkpoint manifest of version 1");
      continue;
    }
    if (f.empty()) bad("empty");
    if (f[0] == "step" && f.size() == 2) {
      m.step = integer(f[1], "the step");
      saw_step = true;
    } else if (f[0] == "world" && f.size() == 2) {
      m.world = static_cast<int>(integer(f[1], "the world size"));
      if (m.world < 1) bad("the world size is below 1");
      saw_world = true;
    } else if (f[0] == "meta" && f.size() >= 2) {
      const size_t at = line.find(' ', 5);
      m.meta[f[1]] = at == std::string::npos ? "" : line.substr(at + 1);
    } else if (f[0] == "part" && f.size() == 5) {
      PartIndex p;
      p.rank = static_cast<int>(integer(f[1], "the rank"));
      if (p.rank < 0 || (saw_world && p.rank >= m.world)) bad("the rank is outside the world");
      if (!part_ranks.insert(p.rank).second) bad("a second part of this rank");
      p.file = f[2];
      if (p.file.find('/') != std::string::npos) bad("a part's file names a directory");
      p.bytes = count(f[3], "the part's size");
      if (f[4].size() != 16) bad("the part's checksum is not 16 hex digits");
      try {
        p.fnv = std::stoull(f[4], nullptr, 16);
      } catch (const std::logic_error&) {
        bad("the part's checksum is not hex");
      }
      m.parts.push_back(p);
    } else if ((f[0] == "tensor" && f.size() >= 7) || (f[0] == "blob" && f.size() == 5)) {
      EntryIndex e;
      e.is_tensor = f[0] == "tensor";
      e.rank = static_cast<int>(integer(f[1], "the rank"));
      if (!part_ranks.count(e.rank)) bad("an entry of a rank with no part line before it");
      e.name = f[2];
      if (!names.insert(e.name).second) bad("'" + e.name + "' a second time");
      size_t k = 3;
      if (e.is_tensor) {
        e.dtype = integer(f[k++], "the dtype");
        if (e.dtype < 0 || e.dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions)) {
          bad("unknown dtype " + std::to_string(e.dtype));
        }
        const uint64_t ndim = count(f[k++], "the number of dimensions");
        if (f.size() != 7 + ndim) bad("the shape has not " + std::to_string(ndim) + " sizes");
        for (uint64_t d = 0; d < ndim; ++d) {
          e.shape.push_back(static_cast<int64_t>(count(f[k++], "a size")));
        }
      }
      e.offset = count(f[k++], "the offset");
      e.bytes = count(f[k++], "the size");
      for (const auto& p : m.parts) {
        if (p.rank == e.rank &&
            (e.offset < kPartHeader || e.offset > p.bytes || e.bytes > p.bytes - e.offset)) {
          bad("runs outside its part");
        }
      }
      m.entries.push_back(e);
    } else {
      bad("not a manifest line");
    }
  }
  if (!saw_step || !saw_world) {
    throw std::invalid_argument(source + ": no step or world line");
  }
  return m;
}

}  // namespace tandem::checkpoint::detail
