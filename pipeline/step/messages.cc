#include "tandem/pipeline/step/messages.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <tuple>

#include "tandem/rpc/convert.h"

namespace tandem::pipeline::step {

namespace {

constexpr int64_t kMaxCount = std::numeric_limits<int>::max();  // Action holds ints

[[noreturn]] void refuse(const std::string& message, const std::string& field,
                         const std::string& problem) {
  throw std::invalid_argument(message + ": " + field + " " + problem);
}

void check_range(const std::string& message, const std::string& field, int64_t value, int64_t lo,
                 int64_t hi) {
  if (value >= lo && value <= hi) return;
  refuse(message, field,
         "is " + std::to_string(value) +
             (hi == std::numeric_limits<int64_t>::max()
                  ? ", not at least " + std::to_string(lo)
                  : ", not in " + std::to_string(lo) + " .. " + std::to_string(hi)));
}

void check_count(const std::string& message, const std::string& field, size_t got, size_t want,
                 const std::string& why) {
  if (got != want) {
    refuse(message, field,
           "has " + std::to_string(got) + ", not " + std::to_string(want) + " (" + why + ")");
  }
}

void check_args(const std::string& message, const std::vector<c10::IValue>& args, size_t want,
                const char* names) {
  if (args.size() != want) {
    throw std::invalid_argument(message + ": " + std::to_string(args.size()) + " arguments, not " +
                                std::to_string(want) + " (" + names + ")");
  }
}

// A timeout a peer sent: positive, at most kMaxPassTimeout.
std::chrono::milliseconds timeout_of(const std::string& message, const std::string& field,
                                     int64_t ms) {
  check_range(message, field, ms, 1, std::numeric_limits<int64_t>::max());
  return std::min(std::chrono::milliseconds(ms), kMaxPassTimeout);
}

std::string dims_of(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + std::to_string(t.size(d));
  return out + "] " + std::string(c10::toString(t.scalar_type())) + " on " + t.device().str();
}

// `t` is a CPU tensor of `type` with `cols` columns (0: one dimension).
void check_table(const std::string& message, const std::string& field, const at::Tensor& t,
                 int64_t cols, at::ScalarType type, const char* want) {
  const bool shape = t.defined() && (cols == 0 ? t.dim() == 1 : t.dim() == 2 && t.size(1) == cols);
  if (!shape || t.scalar_type() != type || !t.device().is_cpu()) {
    refuse(message, field, std::string("must be ") + want + ", got " + dims_of(t));
  }
}

std::string row(const std::string& field, size_t i, const char* column) {
  return field + "[" + std::to_string(i) + "]." + column;
}

}  // namespace

// ---- StepHeader ----

std::vector<int64_t> StepHeader::encode() const {
  return {step, chunks, stages, workers, me, static_cast<int64_t>(timeout.count()), train ? 1 : 0};
}

StepHeader StepHeader::decode(const std::vector<int64_t>& slots) {
  const std::string m = kRunFn;
  check_count(m, "header", slots.size(), 7, "step, chunks, stages, workers, me, timeout_ms, train");
  StepHeader h;
  h.step = slots[0];
  check_range(m, "header.step", h.step, 1, std::numeric_limits<int64_t>::max());
  h.chunks = slots[1];
  check_range(m, "header.chunks", h.chunks, 1, kMaxCount);
  h.stages = slots[2];
  check_range(m, "header.stages", h.stages, 1, kMaxCount);
  h.workers = slots[3];
  check_range(m, "header.workers", h.workers, 1, h.stages);
  if (h.stages % h.workers != 0) {
    refuse(m, "header.stages",
           "is " + std::to_string(h.stages) + ", not a multiple of header.workers (" +
               std::to_string(h.workers) + ")");
  }
  h.me = slots[4];
  check_range(m, "header.me", h.me, 0, h.workers - 1);
  h.timeout = timeout_of(m, "header.timeout_ms", slots[5]);
  check_range(m, "header.train", slots[6], 0, 1);
  h.train = slots[6] == 1;
  return h;
}

// ---- PassList ----

at::Tensor PassList::encode() const {
  at::Tensor t = at::empty({static_cast<int64_t>(passes.size()), 3}, at::kLong);
  auto acc = t.accessor<int64_t, 2>();
  for (size_t i = 0; i < passes.size(); ++i) {
    acc[i][0] = static_cast<int64_t>(passes[i].kind);
    acc[i][1] = passes[i].stage;
    acc[i][2] = passes[i].chunk;
  }
  return t;
}

PassList PassList::decode(const at::Tensor& t, const std::vector<int64_t>& held, int64_t chunks) {
  const std::string m = kRunFn;
  if (!t.defined() || t.dim() != 2 || t.size(1) != 3 || t.scalar_type() != at::kLong ||
      !t.device().is_cpu()) {
    throw std::invalid_argument(m + ": the passes must be an [n, 3] int64 tensor on the CPU, got " +
                                dims_of(t));
  }
  auto acc = t.accessor<int64_t, 2>();
  PassList out;
  out.passes.reserve(static_cast<size_t>(t.size(0)));
  for (int64_t i = 0; i < t.size(0); ++i) {
    const size_t n = static_cast<size_t>(i);
    check_range(m, row("passes", n, "kind"), acc[i][0], 0, Action::kWeightGrad);
    if (std::find(held.begin(), held.end(), acc[i][1]) == held.end()) {
      std::string mine;
      for (int64_t s : held) mine += (mine.empty() ? "" : ", ") + std::to_string(s);
      refuse(m, row("passes", n, "stage"),
             "is " + std::to_string(acc[i][1]) + ", not a stage this worker holds (" + mine + ")");
    }
    check_range(m, row("passes", n, "micro_batch"), acc[i][2], 0, chunks - 1);
    // In range now: held stages come from a checked header, below INT_MAX.
    out.passes.push_back({static_cast<Action::Kind>(acc[i][0]), static_cast<int>(acc[i][1]),
                          static_cast<int>(acc[i][2])});
  }
  return out;
}

// ---- PassTimes ----

at::Tensor PassTimes::encode() const {
  at::Tensor t = at::empty({static_cast<int64_t>(times.size()), 5}, at::kDouble);
  auto acc = t.accessor<double, 2>();
  for (size_t i = 0; i < times.size(); ++i) {
    acc[i][0] = static_cast<double>(times[i].pass.kind);
    acc[i][1] = static_cast<double>(times[i].pass.stage);
    acc[i][2] = static_cast<double>(times[i].pass.chunk);
    acc[i][3] = times[i].start_us;
    acc[i][4] = times[i].end_us;
  }
  return t;
}

PassTimes PassTimes::decode(const at::Tensor& t, const std::vector<Action>& sent,
                            const std::string& from) {
  check_table(from, "times", t, 5, at::kDouble, "an [n, 5] double tensor on the CPU");
  check_count(from, "times", static_cast<size_t>(t.size(0)), sent.size(), "one per pass sent");
  auto acc = t.accessor<double, 2>();
  PassTimes out;
  for (size_t i = 0; i < sent.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i);
    const Action& want = sent[i];
    if (acc[r][0] != static_cast<double>(want.kind) ||
        acc[r][1] != static_cast<double>(want.stage) ||
        acc[r][2] != static_cast<double>(want.chunk)) {
      refuse(from, "times[" + std::to_string(i) + "]",
             "is of (kind " + std::to_string(acc[r][0]) + ", stage " + std::to_string(acc[r][1]) +
                 ", micro-batch " + std::to_string(acc[r][2]) + "), not of the pass sent, " +
                 to_string(want));
    }
    const double start = acc[r][3], end = acc[r][4];
    if (!std::isfinite(start) || start < 0) {
      refuse(from, row("times", i, "start_us"), "is " + std::to_string(start) + ", not a time");
    }
    if (!std::isfinite(end) || end < start) {
      refuse(from, row("times", i, "end_us"),
             "is " + std::to_string(end) + ", not a time from start_us (" + std::to_string(start) +
                 ") on");
    }
    out.times.push_back({want, start, end});
  }
  return out;
}

