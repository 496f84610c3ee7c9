#include "tandem/rpc/trace.h"

#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
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

std::mutex g_open_mu;
std::map<std::pair<std::string, int>, std::weak_ptr<Tracer>>& open_tracers() {
  static auto* m = new std::map<std::pair<std::string, int>, std::weak_ptr<Tracer>>();
  return *m;
}

}  // namespace

std::shared_ptr<Tracer> Tracer::open(const std::string& dir, int rank, const std::string& worker) {
  std::lock_guard<std::mutex> lock(g_open_mu);
  auto& slot = open_tracers()[{dir, rank}];
  if (auto t = slot.lock()) {
    // An agent's name wins over a layer's placeholder.
    if (worker != "rank " + std::to_string(rank)) t->set_worker(worker);
    return t;
  }
  auto t = std::make_shared<Tracer>(dir, rank, worker);
  slot = t;
  return t;
}

std::shared_ptr<Tracer> Tracer::from_env(int rank) {
  const char* dir = std::getenv("TANDEM_TRACE");
  if (!dir || !*dir) return nullptr;
  return open(dir, rank, "rank " + std::to_string(rank));
}

Tracer::Tracer(std::string dir, int rank, std::string worker)
    : dir_(std::move(dir)), rank_(rank), worker_(std::move(worker)) {
  events_.reserve(4096);
}

Tracer::~Tracer() {
  bool dirty;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dirty = dirty_;
  }
  if (!dirty) return;
  try {
    write();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem: %s\n", e.what());
  }
}

void Tracer::set_worker(const std::string& worker) {
  std::lock_guard<std::mutex> lock(mu_);
  worker_ = worker;
}

void Tracer::add_locked(std::string event) {
  events_.push_back(std::move(event));
  dirty_ = true;
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
                   Clock::time_point end, const Flows& flows, const std::string& args_json,
                   long tid_in) {
  const long tid = tid_in ? tid_in : thread_id();
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() + 5 > kMaxEvents) {
    ++dropped_;
    return;
  }
  const int64_t ts = micros(start) + offset_us_;
  const int64_t dur = std::max<int64_t>(0, micros(end) - micros(start));
  const std::string common = "\"pid\":" + std::to_string(rank_) + ",\"tid\":" + std::to_string(tid);
  add_locked("{\"ph\":\"X\",\"name\":" + json_string(name) + ",\"cat\":\"" + cat + "\"," + common +
             ",\"ts\":" + std::to_string(ts) + ",\"dur\":" + std::to_string(dur) +
             (args_json.empty() ? "" : ",\"args\":" + args_json) + "}");
  // A flow event binds to the slice enclosing it on its thread: the start's
  // at the slice's first microsecond, the answer's at its last.
  const int64_t last = ts + std::max<int64_t>(0, dur - 1);
  auto flow = [&](const char* ph, const char* what, uint64_t id, int64_t at) {
    add_locked(std::string("{\"ph\":\"") + ph + "\"," + (ph[0] == 'f' ? "\"bp\":\"e\"," : "") +
               "\"name\":\"" + what + "\",\"cat\":\"rpc\",\"id\":" + std::to_string(id) + "," +
               common + ",\"ts\":" + std::to_string(at) + "}");
  };
  if (flows.call_out) flow("s", "call", flows.call_out, ts);
  if (flows.call_in) flow("f", "call", flows.call_in, ts);
  if (flows.reply_out) flow("s", "reply", flows.reply_out, last);
  if (flows.reply_in) flow("f", "reply", flows.reply_in, last);
}

void Tracer::span(const std::string& name, const char* cat, uint64_t id, Clock::time_point start,
                  Clock::time_point end, const std::string& args_json) {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() + 2 > kMaxEvents) {
    ++dropped_;
    return;
  }
  const int64_t ts = micros(start) + offset_us_;
  const int64_t te = std::max(ts, micros(end) + offset_us_);
  const std::string common =
      ",\"name\":" + json_string(name) + ",\"cat\":\"" + cat + "\",\"id\":\"0x" +
      [&] {
        char buf[24];
        std::snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(id));
        return std::string(buf);
      }() +
      "\",\"pid\":" + std::to_string(rank_) + ",\"tid\":0";
  add_locked("{\"ph\":\"b\"" + common + ",\"ts\":" + std::to_string(ts) +
             (args_json.empty() ? "" : ",\"args\":" + args_json) + "}");
  add_locked("{\"ph\":\"e\"" + common + ",\"ts\":" + std::to_string(te) + "}");
}

std::string Tracer::write() {
  std::lock_guard<std::mutex> lock(mu_);
  dirty_ = false;
  ::mkdir(dir_.c_str(), 0777);  // may exist
  const std::string path = dir_ + "/tandem-trace-rank" + std::to_string(rank_) + ".json";
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write the trace file " + path);
  // One event per line between the header and the footer: tandem-run joins
  // the workers' files by their lines.
  std::fprintf(f, "{\"traceEvents\":[\n");
  std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":%s}}",
               rank_, json_string(worker_).c_str());
  std::fprintf(f,
               ",\n{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%d,\"args\":"
               "{\"sort_index\":%d}}",
               rank_, rank_);
  for (const auto& e : events_) std::fprintf(f, ",\n%s", e.c_str());
  std::fprintf(f,
               "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"worker\":%s,\"rank\":%d,"
               "\"clock_offset_us\":%lld,\"clock_error_us\":%lld,\"dropped_events\":%llu}}\n",
               json_string(worker_).c_str(), rank_, static_cast<long long>(offset_us_),
               static_cast<long long>(error_us_), static_cast<unsigned long long>(dropped_));
  std::fclose(f);
  return path;
}

void TraceScope::finish() noexcept {
  try {
    tracer_->slice(name_, cat_, start_, Tracer::Clock::now(), {}, args_);
  } catch (...) {
    // out of memory: the event is lost, the traced work is not
  }
}

}  // namespace tandem::rpc
