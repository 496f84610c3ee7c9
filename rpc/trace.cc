#include "tandem/rpc/trace.h"

#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <stdexcept>

namespace tandem::rpc {
namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

long thread_id() { return static_cast<long>(::syscall(SYS_gettid)); }

}  // namespace

Tracer::Tracer(std::string dir, int rank, std::string worker)
    : dir_(std::move(dir)), rank_(rank), worker_(std::move(worker)) {
  events_.reserve(4096);
}

long Tracer::this_thread() { return thread_id(); }

int64_t Tracer::micros(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

void Tracer::set_clock(int64_t offset_us, int64_t error_us) {
  std::lock_guard<std::mutex> lock(mu_);
  offset_us_ = offset_us;
  error_us_ = error_us;
}

void Tracer::slice(const std::string& name, const char* cat, Clock::time_point start,
                   Clock::time_point end, uint64_t flow_out, uint64_t flow_in,
                   const std::string& args_json, long tid_in) {
  const long tid = tid_in ? tid_in : thread_id();
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() + 3 > kMaxEvents) {
    ++dropped_;
    return;
  }
  const int64_t ts = micros(start) + offset_us_;
  const int64_t dur = std::max<int64_t>(0, micros(end) - micros(start));
  const std::string common = "\"pid\":" + std::to_string(rank_) + ",\"tid\":" + std::to_string(tid);
  events_.push_back("{\"ph\":\"X\",\"name\":" + json_string(name) + ",\"cat\":\"" + cat +
                    "\"," + common + ",\"ts\":" + std::to_string(ts) +
                    ",\"dur\":" + std::to_string(dur) +
                    (args_json.empty() ? "" : ",\"args\":" + args_json) + "}");
  if (flow_out) {
    events_.push_back("{\"ph\":\"s\",\"name\":\"call\",\"cat\":\"rpc\",\"id\":" +
                      std::to_string(flow_out) + "," + common + ",\"ts\":" + std::to_string(ts) +
                      "}");
  }
  if (flow_in) {
    events_.push_back("{\"ph\":\"f\",\"bp\":\"e\",\"name\":\"call\",\"cat\":\"rpc\",\"id\":" +
                      std::to_string(flow_in) + "," + common + ",\"ts\":" + std::to_string(ts) +
                      "}");
  }
}

std::string Tracer::write() {
  std::lock_guard<std::mutex> lock(mu_);
  ::mkdir(dir_.c_str(), 0777);  // may exist
  const std::string path = dir_ + "/tandem-trace-rank" + std::to_string(rank_) + ".json";
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write the trace file " + path);
  // One event per line between the header and the footer: tandem-run joins
  // the workers' files by their lines.
  std::fprintf(f, "{\"traceEvents\":[\n");
  std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":%s}}",
               rank_, json_string(worker_).c_str());
  std::fprintf(f, ",\n{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%d,\"args\":"
                  "{\"sort_index\":%d}}", rank_, rank_);
  for (const auto& e : events_) std::fprintf(f, ",\n%s", e.c_str());
  std::fprintf(f, "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"worker\":%s,\"rank\":%d,"
                  "\"clock_offset_us\":%lld,\"clock_error_us\":%lld,\"dropped_events\":%llu}}\n",
               json_string(worker_).c_str(), rank_, static_cast<long long>(offset_us_),
               static_cast<long long>(error_us_), static_cast<unsigned long long>(dropped_));
  std::fclose(f);
  return path;
}

}  // namespace tandem::rpc