// ---- RunRequest ----

std::vector<c10::IValue> RunRequest::encode() const {
  return rpc::to_ivalues(
      header.encode(), stage_ids, modules, passes.encode(), worker_names, loss, inputs, targets,
      weights, data_parallel.group,
      std::vector<int64_t>{data_parallel.sync ? 1 : 0, data_parallel.bucket_cap_bytes});
}

RunRequest RunRequest::decode(const std::vector<c10::IValue>& args) {
  const std::string m = kRunFn;
  check_args(m, args, 11,
             "header, stages, modules, passes, worker names, loss, inputs, targets, weights, "
             "data-parallel group, data-parallel flags");
  RunRequest r;
  r.header = StepHeader::decode(rpc::from_ivalue<std::vector<int64_t>>(args[0], m + ": header"));
  const StepHeader& h = r.header;
  r.stage_ids = rpc::from_ivalue<std::vector<int64_t>>(args[1], m + ": stages");
  const size_t per = static_cast<size_t>(h.stages / h.workers);
  check_count(m, "stages", r.stage_ids.size(), per, "stages per worker");
  for (size_t i = 0; i < per; ++i) {
    const int64_t want = h.me + static_cast<int64_t>(i) * h.workers;
    if (r.stage_ids[i] != want) {
      refuse(m, "stages[" + std::to_string(i) + "]",
             "is " + std::to_string(r.stage_ids[i]) + ", not " + std::to_string(want) +
                 " (worker " + std::to_string(h.me) + " holds stages " + std::to_string(h.me) +
                 ", " + std::to_string(h.me) + " + " + std::to_string(h.workers) + ", ...)");
    }
  }
  r.modules = rpc::from_ivalue<std::vector<rpc::RRef<c10::IValue>>>(args[2], m + ": modules");
  check_count(m, "modules", r.modules.size(), per, "one per stage");
  r.passes = PassList::decode(rpc::from_ivalue<at::Tensor>(args[3], m + ": passes"), r.stage_ids,
                              h.chunks);
  r.worker_names = rpc::from_ivalue<std::vector<std::string>>(args[4], m + ": worker_names");
  check_count(m, "worker_names", r.worker_names.size(), static_cast<size_t>(h.workers),
              "one per worker");
  for (size_t w = 0; w < r.worker_names.size(); ++w) {
    if (r.worker_names[w].empty()) refuse(m, "worker_names[" + std::to_string(w) + "]", "is empty");
  }
  r.loss = rpc::from_ivalue<std::string>(args[5], m + ": loss");
  const size_t chunks = static_cast<size_t>(h.chunks);
  r.inputs = rpc::from_ivalue<std::vector<at::Tensor>>(args[6], m + ": inputs");
  check_count(m, "inputs", r.inputs.size(), h.me == 0 ? chunks : 0,
              h.me == 0 ? "one per micro-batch for stage 0" : "only stage 0's worker gets them");
  r.targets = rpc::from_ivalue<std::vector<at::Tensor>>(args[7], m + ": targets");
  const bool targets = h.train && h.holds_last();
  check_count(m, "targets", r.targets.size(), targets ? chunks : 0,
              targets ? "one per micro-batch for the last stage"
                      : "only the last stage's worker gets them, when training");
  r.weights = rpc::from_ivalue<std::vector<double>>(args[8], m + ": weights");
  check_count(m, "weights", r.weights.size(), chunks, "one per micro-batch");
  for (size_t c = 0; c < chunks; ++c) {
    const double w = r.weights[c];
    if (!(w >= 0 && w <= 1)) {  // NaN too
      refuse(m, "weights[" + std::to_string(c) + "]",
             "is " + std::to_string(w) + ", not a share of the batch (0 .. 1)");
    }
  }
  r.data_parallel.group = rpc::from_ivalue<std::string>(args[9], m + ": data-parallel group");
  const auto flags = rpc::from_ivalue<std::vector<int64_t>>(args[10], m + ": data-parallel flags");
  check_count(m, "data-parallel flags", flags.size(), 2, "sync, bucket_cap_bytes");
  check_range(m, "data-parallel sync", flags[0], 0, 1);
  r.data_parallel.sync = flags[0] == 1;
  check_range(m, "data-parallel bucket_cap_bytes", flags[1], 1,
              std::numeric_limits<int64_t>::max());
  r.data_parallel.bucket_cap_bytes = flags[1];
  return r;
}

