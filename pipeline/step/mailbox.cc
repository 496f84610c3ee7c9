#include "tandem/pipeline/step/mailbox.h"

#include "tandem/pipeline/step/errors.h"

namespace tandem::pipeline::step {

void Mailbox::put(Slot slot, int64_t stage, int64_t chunk, at::Tensor t) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    items_[{slot, stage, chunk}] = std::move(t);
  }
  cv_.notify_all();
}

void Mailbox::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = why;
  }
  cv_.notify_all();
}

std::optional<at::Tensor> Mailbox::take(Slot slot, int64_t stage, int64_t chunk,
                                        std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto key = std::make_tuple(static_cast<int64_t>(slot), stage, chunk);
  const bool came =
      cv_.wait_for(lock, timeout, [&] { return items_.count(key) || !aborted_.empty(); });
  if (!aborted_.empty()) throw StepAborted(aborted_);
  if (!came) return std::nullopt;
  at::Tensor t = std::move(items_[key]);
  items_.erase(key);
  return t;
}

bool Mailbox::wait_until(const std::function<bool()>& ready, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool came = cv_.wait_for(lock, timeout, [&] { return !aborted_.empty() || ready(); });
  if (!aborted_.empty()) throw StepAborted(aborted_);
  return came;
}

void Mailbox::wake() {
  // Under the lock, so that a waiter between its check and its sleep
  // cannot miss it.
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

}  // namespace tandem::pipeline::step
