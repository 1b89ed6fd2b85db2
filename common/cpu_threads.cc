#include "common/cpu_threads.h"

#include <sched.h>

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace fluxion {
namespace {

constexpr char kHelp[] =
    "CPU threads of this process's one pool, shared by the matrix products (OpenBLAS) and the "
    "attention tasks; OpenBLAS and OpenMP are set to it before any compute";

absl::Status CheckCount(int64_t n) {
  if (n < 0 || n > kMaxCpuThreads) {
    return absl::InvalidArgumentError(absl::StrCat("--cpu-threads must be in [0, ", kMaxCpuThreads,
                                                   "] (0 = the default), got ", n));
  }
  return absl::OkStatus();
}

}  // namespace

int AvailableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;  // cannot tell: the safe minimum
  return std::max(CPU_COUNT(&set), 1);
}

int DefaultCpuThreads(CpuRole role, int available) {
  available = std::max(available, 1);
  if (role == CpuRole::kServing) return std::max(available - kServingReservedCpus, 1);
  return available;
}

CpuThreadsFlag::CpuThreadsFlag(FlagSet& flags, CpuRole role) : role_(role) {
  flags.Int("cpu-threads", &cpu_threads_,
            absl::StrCat(kHelp, "; 0 = ",
                         role == CpuRole::kServing
                             ? "the CPUs this process may use minus one (left to the transport's "
                               "progress thread and the server threads), at least 1"
                             : "every CPU this process may use (its affinity mask)"));
}

absl::StatusOr<int> CpuThreadsFlag::Resolve(int available) const {
  FLUXION_RETURN_IF_ERROR(CheckCount(cpu_threads_));
  return cpu_threads_ == 0 ? DefaultCpuThreads(role_, available)
                           : static_cast<int>(cpu_threads_);
}

CpuThreadsListFlag::CpuThreadsListFlag(FlagSet& flags, std::vector<int64_t> defaults)
    : cpu_threads_(std::move(defaults)) {
  flags.IntList("cpu-threads", &cpu_threads_,
                absl::StrCat("thread counts to measure, one pool each (0 = every CPU this "
                             "process may use)"));
}

absl::StatusOr<std::vector<int64_t>> CpuThreadsListFlag::Resolve(int available) const {
  if (cpu_threads_.empty()) {
    return absl::InvalidArgumentError("--cpu-threads needs at least one value");
  }
  std::vector<int64_t> list = cpu_threads_;
  for (int64_t& n : list) {
    FLUXION_RETURN_IF_ERROR(CheckCount(n));
    if (n == 0) n = std::max(available, 1);
  }
  return list;
}

}  // namespace fluxion
