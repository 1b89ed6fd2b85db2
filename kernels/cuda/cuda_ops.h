// CUDA kernels for the dense math, flashinfer-style: plain functions on raw device pointers plus
// sizes and a stream, returning cudaError_t (never aborting). Same contracts as kernels/reference.
//
// Thread-safe: launches on the caller's stream.
#ifndef FLUXION_KERNELS_CUDA_CUDA_OPS_H_
#define FLUXION_KERNELS_CUDA_CUDA_OPS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace fluxion::kernels::cuda {

// True when a CUDA device is present and usable (tests skip otherwise).
bool DeviceAvailable();

// y[m][d] = x / sqrt(mean(x^2) + eps) * weight[d]; all device pointers, fp32. y may alias x.
cudaError_t RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m,
                    int64_t d, cudaStream_t stream);

// out[n] = silu(gate[n]) * up[n]; device pointers. out may alias gate or up.
cudaError_t SiluMul(const float* gate, const float* up, float* out, int64_t n,
                    cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_CUDA_OPS_H_
