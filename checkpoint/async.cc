// AsyncSaver (checkpoint/checkpoint.h): one save at a time on a thread of its
// own; the next save(), or wait(), collects its outcome.
#include <chrono>
#include <cstdio>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "tandem/checkpoint/checkpoint.h"
#include "tandem/checkpoint/manifest.h"

namespace tandem::checkpoint {

struct AsyncSaver::Impl {
  std::string dir;
  SaveOptions options;
  std::thread writer;        // the save in flight, until joined
  int64_t step = -1;         // its step
  std::exception_ptr error;  // its outcome, once joined
  double last_wait_ms = 0;
  mutable std::mutex mu;  // (in_flight() from another thread)
  bool running = false;

  // Joins the save in flight and hands back its error (null: committed).
  std::exception_ptr join() {
    if (writer.joinable()) writer.join();
    std::exception_ptr e = error;
    error = nullptr;
    return e;
  }
};

AsyncSaver::AsyncSaver(std::string dir, SaveOptions options) : impl_(std::make_unique<Impl>()) {
  if (options.keep < 1) throw std::invalid_argument("checkpoint::AsyncSaver: keep must be >= 1");
  impl_->dir = std::move(dir);
  impl_->options = std::move(options);
}

AsyncSaver::~AsyncSaver() {
  const int64_t step = impl_->step;
  if (std::exception_ptr e = impl_->join()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      std::fprintf(stderr, "checkpoint: the background save of step %lld failed: %s\n",
                   static_cast<long long>(step), x.what());
    } catch (...) {
    }
  }
}

void AsyncSaver::save(int64_t step, Part part) { save(step, std::move(part), {}); }

void AsyncSaver::save(int64_t step, Part part, const std::vector<RemotePartWriter>& remote) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool waited = impl_->writer.joinable();
  wait();  // rethrows the save before's error
  impl_->last_wait_ms =
      waited
          ? std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count()
          : 0.0;
  impl_->step = step;
  // The group is idle now (the save before is done): the parts are numbered
  // here, and the remote ones copied by their workers, in the caller's step.
  detail::RemoteStart started = detail::start_remote(impl_->dir, step, remote, impl_->options);
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->running = true;
  }
  Impl* impl = impl_.get();
  struct Unmark {  // a thread that could not start leaves nothing in flight
    Impl* impl;
    bool started = false;
    ~Unmark() {
      if (started) return;
      std::lock_guard<std::mutex> lock(impl->mu);
      impl->running = false;
    }
  } unmark{impl};
  impl_->writer =
      std::thread([impl, step, part = std::move(part), started = std::move(started)]() mutable {
        try {
          detail::finish_save(impl->dir, step, part, std::move(started), impl->options);
        } catch (...) {
          impl->error = std::current_exception();
        }
        std::lock_guard<std::mutex> lock(impl->mu);
        impl->running = false;
      });
  unmark.started = true;
}

void AsyncSaver::wait() {
  if (std::exception_ptr e = impl_->join()) std::rethrow_exception(e);
}

bool AsyncSaver::in_flight() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->running;
}

double AsyncSaver::last_wait_ms() const { return impl_->last_wait_ms; }

}  // namespace tandem::checkpoint
