// The process's CPU setup for a computing command: one pool (cpu_pool.h) whose size OpenBLAS and
// OpenMP take on before any compute, so that no library's default of every core ever applies
// (the flag and its default rule: common/cpu_threads.h).
//
// Why a restart: OpenMP fixes the thread count of threads it has not seen yet when its runtime
// loads (from OMP_NUM_THREADS), and no call changes that afterwards: omp_set_num_threads binds
// only the calling thread, and OpenBLAS's OpenMP build follows the calling thread's count at each
// call. A command's compute runs on threads it starts later (the decode node's scheduler, the
// prefill node's batch and handler threads), which would get every core. So when a thread
// started now would see another count, SetUpProcessCpu sets OMP_NUM_THREADS and
// OPENBLAS_NUM_THREADS and restarts the process in place (execv of /proc/self/exe with the same
// arguments: same pid, parent-death signal kept), once; from then on every thread starts with the
// pool's count, and child processes inherit it.
//
// Thread-compatible: call from main's thread, once, before starting threads.
#ifndef FLUXION_KERNELS_CPU_PROCESS_CPU_H_
#define FLUXION_KERNELS_CPU_PROCESS_CPU_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/cpu_threads.h"
#include "kernels/cpu/cpu_pool.h"

namespace fluxion::kernels::cpu {

// main()'s argv (null-terminated, outliving the process's setup), so that SetUpProcessCpu can
// restart the process. Without it (a command run inside a test) there is no restart: only the
// calling thread and the environment are set.
void SetProcessArgv(char** argv);

// Sets the process up for one pool of max(threads, 1) threads (see above) and returns it. Call
// first thing after parsing the flags: a restart runs everything before it again.
CpuPool SetUpProcessCpu(int threads);
// The same for a command's parsed --cpu-threads; its errors (InvalidArgument naming the flag).
absl::StatusOr<CpuPool> SetUpProcessCpu(const CpuThreadsFlag& flag);
// For measuring commands that sweep --cpu-threads: the resolved sweep, the process set up for its
// largest count (each point then sets its own count on the thread that measures).
absl::StatusOr<std::vector<int64_t>> SetUpProcessCpuSweep(const CpuThreadsListFlag& flag);

// OpenMP's thread count as a thread started now sees it (its runtime's default for new threads).
int OpenMpThreadsOfNewThreads();

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_PROCESS_CPU_H_
