// What the CUDA benchmarks (`fluxion bench gpu`, `fluxion bench selection`) share: CUDA errors as
// statuses, device memory owned for a benchmark's lifetime, event timing, and the HBM copy probe
// their ratios are taken against. Built only with CUDA.
#ifndef FLUXION_BENCH_CUDA_BENCH_UTIL_H_
#define FLUXION_BENCH_CUDA_BENCH_UTIL_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/bench_util.h"

namespace fluxion::bench {

// OK, or Internal naming `what` and CUDA's message.
absl::Status CudaCheck(cudaError_t e, const char* what);
#define BENCH_CUDA(expr) FLUXION_RETURN_IF_ERROR(::fluxion::bench::CudaCheck((expr), #expr))

// Device memory owned for the benchmark's lifetime (freed by the destructor).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory();
  // ResourceExhausted when the device has no room.
  absl::StatusOr<void*> Get(size_t bytes);

 private:
  std::vector<void*> blocks_;
};

// Median (and spread) of `repeats` timings of `body` in ms, CUDA events on `stream`, after two
// warm-up runs.
absl::StatusOr<Stats> TimeMs(cudaStream_t stream, int64_t repeats,
                             const std::function<absl::Status()>& body);

// The device's HBM bandwidth as a 2 GiB device-to-device copy moves it (bytes read + written).
absl::StatusOr<double> HbmCopyGbps(DeviceMemory& mem, cudaStream_t stream, int64_t repeats);

}  // namespace fluxion::bench

#endif  // FLUXION_BENCH_CUDA_BENCH_UTIL_H_