// ---- AllReduceTimes ----

at::Tensor AllReduceTimes::encode() const {
  at::Tensor t = at::empty({static_cast<int64_t>(times.size()), 3}, at::kDouble);
  auto acc = t.accessor<double, 2>();
  for (size_t i = 0; i < times.size(); ++i) {
    acc[i][0] = static_cast<double>(times[i].stage);
    acc[i][1] = times[i].launch_us;
    acc[i][2] = times[i].done_us;
  }
  return t;
}

AllReduceTimes AllReduceTimes::decode(const at::Tensor& t, const std::vector<int64_t>& held,
                                      const std::string& from) {
  check_table(from, "allreduces", t, 3, at::kDouble, "an [n, 3] double tensor on the CPU");
  AllReduceTimes out;
  auto acc = t.accessor<double, 2>();
  std::vector<int64_t> seen;
  for (int64_t r = 0; r < t.size(0); ++r) {
    const size_t i = static_cast<size_t>(r);
    const double stage = acc[r][0];
    const auto s = static_cast<int64_t>(stage);
    if (!std::isfinite(stage) || static_cast<double>(s) != stage ||
        std::find(held.begin(), held.end(), s) == held.end()) {
      refuse(from, row("allreduces", i, "stage"),
             "is " + std::to_string(stage) + ", not a stage of this worker");
    }
    if (std::find(seen.begin(), seen.end(), s) != seen.end()) {
      refuse(from, row("allreduces", i, "stage"),
             "is " + std::to_string(s) + ", averaged twice in one step");
    }
    seen.push_back(s);
    const double launch = acc[r][1], done = acc[r][2];
    if (!std::isfinite(launch) || launch < 0) {
      refuse(from, row("allreduces", i, "launch_us"),
             "is " + std::to_string(launch) + ", not a time");
    }
    if (!std::isfinite(done) || done < launch) {
      refuse(from, row("allreduces", i, "done_us"),
             "is " + std::to_string(done) + ", not a time from launch_us (" +
                 std::to_string(launch) + ") on");
    }
    out.times.push_back({s, launch, done});
  }
  return out;
}

