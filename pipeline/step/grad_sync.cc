#include "tandem/pipeline/step/grad_sync.h"

#include <ATen/ops/empty.h>

#include <stdexcept>

#include "tandem/autograd/autograd.h"
#include "tandem/rpc/agent.h"
#include "tandem/rpc/trace.h"

namespace tandem::pipeline::step {

// One all_reduce: some parameters of one stage, flat, then one count per
// parameter of the replicas that gave it a gradient (divided by the group's
// size like the rest: above zero is what counts).
struct GradSync::Bucket {
  int64_t stage = 0;
  std::vector<size_t> params;  // indices into StepState::params[stage]
  std::vector<int64_t> offsets;
  int64_t numel = 0;
  at::Tensor flat;
  ddp::ProcessGroup::Pending pending;
  double launch_us = 0;
  std::atomic<double> done_us{-1};
};

namespace {
double us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

GradSync::GradSync(rpc::Agent& agent, const RunRequest& r, uint64_t context,
                   std::shared_ptr<Mailbox> box, std::chrono::steady_clock::time_point t0)
    : agent_(agent), request_(r), context_(context), box_(std::move(box)), t0_(t0) {
  if (!r.header.train || !r.data_parallel.averages()) return;
  group_ = ddp::find_group(agent, r.data_parallel.group);
  if (!group_) {
    throw std::invalid_argument("worker " + agent.name() + " has no process group '" +
                                r.data_parallel.group +
                                "' for the data-parallel average of its stages (make the Mesh "
                                "on every worker, with this agent, before stepping)");
  }
  if (group_->size() == 1) {  // one replica: its sums are the average
    group_ = nullptr;
    return;
  }
  const auto& passes = r.passes.passes;
  for (size_t i = 0; i < passes.size(); ++i) {
    if (passes[i].kind == Action::kBackward || passes[i].kind == Action::kWeightGrad) {
      last_grad_pass_[passes[i].stage] = i;
    }
  }
}

// A step that failed before its averages ended leaves them behind: the
// group is marked broken (its collectives are out of step now).
GradSync::~GradSync() {
  for (auto& b : buckets_) {
    if (b->pending.valid()) b->pending.abandon();
  }
}

double GradSync::now_us() const { return us_since(t0_); }

void GradSync::after_pass(StepState& state, size_t i) {
  if (!active()) return;
  const int64_t stage = request_.passes.passes[i].stage;
  auto it = last_grad_pass_.find(stage);
  if (it != last_grad_pass_.end() && it->second == i) launch(state, stage);
}

void GradSync::launch(StepState& st, int64_t stage) {
  const auto& params = st.params[stage];
  auto& sums = st.sums[stage];
  sums.resize(params.size());
  // What earlier steps of this context left (under no_sync): part of the average.
  if (!earlier_) earlier_ = autograd::get_gradients(agent_, context_);
  const autograd::Gradients& earlier = *earlier_;
  const double share = 1.0 / group_->size();

  std::vector<std::shared_ptr<Bucket>> mine;
  auto close = [&](std::shared_ptr<Bucket>& b) {
    if (b && !b->params.empty()) mine.push_back(std::move(b));
    b = nullptr;
  };
  std::shared_ptr<Bucket> open;
  int64_t open_bytes = 0;
  for (size_t k = params.size(); k-- > 0;) {
    const at::Tensor& p = params[k];
    if (open) {
      const at::Tensor& first = params[open->params.front()];
      if (first.scalar_type() != p.scalar_type() || first.device() != p.device()) close(open);
    }
    if (!open) {
      open = std::make_shared<Bucket>();
      open->stage = stage;
      open_bytes = 0;
    }
    open->params.push_back(k);
    open->offsets.push_back(open->numel);
    open->numel += p.numel();
    open_bytes += static_cast<int64_t>(p.numel() * p.element_size());
    if (open_bytes >= request_.data_parallel.bucket_cap_bytes) close(open);
  }
  close(open);

  for (auto& b : mine) {
    const at::Tensor& first = params[b->params.front()];
    const auto n = static_cast<int64_t>(b->params.size());
    b->flat = at::empty({b->numel + n}, first.options().requires_grad(false));
    for (size_t j = 0; j < b->params.size(); ++j) {
      const size_t k = b->params[j];
      const at::Tensor& p = params[k];
      at::Tensor slot = b->flat.narrow(0, b->offsets[j], p.numel()).view(p.sizes());
      at::Tensor before = earlier.contains(p) ? earlier.at(p) : at::Tensor();
      const bool has = sums[k].defined() || before.defined();
      if (sums[k].defined()) {
        slot.copy_(sums[k]);
        if (before.defined()) slot.add_(before);
      } else if (before.defined()) {
        slot.copy_(before);
      } else {
        slot.zero_();
      }
      b->flat[b->numel + static_cast<int64_t>(j)].fill_(has ? 1.0 : 0.0);
    }
    b->flat.mul_(share);
    b->launch_us = now_us();
    b->pending = group_->all_reduce_async(b->flat);
    // (The callback may run after finish() is over: it holds what it uses.)
    std::weak_ptr<Bucket> weak = b;
    std::weak_ptr<Mailbox> box = box_;
    b->pending.on_completion([weak, box, t0 = t0_] {
      if (auto bucket = weak.lock()) bucket->done_us.store(us_since(t0));
      if (auto mailbox = box.lock()) mailbox->wake();
    });
    buckets_.push_back(b);
  }
  sums.clear();  // handed over by finish(), as averages
}

void GradSync::finish(StepState& st) {
  if (!active()) return;
  std::map<int64_t, std::pair<double, double>> span;  // per stage: first launch, last done
  for (auto& b : buckets_) {
    // Until it ends or the step is aborted (the wake comes from its
    // completion; the poll is for a backend that cannot call back).
    while (!box_->wait_until([&] { return b->pending.done(); }, std::chrono::milliseconds(100))) {
    }
    b->pending.wait();
    double done = b->done_us.load();
    if (done < b->launch_us) done = now_us();  // the backend could not say (yet) when
    auto [it, fresh] = span.try_emplace(b->stage, b->launch_us, done);
    if (!fresh) {
      it->second.first = std::min(it->second.first, b->launch_us);
      it->second.second = std::max(it->second.second, done);
    }
    const auto& params = st.params[b->stage];
    const auto n = static_cast<int64_t>(b->params.size());
    const at::Tensor counts = b->flat.narrow(0, b->numel, n).to(at::kCPU, at::kDouble);
    const double* used = counts.data_ptr<double>();
    for (size_t j = 0; j < b->params.size(); ++j) {
      if (!(used[j] > 0)) continue;  // no replica had a gradient
      const at::Tensor& p = params[b->params[j]];
      at::Tensor avg = b->flat.narrow(0, b->offsets[j], p.numel()).view(p.sizes());
      if (earlier_->contains(p)) {
        earlier_->at(p).copy_(avg);
      } else {
        autograd::accumulate_gradient(agent_, context_, p, avg);
      }
    }
  }
  rpc::Tracer* const tracer = agent_.tracer().get();
  for (const auto& [stage, t] : span) {
    times_.times.push_back({stage, t.first, t.second});
    if (tracer) {
      // rpc/trace.h: "allreduce@1" (stage 1's average), beside the passes.
      auto at = [&](double us) {
        return t0_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double, std::micro>(us));
      };
      tracer->slice("allreduce@" + std::to_string(stage), "pipeline", at(t.first), at(t.second), {},
                    "{\"step\":" + std::to_string(request_.header.step) +
                        ",\"stage\":" + std::to_string(stage) + "}");
    }
  }
  buckets_.clear();
}

}  // namespace tandem::pipeline::step
