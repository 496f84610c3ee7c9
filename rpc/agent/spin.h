// spin_until: keep the core busy for a short while before a thread sleeps.
// On an idle core, waking a sleeping thread costs more than a loopback round
// trip, so the blocking calls, the pool and the distributed backward spin
// briefly for what they wait for first (AgentOptions::sync_spin, pool_spin).
#pragma once

#include <sched.h>

#include <chrono>

namespace tandem::rpc {

// Polls `done()` until it is true or `limit` has passed; returns done().
template <class F>
bool spin_until(std::chrono::microseconds limit, F done) {
  if (limit.count() <= 0) return done();
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    // Let a thread that became runnable on this core go first: a socket's
    // reader woken by our own send is often queued here (the scheduler
    // keeps wakees near their wakers), and a pure spin would make it wait
    // out the spin (the 0 B echo then took 40-120 us instead of ~22).
    sched_yield();
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  return true;
}

}  // namespace tandem::rpc