// ---- RunReply ----

c10::IValue RunReply::encode() const {
  return rpc::to_ivalue(
      std::make_tuple(losses, times.encode(), peak_stash, outputs, allreduces.encode()));
}

RunReply RunReply::decode(const c10::IValue& v, const RunRequest& request) {
  const StepHeader& h = request.header;
  const std::string m =
      std::string(kRunFn) + "'s answer from " + request.worker_names.at(static_cast<size_t>(h.me));
  if (!v.isTuple()) refuse(m, "the answer", "is a " + v.tagKind() + ", not a tuple");
  // (a vector: GCC sees the tuple's inline storage of three and warns past it)
  const std::vector<c10::IValue> items = v.toTupleRef().elements().vec();
  if (items.size() != 5) {
    throw std::invalid_argument(m + ": " + std::to_string(items.size()) +
                                " fields, not 5 (losses, times, peak_stash, outputs, allreduces)");
  }
  RunReply r;
  r.losses = rpc::from_ivalue<at::Tensor>(items[0], m + ": losses");
  check_table(m, "losses", r.losses, 0, at::kDouble, "a [chunks] double tensor on the CPU");
  check_count(m, "losses", static_cast<size_t>(r.losses.size(0)), static_cast<size_t>(h.chunks),
              "one per micro-batch");
  r.times = PassTimes::decode(rpc::from_ivalue<at::Tensor>(items[1], m + ": times"),
                              request.passes.passes, m);
  r.peak_stash = rpc::from_ivalue<int64_t>(items[2], m + ": peak_stash");
  check_range(m, "peak_stash", r.peak_stash, 0, static_cast<int64_t>(request.passes.passes.size()));
  r.outputs = rpc::from_ivalue<std::vector<at::Tensor>>(items[3], m + ": outputs");
  const bool owes = !h.train && h.holds_last();
  check_count(
      m, "outputs", r.outputs.size(), owes ? static_cast<size_t>(h.chunks) : 0,
      owes ? "one per micro-batch" : "only the last stage's worker gives them, forwards only");
  for (size_t c = 0; c < r.outputs.size(); ++c) {
    if (!r.outputs[c].defined()) refuse(m, "outputs[" + std::to_string(c) + "]", "is undefined");
  }
  r.allreduces = AllReduceTimes::decode(rpc::from_ivalue<at::Tensor>(items[4], m + ": allreduces"),
                                        request.stage_ids, m);
  if (!r.allreduces.times.empty() && !(h.train && request.data_parallel.averages())) {
    refuse(m, "allreduces", "has rows, but the step asked for no averaging");
  }
  return r;
}

