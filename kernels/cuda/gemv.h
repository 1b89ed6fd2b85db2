// A bf16 GEMV-style product for the decode step's smallest batches, offered to the GEMM tuner
// (gemm.h) as one more candidate beside cuBLAS's: y[m][n] = x[m][k] . w[n][k]^T (+ y), x and w
// bf16, fp32 accumulation and output, for 1 <= m <= kMaxGemvRows. At m this small the product is
// a pass over the weights; cuBLAS's kernels are built for tiles of many rows. One warp per output
// column n reads w's row with 16-byte loads, four in flight per lane, and keeps m fp32 partial
// sums; the m rows of x (a few KiB) come from L1. The tuner keeps it only where it times faster
// than cuBLAS on the real operands and matches cuBLAS's result.
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_GEMV_H_
#define FLUXION_KERNELS_CUDA_GEMV_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/half.h"

namespace fluxion::kernels::cuda {

inline constexpr int64_t kMaxGemvRows = 8;

// cudaErrorInvalidValue (nothing launched) unless 1 <= m <= kMaxGemvRows, n and k positive and
// below 2^31, k a multiple of 8, and x and w 16-byte aligned.
cudaError_t GemvBf16(const bf16* x, const bf16* w, float* y, int64_t m, int64_t n, int64_t k,
                     bool accumulate, cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_GEMV_H_
