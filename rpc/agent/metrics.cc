#include "tandem/rpc/metrics.h"

#include <cmath>
#include <cstdio>

#include "tandem/rpc/errors.h"

namespace tandem::rpc {

void LatencyHistogram::record(std::chrono::nanoseconds took) {
  const double us = std::max(1.0, took.count() / 1e3);
  int b = static_cast<int>(std::floor(std::log2(us) * 4));
  b = std::min(std::max(b, 0), kBuckets - 1);
  buckets_[b].fetch_add(1, std::memory_order_relaxed);
}

uint64_t LatencyHistogram::count() const {
  uint64_t n = 0;
  for (const auto& b : buckets_) n += b.load(std::memory_order_relaxed);
  return n;
}

double LatencyHistogram::percentile_us(double q) const {
  const uint64_t n = count();
  if (n == 0) return 0;
  const auto rank = static_cast<uint64_t>(std::ceil(q * n));
  uint64_t seen = 0;
  for (int b = 0; b < kBuckets; ++b) {
    seen += buckets_[b].load(std::memory_order_relaxed);
    if (seen >= std::max<uint64_t>(rank, 1)) return std::exp2((b + 1) / 4.0);
  }
  return std::exp2(kBuckets / 4.0);
}

MetricsRecorder::Fn& MetricsRecorder::entry(const std::string& callee) {
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    auto it = fns_.find(callee);
    if (it != fns_.end()) return *it->second;
  }
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto& slot = fns_[callee];
  if (!slot) slot = std::make_unique<Fn>();
  return *slot;
}

void MetricsRecorder::call_done(const std::string& callee, std::chrono::nanoseconds took,
                                const std::exception_ptr& error) {
  Fn& fn = entry(callee);
  fn.calls.fetch_add(1, std::memory_order_relaxed);
  fn.latency.record(took);
  if (!error) return;
  fn.failed.fetch_add(1, std::memory_order_relaxed);
  failed_.fetch_add(1, std::memory_order_relaxed);
  std::string kind = "other";
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    kind = error_code_name(e.code());
  } catch (...) {
  }
  std::unique_lock<std::shared_mutex> lock(mu_);
  ++failures_[kind];
}

void MetricsRecorder::fill(Metrics& m) const {
  m.calls_sent = sent_.load();
  m.calls_failed = failed_.load();
  m.requests_served = served_.load();
  m.requests_failed = served_failed_.load();
  std::shared_lock<std::shared_mutex> lock(mu_);
  m.failures = failures_;
  for (const auto& [name, fn] : fns_) {
    FunctionStats s;
    s.calls = fn->calls.load();
    s.failed = fn->failed.load();
    s.p50_us = fn->latency.percentile_us(0.5);
    s.p99_us = fn->latency.percentile_us(0.99);
    m.functions[name] = s;
  }
}

std::string Metrics::to_string() const {
  std::string out;
  char line[512];
  auto add = [&](const char* fmt, auto... args) {
    std::snprintf(line, sizeof(line), fmt, args...);
    out += line;
  };
  add("calls sent %llu (failed %llu), in flight %llu\n", (unsigned long long)calls_sent,
      (unsigned long long)calls_failed, (unsigned long long)calls_in_flight);
  for (const auto& [kind, n] : failures)
    add("  failed: %s %llu\n", kind.c_str(), (unsigned long long)n);
  add("requests served %llu (failed %llu), pool queue %zu\n", (unsigned long long)requests_served,
      (unsigned long long)requests_failed, pool_queue);
  add("bytes sent %llu, received %llu, through shared memory %llu; connections %llu; "
      "messages read by waiting threads %llu\n",
      (unsigned long long)bytes_sent, (unsigned long long)bytes_received,
      (unsigned long long)transport.shared_bytes, (unsigned long long)connections,
      (unsigned long long)transport.polled_messages);
  add("rrefs owned %zu, users %zu\n", rrefs_owned, rref_users);
  for (const auto& [name, f] : functions) {
    add("  %s: %llu calls, %llu failed, p50 %.0f us, p99 %.0f us\n", name.c_str(),
        (unsigned long long)f.calls, (unsigned long long)f.failed, f.p50_us, f.p99_us);
  }
  for (const auto& [name, v] : layers) add("%s %lld\n", name.c_str(), (long long)v);
  return out;
}

}  // namespace tandem::rpc