// ---- Handoff ----

std::vector<c10::IValue> Handoff::encode() const {
  return rpc::to_ivalues(step, static_cast<int64_t>(timeout.count()), static_cast<int64_t>(slot),
                         stage, chunk, tensor);
}

Handoff Handoff::decode(const std::vector<c10::IValue>& args) {
  const std::string m = kPutFn;
  check_args(m, args, 6, "step, timeout_ms, slot, stage, micro-batch, tensor");
  Handoff h;
  h.step = rpc::from_ivalue<int64_t>(args[0], m + ": step");
  check_range(m, "step", h.step, 1, std::numeric_limits<int64_t>::max());
  h.timeout = timeout_of(m, "timeout_ms", rpc::from_ivalue<int64_t>(args[1], m + ": timeout_ms"));
  const int64_t slot = rpc::from_ivalue<int64_t>(args[2], m + ": slot");
  check_range(m, "slot", slot, kActivation, kGradient);
  h.slot = static_cast<Slot>(slot);
  h.stage = rpc::from_ivalue<int64_t>(args[3], m + ": stage");
  check_range(m, "stage", h.stage, 0, kMaxCount);
  h.chunk = rpc::from_ivalue<int64_t>(args[4], m + ": micro_batch");
  check_range(m, "micro_batch", h.chunk, 0, kMaxCount);
  h.tensor = rpc::from_ivalue<at::Tensor>(args[5], m + ": tensor");
  if (!h.tensor.defined()) refuse(m, "tensor", "is undefined");
  return h;
}

// ---- AbortNote ----

std::vector<c10::IValue> AbortNote::encode() const {
  return rpc::to_ivalues(step, static_cast<int64_t>(timeout.count()), why);
}

AbortNote AbortNote::decode(const std::vector<c10::IValue>& args) {
  const std::string m = kAbortFn;
  check_args(m, args, 3, "step, timeout_ms, why");
  AbortNote a;
  a.step = rpc::from_ivalue<int64_t>(args[0], m + ": step");
  check_range(m, "step", a.step, 1, std::numeric_limits<int64_t>::max());
  a.timeout = timeout_of(m, "timeout_ms", rpc::from_ivalue<int64_t>(args[1], m + ": timeout_ms"));
  a.why = rpc::from_ivalue<std::string>(args[2], m + ": why");
  if (a.why.empty()) refuse(m, "why", "is empty");
  return a;
}

}  // namespace tandem::pipeline::step
