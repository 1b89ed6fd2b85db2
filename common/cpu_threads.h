// --cpu-threads: how many CPU threads a computing command's one pool gets (kernels/cpu/cpu_pool.h:
// shared by OpenBLAS and the attention tasks), and the rule for its default. The setup that
// applies it to the process (OpenBLAS and OpenMP, before any compute) is
// kernels/cpu/process_cpu.h; this part only parses and decides, so it needs neither.
//
// Defaults (docs/SERVING.md, "CPU threads"):
//   offline commands (generate, eval, bench)  every CPU the process may run on (sched_getaffinity:
//                                             a container's or taskset's cpuset, not the machine's)
//   serving nodes (prefill, decode)           those minus kServingReservedCpus, at least 1: the
//                                             UCX progress thread (it moves layer l while layer
//                                             l + 1 computes) and the gRPC threads (streaming,
//                                             landing checks) must not wait behind a pool that
//                                             holds every core; the hybrid executor's GPU feeder
//                                             (issue 14) will need one more.
//
// Thread-compatible.
#ifndef FLUXION_COMMON_CPU_THREADS_H_
#define FLUXION_COMMON_CPU_THREADS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/flag_set.h"

namespace fluxion {

enum class CpuRole {
  kOffline,  // one job on this machine: every available CPU
  kServing,  // a node sharing its CPUs with its transport and server threads
};

// CPUs a serving node leaves outside its pool by default (see above).
inline constexpr int kServingReservedCpus = 1;
// Set in a process restarted by kernels/cpu/process_cpu.h (to the thread count it restarted
// for): a restart that did not take is not tried again, and warnings are not printed twice.
inline constexpr char kCpuThreadsRestartEnv[] = "FLUXION_CPU_THREADS_RESTARTED_FOR";
// Larger values are refused: a typo, not a machine (oversubscription itself is allowed).
inline constexpr int64_t kMaxCpuThreads = 4096;

// CPUs this process may run on (sched_getaffinity), at least 1.
int AvailableCpus();

// The pool size --cpu-threads 0 (or no flag) means for `role` on `available` CPUs.
int DefaultCpuThreads(CpuRole role, int available);

// `--cpu-threads N` (0 = the role's default).
class CpuThreadsFlag {
 public:
  // Registers the flag on `flags`, which must outlive this object.
  CpuThreadsFlag(FlagSet& flags, CpuRole role);

  // After flags.Parse(): the pool size. InvalidArgument naming the flag for a negative value or
  // one above kMaxCpuThreads.
  absl::StatusOr<int> Resolve(int available) const;
  absl::StatusOr<int> Resolve() const { return Resolve(AvailableCpus()); }

 private:
  const CpuRole role_;
  int64_t cpu_threads_ = 0;
};

// `--cpu-threads a,b,...` of measuring commands that sweep thread counts (0 = every available
// CPU).
class CpuThreadsListFlag {
 public:
  // `defaults` is the sweep without the flag.
  CpuThreadsListFlag(FlagSet& flags, std::vector<int64_t> defaults);

  // After flags.Parse(): the sweep, 0 replaced by `available`. Errors as CpuThreadsFlag, and for
  // an empty list.
  absl::StatusOr<std::vector<int64_t>> Resolve(int available) const;
  absl::StatusOr<std::vector<int64_t>> Resolve() const { return Resolve(AvailableCpus()); }

 private:
  std::vector<int64_t> cpu_threads_;
};

}  // namespace fluxion

#endif  // FLUXION_COMMON_CPU_THREADS_H_
