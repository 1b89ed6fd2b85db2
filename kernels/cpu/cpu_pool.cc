#include "kernels/cpu/cpu_pool.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <system_error>
#include <thread>

namespace fluxion::kernels::cpu {

CpuPool::CpuPool(int threads) : threads_(std::max(threads, 1)) {}

void CpuPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) const {
  if (n <= 0) return;
  if (threads_ <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Always the whole team, even for fewer tasks than threads (the idle ones find no work):
  // libgomp retires the threads a smaller team leaves out and creates them again for the next
  // larger one, so alternating team sizes (4 requests' selection, then 32 attention tasks, per
  // layer) would cost ~1.7 ms per layer in thread creation on the H200 host.
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) fn(i);
}

void CpuPool::ParallelForOnTransientThread(int64_t n,
                                           absl::FunctionRef<void(int64_t)> fn) const {
  if (n <= 0) return;
  if (threads_ <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);  // no team: nothing outlives the call
    return;
  }
  std::thread worker;
  try {
    worker = std::thread([&] { ParallelFor(n, fn); });
  } catch (const std::system_error&) {
    // No thread to spare (a process or system thread limit): the work still runs, here, at the
    // price of a team on this thread.
    ParallelFor(n, fn);
    return;
  }
  worker.join();
}

void RunAsTasks(int64_t n, absl::FunctionRef<void(int64_t)> fn) {
  if (n <= 0) return;
  if (n == 1 || !omp_in_parallel()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // One task per item (the callers size items at tens of microseconds or more); the taskloop's
  // implicit taskgroup is the wait.
#pragma omp taskloop grainsize(1) shared(fn)
  for (int64_t i = 0; i < n; ++i) fn(i);
}

void CpuPool::ApplyToBlas() const {
  // Both setters are cheap, but OpenBLAS's also walks its buffer table: skip it when unchanged.
  if (openblas_get_num_threads() != threads_) openblas_set_num_threads(threads_);
  if (omp_get_max_threads() != threads_) omp_set_num_threads(threads_);
}

}  // namespace fluxion::kernels::cpu
