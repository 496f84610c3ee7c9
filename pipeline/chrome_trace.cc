// The Chrome trace writer: a step's pass times (Pipe::last_step()) as
// trace-event JSON, which chrome://tracing and Perfetto open.
#include <cstdio>
#include <fstream>
#include <set>
#include <stdexcept>
#include <utility>

#include "tandem/pipeline/pipe.h"

namespace tandem::pipeline {

void write_trace(const StepStats& stats, const std::vector<std::string>& worker_names,
                 const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("write_trace: cannot write '" + path + "'");
  out << "{\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!first) out << ",\n";
    first = false;
  };
  std::set<std::pair<int, int>> tracks;
  for (const auto& p : stats.passes) tracks.insert({p.worker, p.action.stage});
  for (size_t w = 0; w < worker_names.size(); ++w) {
    sep();
    // Worker names are rank names ("worker1"), but quote them safely all the same.
    std::string name;
    for (char c : worker_names[w]) {
      if (c == '"' || c == '\\') name += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) name += c;
    }
    out << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << w << ",\"args\":{\"name\":\""
        << name << "\"}}";
  }
  for (const auto& [w, stage] : tracks) {
    sep();
    out << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << w << ",\"tid\":" << stage
        << ",\"args\":{\"name\":\"stage " << stage << "\"}}";
  }
  char buf[64];
  for (const auto& p : stats.passes) {
    sep();
    const std::string name = to_string(p.action);  // "F3@1"
    std::snprintf(buf, sizeof buf, "%.3f", p.start_us);
    out << "{\"ph\":\"X\",\"name\":\"" << name.substr(0, name.find('@')) << "\",\"cat\":\""
        << kind_name(p.action.kind) << "\",\"pid\":" << p.worker << ",\"tid\":" << p.action.stage
        << ",\"ts\":" << buf;
    std::snprintf(buf, sizeof buf, "%.3f", p.end_us - p.start_us);
    out << ",\"dur\":" << buf << ",\"args\":{\"micro_batch\":" << p.action.chunk << "}}";
  }
  out << "\n]}\n";
  out.close();
  if (!out) throw std::runtime_error("write_trace: writing '" + path + "' failed");
}

}  // namespace tandem::pipeline
