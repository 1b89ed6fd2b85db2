// CUDA kernels for the dense math, flashinfer-style: plain functions on raw device pointers plus
// sizes and a stream, returning cudaError_t (never aborting). Same contracts as kernels/reference.
//
// Thread-safe: launches on the caller's stream.
#ifndef FLUXION_KERNELS_CUDA_CUDA_OPS_H_
#define FLUXION_KERNELS_CUDA_CUDA_OPS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/half.h"

namespace fluxion::kernels::cuda {

// True when a CUDA device is present and usable (tests skip otherwise).
bool DeviceAvailable();

// y[m][d] = x / sqrt(mean(x^2) + eps) * weight[d]; all device pointers, fp32. y may alias x.
cudaError_t RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m,
                    int64_t d, cudaStream_t stream);

// out[n] = silu(gate[n]) * up[n]; device pointers. out may alias gate or up.
cudaError_t SiluMul(const float* gate, const float* up, float* out, int64_t n,
                    cudaStream_t stream);

// RmsNorm's math with the result rounded to bf16 (nearest even): y [m][d] bf16, the input of the
// product that follows, so no separate cast pass runs. y must not alias x.
cudaError_t RmsNormBf16(const float* x, const float* weight, float eps, bf16* y, int64_t m,
                        int64_t d, cudaStream_t stream);

// out[t][j] = bf16(silu(gate_up[t][j]) * gate_up[t][f + j]) for t < m, j < f: SiluMul's math over
// the stacked gate/up product's rows [m][2f], rounded for the down product.
cudaError_t SiluMulRowsBf16(const float* gate_up, bf16* out, int64_t m, int64_t f,
                            cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_CUDA_OPS_H_
