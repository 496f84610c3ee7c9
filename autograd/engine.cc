// The distributed backward engine: autograd/engine.h has the algorithm. Its
// steps are in autograd/engine/: the graph walks (walk.h), the root's
// backward() (root.cc), a worker's part and the messages between engines
// (part.cc), and execution (execute.cc). Here: the tasks' records and
// describe().
#include "tandem/autograd/engine.h"

#include <algorithm>
#include <map>

#include "tandem/rpc/agent/spin.h"

namespace tandem::autograd {

void EngineLink::wait_for(const std::function<bool()>& news,
                          const std::function<void(std::function<void()>)>& set_waker,
                          std::chrono::steady_clock::time_point until) {
  (void)set_waker;
  (void)until;
  rpc::spin_until(spin(), news);
}

Engine::Engine(std::shared_ptr<Contexts> contexts, std::shared_ptr<EngineLink> link)
    : contexts_(std::move(contexts)),
      link_(std::move(link)),
      rank_(contexts_->rank()),
      name_(contexts_->name()) {}

std::shared_ptr<GraphTask> Engine::find_task(uint64_t context, uint64_t task) {
  auto ctx = contexts_->find(context);
  if (!ctx) return nullptr;
  std::lock_guard<std::mutex> lock(ctx->mu);
  auto it = ctx->tasks.find(task);
  return it == ctx->tasks.end() ? nullptr : it->second;
}

std::shared_ptr<GraphTask> Engine::task_of(ContextState& ctx, uint64_t task) {
  auto& t = ctx.tasks[task];
  if (!t) t = std::make_shared<GraphTask>(ctx.id, task, id_worker(task), /*attached=*/false);
  return t;
}

std::vector<std::shared_ptr<SendBackward>> Engine::sends_of(
    ContextState& ctx, const std::vector<uint64_t>& messages) const {
  if (ctx.released) {
    throw std::invalid_argument("context " + std::to_string(ctx.id) + " was released on " + name_);
  }
  std::vector<std::shared_ptr<SendBackward>> out;
  for (uint64_t m : messages) {
    auto it = ctx.sends.find(m);
    if (it == ctx.sends.end()) {
      throw std::invalid_argument("autograd message " + std::to_string(m) + " is not recorded on " +
                                  name_ + " in context " + std::to_string(ctx.id));
    }
    out.push_back(it->second);
  }
  return out;
}

std::string Engine::describe(const std::function<std::string(int)>& worker_name) const {
  std::string out;
  const auto now = std::chrono::steady_clock::now();
  for (const auto& ctx : contexts_->all()) {
    std::vector<std::shared_ptr<GraphTask>> tasks;
    {
      std::lock_guard<std::mutex> lock(ctx->mu);
      for (const auto& [_, t] : ctx->tasks) tasks.push_back(t);
    }
    for (const auto& t : tasks) {
      std::lock_guard<std::mutex> lock(t->mu);
      if (t->phase != GraphTask::Phase::kWaitingForRun && t->phase != GraphTask::Phase::kRunning) {
        continue;
      }
      const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(now - t->made).count();
      out += "backward of context " + std::to_string(t->context) + " (task " +
             std::to_string(t->id) + ", root " + worker_name(t->root) + "), " +
             std::to_string(age) + " ms old: ";
      if (t->phase == GraphTask::Phase::kWaitingForRun) {
        out += "waiting for its run request from " + worker_name(t->root) + " (" +
               std::to_string(t->early.size()) + " gradient(s) held)\n";
        continue;
      }
      // Sends still counting their gradient wait for the worker holding
      // their receive; everything else waits behind them, or is ready.
      std::map<int, std::vector<uint64_t>> waiting;
      for (const auto& [node, state] : t->nodes) {
        if (auto* send = dynamic_cast<SendBackward*>(node); send && state.deps > 0) {
          waiting[send->dest()].push_back(send->message());
        }
      }
      out += std::to_string(t->nodes.size()) + " node(s) to run, " +
             std::to_string(t->ready.size()) + " ready" + (t->draining ? ", running" : "");
      for (auto& [worker, messages] : waiting) {
        std::sort(messages.begin(), messages.end());
        out += "; waiting for gradients from " + worker_name(worker) + " (message(s)";
        for (size_t i = 0; i < messages.size() && i < 8; ++i)
          out += " " + std::to_string(messages[i]);
        if (messages.size() > 8) out += " ...";
        out += ")";
      }
      std::string parts;
      for (const auto& [worker, f] : t->parts) {
        if (f && !f->completed()) parts += (parts.empty() ? "" : ", ") + worker_name(worker);
      }
      if (!parts.empty()) out += "; parts not done on " + parts;
      out += "\n";
    }
  }
  return out;
}

}  // namespace tandem::autograd
