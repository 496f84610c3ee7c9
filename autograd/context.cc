#include "tandem/autograd/context.h"

#include <algorithm>

#include "tandem/rpc/errors.h"

namespace tandem::autograd {

Contexts::Contexts(int rank, std::string name, ForwardRelease forward)
    : rank_(rank), name_(std::move(name)), forward_(std::move(forward)) {}

uint64_t Contexts::new_context() {
  uint64_t id = make_id(rank_, next_context_);
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw rpc::ShutdownError("agent " + name_ + " is shut down");
  contexts_.emplace(id, std::make_shared<ContextState>(id));
  return id;
}

std::shared_ptr<ContextState> Contexts::find(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(id);
  return it == contexts_.end() ? nullptr : it->second;
}

std::shared_ptr<ContextState> Contexts::get(uint64_t id) const {
  auto ctx = find(id);
  if (!ctx) {
    throw std::invalid_argument("no distributed autograd context " + std::to_string(id) + " on " +
                                name_ + " (never used here, or released)");
  }
  return ctx;
}

std::shared_ptr<ContextState> Contexts::get_or_create(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(id);
  if (it != contexts_.end()) return it->second;
  if (closed_ || released_.contains(id)) return nullptr;
  return contexts_.emplace(id, std::make_shared<ContextState>(id)).first->second;
}

rpc::RawFuture Contexts::release(uint64_t id, int from) {
  std::shared_ptr<ContextState> ctx;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = contexts_.find(id);
    if (it != contexts_.end()) {
      ctx = std::move(it->second);
      contexts_.erase(it);
    }
    released_.insert(id);
  }
  if (!ctx) return rpc::when_all_raw({});
  std::vector<int> workers;
  std::unordered_map<uint64_t, std::shared_ptr<GraphTask>> tasks;
  {
    std::lock_guard<std::mutex> lock(ctx->mu);
    ctx->released = true;
    for (int w : ctx->known_workers) {
      if (w != from && w != rank_) workers.push_back(w);
    }
    tasks.swap(ctx->tasks);
  }
  for (auto& [_, task] : tasks) task->abort(name_, "its context was released");
  std::vector<rpc::RawFuture> forwarded;
  for (int w : workers) {
    try {
      forwarded.push_back(forward_(w, id));
    } catch (const std::exception&) {
      // Shut down or unreachable: nothing there can be freed from here.
    }
  }
  return rpc::when_all_raw(forwarded);
}

c10::Dict<at::Tensor, at::Tensor> Contexts::gradients(uint64_t id) const {
  auto ctx = get(id);
  std::lock_guard<std::mutex> lock(ctx->mu);
  return ctx->grads.copy();
}

size_t Contexts::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  return contexts_.size();
}

std::vector<std::string> Contexts::live_objects() const {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, _] : contexts_) {
    out.push_back("distributed autograd context " + std::to_string(id));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::shared_ptr<ContextState>> Contexts::all() const {
  std::vector<std::shared_ptr<ContextState>> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [_, c] : contexts_) out.push_back(c);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a->id < b->id; });
  return out;
}

bool Contexts::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

void Contexts::close() {
  std::unordered_map<uint64_t, std::shared_ptr<ContextState>> contexts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    contexts.swap(contexts_);
  }
  for (auto& [id, ctx] : contexts) {
    std::unordered_map<uint64_t, std::shared_ptr<GraphTask>> tasks;
    {
      std::lock_guard<std::mutex> lock(ctx->mu);
      tasks.swap(ctx->tasks);
    }
    for (auto& [_, task] : tasks) {
      // A backward() running here fails; a part run for another worker just
      // stops: its root learns it from the connection closing, as if this
      // worker had died.
      if (task->root == rank_) {
        task->fail(std::make_exception_ptr(
            rpc::ShutdownError("agent " + name_ + " shut down during distributed backward")));
      } else {
        task->close();
      }
    }
  }
}

}  // namespace tandem::autograd
