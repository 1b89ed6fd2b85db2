#include "kernels/cpu/process_cpu.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>

#include "common/cpu_threads.h"

namespace fluxion::kernels::cpu {
namespace {

char** g_argv = nullptr;
// Set (to the thread count) in the restarted process: a restart that did not take (a runtime
// that ignores OMP_NUM_THREADS) is not tried again for the same count.
constexpr const char* kRestartedFor = kCpuThreadsRestartEnv;

void Restart(const std::string& threads) {
  setenv(kRestartedFor, threads.c_str(), 1);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  execv("/proc/self/exe", g_argv);
  // Still here: the restart failed (no /proc?). The calling thread is still set below.
  std::cerr << "warning: restarting with OMP_NUM_THREADS=" << threads
            << " failed (errno " << errno << ": " << std::strerror(errno)
            << "); threads started from now on get OpenMP's default\n";
}

}  // namespace

void SetProcessArgv(char** argv) { g_argv = argv; }

int OpenMpThreadsOfNewThreads() {
  int threads = 0;
  std::thread probe([&threads] { threads = omp_get_max_threads(); });
  probe.join();
  return threads;
}

CpuPool SetUpProcessCpu(int threads) {
  const CpuPool pool(threads);
  const std::string n = std::to_string(pool.threads());
  setenv("OMP_NUM_THREADS", n.c_str(), 1);
  setenv("OPENBLAS_NUM_THREADS", n.c_str(), 1);
  const char* restarted_for = std::getenv(kRestartedFor);
  if (g_argv != nullptr && OpenMpThreadsOfNewThreads() != pool.threads() &&
      (restarted_for == nullptr || n != restarted_for)) {
    Restart(n);
  }
  pool.ApplyToBlas();  // this thread: OpenMP's count and OpenBLAS's (process-wide)
  return pool;
}

absl::StatusOr<CpuPool> SetUpProcessCpu(const CpuThreadsFlag& flag) {
  absl::StatusOr<int> threads = flag.Resolve();
  if (!threads.ok()) return threads.status();
  return SetUpProcessCpu(*threads);
}

absl::StatusOr<std::vector<int64_t>> SetUpProcessCpuSweep(const CpuThreadsListFlag& flag) {
  absl::StatusOr<std::vector<int64_t>> sweep = flag.Resolve();
  if (!sweep.ok()) return sweep.status();
  SetUpProcessCpu(static_cast<int>(*std::max_element(sweep->begin(), sweep->end())));
  return sweep;
}

}  // namespace fluxion::kernels::cpu
