// A computing command's CPU setup with `--cpu-threads 1`: OpenMP and OpenBLAS run one thread on
// the calling thread and on every thread started afterwards (the threads a serving node computes
// on), which takes the restart of kernels/cpu/process_cpu.h. Its own main() registers argv, as
// the fluxion binary's does; ctest runs each test as its own process, so the restart reruns only
// this test, now in a process that starts with OMP_NUM_THREADS=1.
#include "kernels/cpu/process_cpu.h"

#include <cblas.h>
#include <omp.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "common/cpu_threads.h"
#include "common/flag_set.h"
#include "gtest/gtest.h"

namespace fluxion::kernels::cpu {
namespace {

// One product big enough to be threaded when allowed; returns OpenBLAS's count afterwards (its
// OpenMP build adopts the calling thread's OpenMP count at each call).
int BlasThreadsAfterAProduct() {
  const int n = 256;
  std::vector<float> a(n * n, 1.0f), b(n * n, 1.0f), c(n * n, 0.0f);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(),
              n, 0.0f, c.data(), n);
  EXPECT_EQ(c[0], static_cast<float>(n));
  return openblas_get_num_threads();
}

// The only test of this binary: every SetUpProcessCpu of one process must ask for one count.
TEST(ProcessCpuTest, CpuThreadsOneSetsOpenBlasAndOpenMpOnEveryThread) {
  FlagSet flags("fluxion test", "");
  CpuThreadsFlag cpu_threads(flags, CpuRole::kServing);
  ASSERT_TRUE(flags.Parse({"--cpu-threads", "1"}).ok());
  absl::StatusOr<int> n = cpu_threads.Resolve();
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_EQ(*n, 1);

  const CpuPool pool = SetUpProcessCpu(*n);
  EXPECT_EQ(pool.threads(), 1);
  EXPECT_EQ(omp_get_max_threads(), 1);
  EXPECT_EQ(openblas_get_num_threads(), 1);
  EXPECT_EQ(BlasThreadsAfterAProduct(), 1);
  ASSERT_NE(std::getenv("OMP_NUM_THREADS"), nullptr);  // and child processes inherit it
  EXPECT_EQ(std::string(std::getenv("OMP_NUM_THREADS")), "1");
  EXPECT_EQ(std::string(std::getenv("OPENBLAS_NUM_THREADS")), "1");

  // A thread started afterwards, as a node's scheduler or batch thread is: OpenMP's default for
  // it was fixed at load, so this holds only in the restarted process.
  EXPECT_EQ(OpenMpThreadsOfNewThreads(), 1);
  int omp_threads = 0, blas_threads = 0;
  std::thread later([&] {
    omp_threads = omp_get_max_threads();
    blas_threads = BlasThreadsAfterAProduct();
  });
  later.join();
  EXPECT_EQ(omp_threads, 1);
  EXPECT_EQ(blas_threads, 1);
}

}  // namespace
}  // namespace fluxion::kernels::cpu

int main(int argc, char** argv) {
  fluxion::kernels::cpu::SetProcessArgv(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
