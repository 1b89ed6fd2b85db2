#include "bench/cuda_bench_util.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace fluxion::bench {

absl::Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

DeviceMemory::~DeviceMemory() {
  for (void* p : blocks_) cudaFree(p);
}

absl::StatusOr<void*> DeviceMemory::Get(size_t bytes) {
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc(", bytes, "): ", cudaGetErrorString(e)));
  }
  blocks_.push_back(p);
  return p;
}

absl::StatusOr<Stats> TimeMs(cudaStream_t stream, int64_t repeats,
                             const std::function<absl::Status()>& body) {
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  if (cudaError_t e = cudaEventCreate(&stop); e != cudaSuccess) {
    cudaEventDestroy(start);
    return CudaCheck(e, "cudaEventCreate");
  }
  std::vector<double> samples;
  absl::Status status;
  for (int64_t i = 0; i < repeats + 2 && status.ok(); ++i) {
    status = CudaCheck(cudaEventRecord(start, stream), "cudaEventRecord");
    if (status.ok()) status = body();
    if (status.ok()) status = CudaCheck(cudaEventRecord(stop, stream), "cudaEventRecord");
    if (status.ok()) status = CudaCheck(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    if (status.ok()) status = CudaCheck(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    if (status.ok() && i >= 2) samples.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  FLUXION_RETURN_IF_ERROR(status);
  return Summarize(samples);
}

absl::StatusOr<double> HbmCopyGbps(DeviceMemory& mem, cudaStream_t stream, int64_t repeats) {
  const size_t bytes = size_t{2} << 30;
  FLUXION_ASSIGN_OR_RETURN(void* a, mem.Get(bytes));
  FLUXION_ASSIGN_OR_RETURN(void* b, mem.Get(bytes));
  FLUXION_ASSIGN_OR_RETURN(Stats d2d, TimeMs(stream, repeats, [&] {
    return CudaCheck(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream), "d2d");
  }));
  return 2.0 * bytes / (d2d.median * 1e-3) / 1e9;
}

}  // namespace fluxion::bench
