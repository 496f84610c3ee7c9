// Dropout's randomness under tensor parallelism (parallel/random.h).
#include "tandem/parallel/random.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>

#include <stdexcept>

namespace tandem::parallel {

void RngTracker::seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  seed_ = seed;
  generators_.clear();
}

uint64_t RngTracker::seed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seed_;
}

at::Generator RngTracker::get(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = generators_.find(name);
  if (it == generators_.end()) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
    // (the seed mixed in, so two jobs' streams differ)
    h ^= seed_ + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    it = generators_.emplace(name, at::detail::createCPUGenerator(h)).first;
  }
  return it->second;
}

std::map<std::string, at::Tensor> RngTracker::states() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, g] : generators_) {
    at::Generator gen = g;  // (shares the generator)
    std::lock_guard<std::mutex> g_lock(gen.mutex());
    out[name] = gen.get_state();
  }
  return out;
}

void RngTracker::set_states(const std::map<std::string, at::Tensor>& states) {
  std::lock_guard<std::mutex> lock(mu_);
  // (one made since: as it was then, not yet made)
  for (auto it = generators_.begin(); it != generators_.end();) {
    it = states.count(it->first) ? std::next(it) : generators_.erase(it);
  }
  for (const auto& [name, state] : states) {
    auto it = generators_.find(name);
    if (it == generators_.end()) {
      it = generators_.emplace(name, at::detail::createCPUGenerator(0)).first;
    }
    std::lock_guard<std::mutex> g_lock(it->second.mutex());
    it->second.set_state(state);
  }
}

RngTracker& rng_tracker() {
  static auto* t = new RngTracker();  // (outlives every thread's use)
  return *t;
}

KeepDefaultRng::KeepDefaultRng() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  kept_ = gen.get_state();
}

KeepDefaultRng::~KeepDefaultRng() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(kept_);
}

namespace {

void check_p(double p) {
  if (!(p >= 0 && p < 1)) {
    throw std::invalid_argument("parallel::dropout: p must be in [0, 1), got " +
                                std::to_string(p));
  }
}

at::Tensor mask_of(at::IntArrayRef shape, double p, const at::Tensor& like, at::Generator g) {
  at::Tensor mask = at::empty(shape, like.options().requires_grad(false));
  mask.bernoulli_(1 - p, g);  // (which takes g's lock)
  return mask.div_(1 - p);
}

}  // namespace

at::Tensor dropout(const at::Tensor& x, double p, bool train, at::Generator g) {
  check_p(p);
  if (!train || p == 0) return x;
  return x * mask_of(x.sizes(), p, x, std::move(g));
}

at::Tensor dropout_piece(const at::Tensor& x, double p, bool train, at::Generator g,
                         at::IntArrayRef whole, int64_t dim, int64_t start) {
  check_p(p);
  if (!train || p == 0) return x;
  const at::Tensor mask = mask_of(whole, p, x, std::move(g));
  return x * mask.narrow(dim, start, x.size(dim));
}

}  // namespace tandem::parallel
