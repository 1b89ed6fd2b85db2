#include "common/cpu_threads.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fluxion {
namespace {

constexpr char kHelp[] =
    "CPU threads of this process's one pool, shared by the matrix products (OpenBLAS) and the "
    "attention tasks; OpenBLAS and OpenMP are set to it before any compute";

absl::Status CheckCount(const char* flag, int64_t n) {
  if (n < 0 || n > kMaxCpuThreads) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be in [0, ", kMaxCpuThreads,
                                                   "] (0 = the default), got ", n));
  }
  return absl::OkStatus();
}

// The value of the one flag given, --cpu-threads or its deprecated alias --threads.
template <typename T>
absl::StatusOr<T> Pick(const FlagSet& flags, const T& cpu_threads, const T& threads) {
  const bool alias = flags.WasSet("threads");
  if (!alias) return cpu_threads;
  if (flags.WasSet("cpu-threads") && cpu_threads != threads) {
    return absl::InvalidArgumentError(
        "--threads is the deprecated alias of --cpu-threads; give --cpu-threads only");
  }
  if (std::getenv(kCpuThreadsRestartEnv) == nullptr) {  // said once, not again after a restart
    std::cerr << "warning: --threads is deprecated and goes in the next release; use "
                 "--cpu-threads\n";
  }
  return threads;
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

CpuThreadsFlag::CpuThreadsFlag(FlagSet& flags, CpuRole role) : flags_(flags), role_(role) {
  flags.Int("cpu-threads", &cpu_threads_,
            absl::StrCat(kHelp, "; 0 = ",
                         role == CpuRole::kServing
                             ? "the CPUs this process may use minus one (left to the transport's "
                               "progress thread and the server threads), at least 1"
                             : "every CPU this process may use (its affinity mask)"));
  flags.Int("threads", &threads_, "deprecated alias of --cpu-threads");
}

absl::StatusOr<int> CpuThreadsFlag::Resolve(int available) const {
  absl::StatusOr<int64_t> n = Pick(flags_, cpu_threads_, threads_);
  if (!n.ok()) return n.status();
  if (absl::Status s = CheckCount(flags_.WasSet("threads") ? "threads" : "cpu-threads", *n);
      !s.ok()) {
    return s;
  }
  return *n == 0 ? DefaultCpuThreads(role_, available) : static_cast<int>(*n);
}

CpuThreadsListFlag::CpuThreadsListFlag(FlagSet& flags, std::vector<int64_t> defaults)
    : flags_(flags), cpu_threads_(std::move(defaults)) {
  flags.IntList("cpu-threads", &cpu_threads_,
                absl::StrCat("thread counts to measure, one pool each (0 = every CPU this "
                             "process may use)"));
  flags.IntList("threads", &threads_, "deprecated alias of --cpu-threads");
}

absl::StatusOr<std::vector<int64_t>> CpuThreadsListFlag::Resolve(int available) const {
  absl::StatusOr<std::vector<int64_t>> list = Pick(flags_, cpu_threads_, threads_);
  if (!list.ok()) return list.status();
  if (list->empty()) return absl::InvalidArgumentError("--cpu-threads needs at least one value");
  for (int64_t& n : *list) {
    if (absl::Status s = CheckCount("cpu-threads", n); !s.ok()) return s;
    if (n == 0) n = std::max(available, 1);
  }
  return list;
}

}  // namespace fluxion
