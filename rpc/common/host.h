#pragma once
// Process-wide host settings a training job wants: freed memory kept for the
// next step, and how many threads the CPU kernels use.
//
// ---- Keeping freed host memory in the process ----
//
// A training step allocates and frees the same large tensors every time
// (activations, gradients, received messages of hundreds of KiB to MiBs).
// glibc's malloc hands blocks over 128 KiB back to the kernel when they are
// freed, or trims them off the top of a thread's heap, so the next step
// faults every page in again, zero-filled: on a VM each fault costs
// microseconds, and mp_bench's step spent about 2 ms of its 10 in them.
// A thread other than the one that allocated also frees into a different
// arena than the local case would, so glibc's dynamic threshold (which keeps
// a single-threaded loop warm) does not help.
//
// retain_freed_memory() raises both thresholds once per process, so blocks up
// to 32 MiB come from the heaps and up to 256 MiB of free memory stays mapped
// for reuse: the CPU counterpart of a GPU caching allocator. It also keeps
// every thread on the one main arena: handlers run on whichever pool thread
// is free, and per-thread arenas (64 MiB heaps each) warmed up one by one
// (pipeline_bench's one-stage step at batch 2048: 0.88-0.94 of the local
// step with them, 0.96-0.99 without; half the page faults). Small blocks
// still come from each thread's own cache, without the arena's lock.
// It leaves malloc alone when the user tuned it (MALLOC_MMAP_THRESHOLD_,
// MALLOC_TRIM_THRESHOLD_, MALLOC_ARENA_MAX, GLIBC_TUNABLES naming
// glibc.malloc), when TANDEM_RETAIN_MEMORY=0, or where the C library is
// not glibc. rpc::init calls it unless
// AgentOptions::retain_freed_memory is false.
#include <string>

namespace tandem::rpc {

// Applies the settings (once per process); true when they are in effect.
bool retain_freed_memory();
// Whether an earlier retain_freed_memory() put them in effect.
bool freed_memory_retained();

// ---- Threads ----
// at::set_num_threads(n), and the same for OpenBLAS's own thread pool, which
// at::set_num_threads leaves alone: with several processes on one host
// (one per rank), each running OpenBLAS with a thread per core, the ranks'
// GEMMs fight for the cores (ddp_bench's forward took 40% longer). tandem-run
// sets OMP_NUM_THREADS, which OpenBLAS reads too, for the processes it starts.
// Throws std::invalid_argument for n < 1.
void set_num_threads(int n);

// ---- Which host ----
// This boot of this machine (/proc/sys/kernel/random/boot_id), read once:
// processes that agree on it share one steady clock (the trace's, rpc/trace.h)
// and can share memory (the shm transport). Empty where it cannot be read.
const std::string& boot_id();

}  // namespace tandem::rpc
