// One CPU thread budget for a decode step, shared by the matrix products (OpenBLAS) and the
// attention tasks. Both run on OpenMP's threads: the OpenBLAS we link is its OpenMP build
// (docs/DEPENDENCIES.md), so a product called outside a parallel region uses `threads()` OpenMP
// threads and one called inside a ParallelFor task runs single-threaded. The two phases of a step
// alternate, never overlap, so at most threads() threads compute at any time.
//
// Without a pool OpenMP and OpenBLAS each default to every core of the machine; code that takes a
// CpuPool never relies on those defaults. The command-line setting (--cpu-threads) that sizes the
// process's pool is wired by the commands, not here.
//
// Thread-safety: immutable after construction. OpenBLAS keeps one thread count per process, so
// two pools of different sizes used from two threads at once fight over it (results stay correct;
// only the parallelism of the products changes). One pool per process is the intended use.
#ifndef FLUXION_KERNELS_CPU_CPU_POOL_H_
#define FLUXION_KERNELS_CPU_CPU_POOL_H_

#include <cstdint>

#include "absl/functional/function_ref.h"

namespace fluxion::kernels::cpu {

class CpuPool {
 public:
  // A pool of max(threads, 1) threads.
  explicit CpuPool(int threads);

  int threads() const { return threads_; }

  // Runs fn(i) for every i in [0, n) on up to threads() threads, dynamically scheduled (tasks of
  // a decode step differ in size: selected row counts differ between heads). fn must not throw
  // and may be called concurrently for different i.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) const;

  // ParallelFor(n, fn) on a thread made for the call and joined before it returns: for pool work
  // started by a thread other than the one that runs the decode steps (a request's landing on a
  // gRPC thread). Why: libgomp keeps a team of worker threads for every thread that has started
  // a parallel region, for as long as that thread lives, and while it manages more threads than
  // there are CPUs its workers stop spinning between regions, so every region of the step's
  // thread waits for sleeping workers to wake (measured on the dev box: an empty two-thread region
  // with a 50 us gap took 1.4 us, 47.5 us while another thread's team lived, 1.7 us once that
  // thread had exited; on the H200 host a 4 x 128K step's CPU plan 0.8 -> 3.6-4.6 ms,
  // bench/results/decode-pingpong-*-h200-20261204). The team started here dies with its thread.
  void ParallelForOnTransientThread(int64_t n, absl::FunctionRef<void(int64_t)> fn) const;

  // Makes the matrix products called from this thread (outside a ParallelFor) use threads()
  // threads: sets OpenBLAS's process-wide count, and OpenMP's for this thread, when they differ.
  void ApplyToBlas() const;

 private:
  int threads_;
};

// Runs fn(i) for every i in [0, n) as OpenMP tasks and returns when all have run. Called from a
// ParallelFor task, it lets the team's idle threads share that task's work: a decode step's CPU
// phase is one task per (request, KV head), and at small batches there are fewer of those than
// threads (8 KV heads a layer at batch 1 on 16 threads), so one head's long selection kept its
// thread busy while the rest waited at the loop's barrier. Threads waiting at a barrier run
// queued tasks, and so does the caller while it waits for its own. Outside a parallel region fn
// runs on the calling thread, in order. fn must not throw; calls for different i may run
// concurrently and must write disjoint data.
void RunAsTasks(int64_t n, absl::FunctionRef<void(int64_t)> fn);

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_CPU_POOL_H_
