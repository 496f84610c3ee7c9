#include "launcher/trace_join.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace tandem::launcher {
namespace {

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The worker files of a directory, by rank.
std::vector<std::string> rank_files(const std::string& dir) {
  std::vector<std::pair<long, std::string>> found;
  const std::string prefix = "tandem-trace-rank", suffix = ".json";
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
        continue;
      }
      const std::string digits =
          name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
      if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
      found.emplace_back(std::strtol(digits.c_str(), nullptr, 10), dir + "/" + name);
    }
    ::closedir(d);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [_, path] : found) out.push_back(std::move(path));
  return out;
}

// The event lines of one file; false (and `why`) when it is not a trace.
bool read_events(const std::string& path, std::string& events, size_t& count, std::string& why) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) {
    why = "cannot be read";
    return false;
  }
  std::string line, mine;
  size_t n = 0;
  bool header = true, closed = false;
  int c = 0;
  while (c != EOF) {
    line.clear();
    while ((c = std::fgetc(f)) != EOF && c != '\n') line.push_back(static_cast<char>(c));
    if (header) {
      if (line.rfind("{\"traceEvents\":[", 0) != 0) {
        if (line.empty() && c == EOF) break;
        std::fclose(f);
        why = "not a Tandem trace (its first line is not {\"traceEvents\":[)";
        return false;
      }
      header = false;
    } else if (!line.empty() && line[0] == ']') {
      closed = true;
      break;
    } else if (!line.empty()) {
      if (line.back() == ',') line.pop_back();
      mine += (mine.empty() ? "" : ",\n") + line;
      ++n;
    }
  }
  std::fclose(f);
  if (header || !closed) {
    why = header ? "empty" : "cut short (no closing line: was its worker killed?)";
    return false;
  }
  if (!mine.empty()) events += (events.empty() ? "" : ",\n") + mine;
  count += n;
  return true;
}

}  // namespace

TraceJoin join_traces(const std::vector<std::string>& inputs, const std::string& out) {
  TraceJoin result;
  std::string events;
  for (const auto& input : inputs) {
    std::vector<std::string> files =
        is_dir(input) ? rank_files(input) : std::vector<std::string>{input};
    if (files.empty()) result.skipped.push_back(input + ": no tandem-trace-rank*.json in it");
    for (const auto& path : files) {
      std::string why;
      if (read_events(path, events, result.events, why)) {
        ++result.files;
      } else {
        result.skipped.push_back(path + ": " + why);
      }
    }
  }
  if (result.files == 0) throw std::runtime_error("no trace to join in what was given");
  FILE* f = std::fopen(out.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + out);
  std::fprintf(f,
               "{\"traceEvents\":[\n%s\n],\"displayTimeUnit\":\"ms\",\"otherData\":"
               "{\"files\":%d}}\n",
               events.c_str(), result.files);
  if (std::fclose(f) != 0) throw std::runtime_error("writing " + out + " failed");
  return result;
}

}  // namespace tandem::launcher
