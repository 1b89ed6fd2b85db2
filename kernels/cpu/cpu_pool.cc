#include "kernels/cpu/cpu_pool.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>

namespace fluxion::kernels::cpu {

CpuPool::CpuPool(int threads) : threads_(std::max(threads, 1)) {}

void CpuPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) const {
  if (n <= 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(threads_, n));
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) fn(i);
}

void CpuPool::ApplyToBlas() const {
  // Both setters are cheap, but OpenBLAS's also walks its buffer table: skip it when unchanged.
  if (openblas_get_num_threads() != threads_) openblas_set_num_threads(threads_);
  if (omp_get_max_threads() != threads_) omp_set_num_threads(threads_);
}

}  // namespace fluxion::kernels::cpu
