// bf16 GEMMs of the decode step's dense half on cuBLAS: weights stay bf16 in HBM, activations are
// cast to bf16, products accumulate in fp32 and land in fp32. At decode batch sizes (m <= 64) these
// products are bound by reading the weights, so the weights' dtype is what sets the step time.
//
// Thread-compatible: one Gemm per stream (cuBLAS handles must not be shared across threads that
// launch concurrently).
#ifndef FLUXION_KERNELS_CUDA_GEMM_H_
#define FLUXION_KERNELS_CUDA_GEMM_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/half.h"

namespace fluxion::kernels::cuda {

// Owns a cuBLAS handle bound to one stream and the workspace it runs in, allocated once at
// Create(), so no GEMM on the hot path allocates device memory.
class Gemm {
 public:
  // Internal (with cuBLAS's or CUDA's message) when the handle or workspace cannot be made.
  static absl::StatusOr<std::unique_ptr<Gemm>> Create(cudaStream_t stream,
                                                      size_t workspace_bytes = 32 << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y[m][n] = x[m][k] . w[n][k]^T (+ y when accumulate); x, w bf16 and y fp32, row-major, on the
  // device. InvalidArgument for a non-positive or too large (> 2^31 - 1) size; Internal when
  // cuBLAS fails.
  absl::Status MatMulBf16(const bf16* x, const bf16* w, float* y, int64_t m, int64_t n, int64_t k,
                          bool accumulate = false);

 private:
  Gemm(cublasHandle_t handle, void* workspace) : handle_(handle), workspace_(workspace) {}
  cublasHandle_t handle_;
  void* workspace_;
};

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_GEMM_H_
