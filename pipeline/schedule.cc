#include "tandem/pipeline/schedule.h"

#include <algorithm>
#include <stdexcept>

namespace tandem::pipeline {

namespace {

void check_counts(const std::string& schedule, int workers, int chunks) {
  if (workers < 1) {
    throw std::invalid_argument(schedule + ": the pipeline needs at least 1 worker, got " +
                                std::to_string(workers));
  }
  if (chunks < 1) {
    throw std::invalid_argument(schedule + ": chunks (micro-batches) must be at least 1, got " +
                                std::to_string(chunks));
  }
}

Plan empty_plan(int workers, int stages_per_worker, int chunks) {
  Plan p;
  p.workers = workers;
  p.stages = workers * stages_per_worker;
  p.chunks = chunks;
  p.actions.resize(static_cast<size_t>(workers));
  return p;
}

constexpr int kKinds = 4;

Action forward(int stage, int chunk) { return {Action::kForward, stage, chunk}; }
Action backward(int stage, int chunk) { return {Action::kBackward, stage, chunk}; }
Action input_grad(int stage, int chunk) { return {Action::kInputGrad, stage, chunk}; }
Action weight_grad(int stage, int chunk) { return {Action::kWeightGrad, stage, chunk}; }

// Index of a pass in per-(kind, stage, chunk) tables.
size_t index_of(const Plan& p, const Action& a) {
  return (static_cast<size_t>(a.kind) * p.stages + a.stage) * p.chunks + a.chunk;
}

// The passes `a` waits for (besides the earlier actions of its own worker).
// `split(s, m)`: whether stage s's backward of micro-batch m is split (then
// its I, not its B, gives stage s - 1 its gradient).
template <class Split>
std::vector<Action> dependencies(const Plan& p, const Action& a, const Split& split) {
  switch (a.kind) {
    case Action::kForward:
      if (a.stage == 0) return {};
      return {forward(a.stage - 1, a.chunk)};
    case Action::kWeightGrad:
      return {input_grad(a.stage, a.chunk)};
    default:
      if (a.stage == p.stages - 1) return {forward(a.stage, a.chunk)};
      return {forward(a.stage, a.chunk), split(a.stage + 1, a.chunk)
                                             ? input_grad(a.stage + 1, a.chunk)
                                             : backward(a.stage + 1, a.chunk)};
  }
}

// Runs the plan in order with the given costs (a split backward: b - w for
// its I, w for its W); finish time per pass. Throws when some worker would
// wait forever.
std::vector<double> run(const Plan& p, double f, double b, double w_cost,
                        std::vector<double>* busy) {
  const size_t passes = kKinds * static_cast<size_t>(p.stages) * p.chunks;
  std::vector<bool> split(static_cast<size_t>(p.stages) * p.chunks, false);
  for (const auto& list : p.actions) {
    for (const Action& a : list) {
      if (a.kind == Action::kInputGrad)
        split[static_cast<size_t>(a.stage) * p.chunks + a.chunk] = true;
    }
  }
  auto is_split = [&](int stage, int chunk) {
    return static_cast<bool>(split[static_cast<size_t>(stage) * p.chunks + chunk]);
  };
  std::vector<double> finish(passes, -1);
  std::vector<size_t> next(p.actions.size(), 0);
  std::vector<double> free_at(p.actions.size(), 0);
  if (busy) busy->assign(p.actions.size(), 0);
  size_t done = 0, total = 0;
  for (const auto& list : p.actions) total += list.size();
  while (done < total) {
    bool progress = false;
    for (size_t w = 0; w < p.actions.size(); ++w) {
      while (next[w] < p.actions[w].size()) {
        const Action& a = p.actions[w][next[w]];
        double start = free_at[w];
        bool ready = true;
        for (const Action& d : dependencies(p, a, is_split)) {
          const double t = finish[index_of(p, d)];
          if (t < 0) {
            ready = false;
            break;
          }
          start = std::max(start, t);
        }
        if (!ready) break;
        const double cost = a.kind == Action::kForward     ? f
                            : a.kind == Action::kBackward  ? b
                            : a.kind == Action::kInputGrad ? b - w_cost
                                                           : w_cost;
        finish[index_of(p, a)] = free_at[w] = start + cost;
        if (busy) (*busy)[w] += cost;
        ++next[w];
        ++done;
        progress = true;
      }
    }
    if (!progress) {
      std::string stuck;
      for (size_t w = 0; w < p.actions.size(); ++w) {
        if (next[w] < p.actions[w].size()) {
          stuck += (stuck.empty() ? "" : ", ") + std::string("worker ") + std::to_string(w) +
                   " at " + to_string(p.actions[w][next[w]]) + " (action " +
                   std::to_string(next[w]) + " of its list)";
        }
      }
      throw std::invalid_argument(
          "the plan cannot finish: each worker waits for a pass that "
          "comes after its own in some list; stuck: " +
          stuck);
    }
  }
  return finish;
}

}  // namespace

std::string to_string(const Action& a) {
  static const char* const kLetters[] = {"F", "B", "I", "W"};
  const char* letter = a.kind < kKinds ? kLetters[a.kind] : "?";
  return letter + std::to_string(a.chunk) + "@" + std::to_string(a.stage);
}

const char* kind_name(Action::Kind kind) {
  static const char* const kNames[] = {"forward", "backward", "input gradient", "weight gradient"};
  return kind < kKinds ? kNames[kind] : "unknown pass";
}

Plan GPipe::plan(int workers, int chunks) const {
  check_counts(name(), workers, chunks);
  Plan p = empty_plan(workers, 1, chunks);
  for (int w = 0; w < workers; ++w) {
    for (int m = 0; m < chunks; ++m) p.actions[w].push_back(forward(w, m));
    for (int m = 0; m < chunks; ++m) p.actions[w].push_back(backward(w, m));
  }
  return p;
}

Plan OneFOneB::plan(int workers, int chunks) const {
  check_counts(name(), workers, chunks);
  Plan p = empty_plan(workers, 1, chunks);
  for (int w = 0; w < workers; ++w) {
    auto& list = p.actions[w];
    const int warmup = std::min(workers - w - 1, chunks);
    for (int m = 0; m < warmup; ++m) list.push_back(forward(w, m));
    for (int i = 0; i < chunks - warmup; ++i) {
      list.push_back(forward(w, warmup + i));
      list.push_back(backward(w, i));
    }
    for (int m = chunks - warmup; m < chunks; ++m) list.push_back(backward(w, m));
  }
  return p;
}

Interleaved1F1B::Interleaved1F1B(int stages_per_worker) : v_(stages_per_worker) {
  if (v_ < 1) {
    throw std::invalid_argument("interleaved 1F1B: stages per worker must be at least 1, got " +
                                std::to_string(v_));
  }
}

std::string Interleaved1F1B::name() const { return "interleaved:" + std::to_string(v_); }

Plan Interleaved1F1B::plan(int workers, int chunks) const {
  check_counts(name(), workers, chunks);
  if (chunks % workers != 0) {
    throw std::invalid_argument(name() + ": chunks (" + std::to_string(chunks) +
                                ") must be a multiple of the workers (" + std::to_string(workers) +
                                ")");
  }
  Plan p = empty_plan(workers, v_, chunks);
  const int total = chunks * v_;  // passes of each kind on each worker
  const int group = workers * v_;
  // The k-th forward (or backward) of worker w: micro-batches go round in
  // groups of `workers`, through the worker's stages in turn (backwards in
  // reverse stage order).
  auto pass = [&](int w, int k, bool fwd) {
    int local = (k % group) / workers;
    if (!fwd) local = v_ - 1 - local;
    const int m = (k / group) * workers + k % workers;
    const int stage = local * workers + w;
    return fwd ? forward(stage, m) : backward(stage, m);
  };
  for (int w = 0; w < workers; ++w) {
    auto& list = p.actions[w];
    int warmup =
        chunks == workers ? total : std::min((workers - w - 1) * 2 + (v_ - 1) * workers, total);
    for (int k = 0; k < warmup; ++k) list.push_back(pass(w, k, true));
    for (int i = 0; i < total - warmup; ++i) {
      list.push_back(pass(w, warmup + i, true));
      list.push_back(pass(w, i, false));
    }
    for (int k = total - warmup; k < total; ++k) list.push_back(pass(w, k, false));
  }
  return p;
}

Plan ZeroBubble::plan(int workers, int chunks) const {
  check_counts(name(), workers, chunks);
  Plan p = empty_plan(workers, 1, chunks);
  // Unit costs, so every worker is free again at each tick t. Per worker:
  // the next F, I and W to run; done_f/done_i: finish times per (stage,
  // chunk). A worker's own earlier passes are done by now.
  const int k = workers, m = chunks;
  std::vector<std::vector<double>> done_f(k, std::vector<double>(m, -1)), done_i = done_f;
  std::vector<int> next_f(k, 0), next_i(k, 0), next_w(k, 0);
  int left = 3 * k * m;
  for (double t = 0; left > 0; t += 1) {
    // Each pass finishes within the time of all passes in sequence.
    if (t > 3.0 * k * m + k) throw std::logic_error("zero-bubble: the plan does not finish");
    for (int w = 0; w < k; ++w) {
      auto ready = [&](double at) { return at >= 0 && at <= t; };
      auto& list = p.actions[w];
      const int i = next_i[w], f = next_f[w], wg = next_w[w];
      if (i < f && (w == k - 1 || ready(done_i[w + 1][i]))) {
        list.push_back(input_grad(w, i));
        done_i[w][i] = t + 1;
        ++next_i[w];
      } else if (f < m && f - wg < k - w && (w == 0 || ready(done_f[w - 1][f]))) {
        list.push_back(forward(w, f));
        done_f[w][f] = t + 1;
        ++next_f[w];
      } else if (wg < i) {
        list.push_back(weight_grad(w, wg));
        ++next_w[w];
      } else {
        continue;
      }
      --left;
    }
  }
  return p;
}

std::unique_ptr<Schedule> make_schedule(const std::string& name) {
  if (name == "gpipe") return std::make_unique<GPipe>();
  if (name == "1f1b") return std::make_unique<OneFOneB>();
  if (name == "zero-bubble") return std::make_unique<ZeroBubble>();
  if (name == "interleaved") return std::make_unique<Interleaved1F1B>(2);
  const std::string prefix = "interleaved:";
  if (name.rfind(prefix, 0) == 0) {
    const std::string n = name.substr(prefix.size());
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(n, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == n.size() && !n.empty()) return std::make_unique<Interleaved1F1B>(v);
  }
  throw std::invalid_argument("unknown pipeline schedule '" + name +
                              "' (gpipe, 1f1b, zero-bubble, interleaved or interleaved:N)");
}

namespace {

// check() but for whether the order can finish (run() finds that out).
void check_passes(const Plan& p) {
  if (p.workers < 1 || p.chunks < 1 || p.stages < p.workers || p.stages % p.workers != 0 ||
      static_cast<int>(p.actions.size()) != p.workers) {
    throw std::invalid_argument(
        "a plan needs workers >= 1, chunks >= 1, stages a multiple of "
        "workers and one action list per worker");
  }
  std::vector<int> seen(kKinds * static_cast<size_t>(p.stages) * p.chunks, 0);
  for (int w = 0; w < p.workers; ++w) {
    for (const Action& a : p.actions[w]) {
      if (a.kind >= kKinds || a.stage < 0 || a.stage >= p.stages || a.chunk < 0 ||
          a.chunk >= p.chunks) {
        throw std::invalid_argument("worker " + std::to_string(w) + " lists " + to_string(a) +
                                    ", outside " + std::to_string(p.stages) + " stages and " +
                                    std::to_string(p.chunks) + " chunks");
      }
      if (p.worker_of(a.stage) != w) {
        throw std::invalid_argument("worker " + std::to_string(w) + " lists " + to_string(a) +
                                    ", whose stage lives on worker " +
                                    std::to_string(p.worker_of(a.stage)));
      }
      if (++seen[index_of(p, a)] > 1) {
        throw std::invalid_argument(to_string(a) + " is listed twice");
      }
    }
  }
  for (int s = 0; s < p.stages; ++s) {
    for (int m = 0; m < p.chunks; ++m) {
      auto has = [&](const Action& a) { return seen[index_of(p, a)] > 0; };
      if (!has(forward(s, m))) {
        throw std::invalid_argument("no worker runs " + to_string(forward(s, m)));
      }
      const bool whole = has(backward(s, m)), in = has(input_grad(s, m)),
                 wt = has(weight_grad(s, m));
      if (whole && (in || wt)) {
        throw std::invalid_argument(
            "the backward of micro-batch " + std::to_string(m) + " through stage " +
            std::to_string(s) + " is listed both whole (" + to_string(backward(s, m)) +
            ") and split (" + to_string(in ? input_grad(s, m) : weight_grad(s, m)) + ")");
      }
      if (!whole && !in && !wt) {
        throw std::invalid_argument("no worker runs " + to_string(backward(s, m)));
      }
      if (!whole && in != wt) {  // half of a split backward
        const Action listed = in ? input_grad(s, m) : weight_grad(s, m);
        const Action missing = in ? weight_grad(s, m) : input_grad(s, m);
        throw std::invalid_argument("no worker runs " + to_string(missing) + " (" +
                                    to_string(listed) + " is listed)");
      }
    }
  }
}

}  // namespace

void check(const Plan& p) {
  check_passes(p);
  run(p, 1, 2, 1, nullptr);
}

Simulation simulate(const Plan& p, double forward_cost, double backward_cost, double weight_cost) {
  if (weight_cost < 0 && backward_cost >= 0) weight_cost = backward_cost / 2;
  if (!(forward_cost >= 0) || !(weight_cost >= 0) || !(backward_cost >= weight_cost)) {
    throw std::invalid_argument("simulate: costs must be >= 0, and a backward's at least its W's");
  }
  check_passes(p);
  Simulation s;
  std::vector<double> finish = run(p, forward_cost, backward_cost, weight_cost, &s.busy);
  s.makespan = *std::max_element(finish.begin(), finish.end());
  for (int w = 0; w < p.workers; ++w) {
    s.bubble.push_back(s.makespan > 0 ? 1 - s.busy[w] / s.makespan : 0);
    int held = 0, peak = 0;
    for (const Action& a : p.actions[w]) {
      if (a.kind == Action::kForward) ++held;
      if (a.kind == Action::kBackward || a.kind == Action::kWeightGrad) --held;
      peak = std::max(peak, held);
    }
    s.peak_stash.push_back(peak);
  }
  return s;
}

}  // namespace tandem::pipeline
