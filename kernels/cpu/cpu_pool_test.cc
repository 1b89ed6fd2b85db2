// CpuPool: every index runs exactly once for any pool size and task count, and ApplyToBlas hands
// the pool's size to OpenBLAS and OpenMP.
#include "kernels/cpu/cpu_pool.h"

#include <cblas.h>
#include <omp.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace fluxion::kernels::cpu {
namespace {

TEST(CpuPoolTest, ParallelForRunsEveryIndexOnce) {
  for (int threads : {0, 1, 2, 3}) {
    const CpuPool pool(threads);
    EXPECT_EQ(pool.threads(), std::max(threads, 1));
    for (int64_t n : {0, 1, 2, 7, 100}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](int64_t i) { hits[i].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << threads << " " << n;
    }
  }
}

TEST(CpuPoolTest, ParallelForOnTransientThreadRunsEveryIndexOnceAwayFromTheCaller) {
  const CpuPool pool(2);
  std::vector<std::atomic<int>> hits(100);
  std::mutex mu;
  std::set<std::thread::id> runners;
  pool.ParallelForOnTransientThread(100, [&](int64_t i) {
    ++hits[i];
    std::lock_guard<std::mutex> lock(mu);
    runners.insert(std::this_thread::get_id());
  });
  for (const std::atomic<int>& h : hits) EXPECT_EQ(h.load(), 1);
  // Its team is the transient thread's, never the caller's (whose team would outlive the call).
  EXPECT_EQ(runners.count(std::this_thread::get_id()), 0u);
  // One thread, or one index: no team is started, so it runs here.
  const CpuPool one(1);
  std::thread::id ran;
  one.ParallelForOnTransientThread(1, [&](int64_t) { ran = std::this_thread::get_id(); });
  EXPECT_EQ(ran, std::this_thread::get_id());
}

TEST(CpuPoolTest, ApplyToBlasSetsTheThreadCounts) {
  const int before = openblas_get_num_threads();
  const CpuPool one(1), two(2);
  two.ApplyToBlas();
  EXPECT_EQ(openblas_get_num_threads(), 2);
  EXPECT_EQ(omp_get_max_threads(), 2);
  one.ApplyToBlas();
  EXPECT_EQ(openblas_get_num_threads(), 1);
  EXPECT_EQ(omp_get_max_threads(), 1);
  openblas_set_num_threads(before);
}

}  // namespace
}  // namespace fluxion::kernels::cpu
