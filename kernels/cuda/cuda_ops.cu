#include "kernels/cuda/cuda_ops.h"

#include <cuda_bf16.h>

#include <algorithm>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void Store(float* p, float v) { *p = v; }
__device__ __forceinline__ void Store(bf16* p, float v) {
  *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(v);
}

// SiluMul's expression, shared by both kernels so the fused form rounds the same fp32 value.
__device__ __forceinline__ float Silu(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

// One block per row: each thread sums a strided slice of squares, the block reduces through
// shared memory, then every thread scales its slice (the same arithmetic for both outputs).
template <typename Out>
__global__ void RmsNormKernel(const float* __restrict__ x, const float* __restrict__ weight,
                              float eps, Out* y, int64_t d) {
  __shared__ float partial[kThreads];
  const float* row = x + blockIdx.x * d;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += row[j] * row[j];
  partial[threadIdx.x] = ss;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  const float inv = rsqrtf(partial[0] / static_cast<float>(d) + eps);
  Out* out = y + blockIdx.x * d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) Store(out + j, row[j] * inv * weight[j]);
}

__global__ void SiluMulKernel(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = Silu(gate[i], up[i]);
  }
}

__global__ void SiluMulRowsKernel(const float* gate_up, bf16* out, int64_t m, int64_t f) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < m * f;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / f, j = i % f;
    const float* row = gate_up + t * 2 * f;
    Store(out + i, Silu(row[j], row[f + j]));
  }
}

}  // namespace

bool DeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

cudaError_t RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m,
                    int64_t d, cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  RmsNormKernel<float><<<static_cast<unsigned>(m), kThreads, 0, stream>>>(x, weight, eps, y, d);
  return cudaGetLastError();
}

cudaError_t RmsNormBf16(const float* x, const float* weight, float eps, bf16* y, int64_t m,
                        int64_t d, cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  RmsNormKernel<bf16><<<static_cast<unsigned>(m), kThreads, 0, stream>>>(x, weight, eps, y, d);
  return cudaGetLastError();
}

cudaError_t SiluMulRowsBf16(const float* gate_up, bf16* out, int64_t m, int64_t f,
                            cudaStream_t stream) {
  if (m == 0 || f == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((m * f + kThreads - 1) / kThreads, 65535);
  SiluMulRowsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(gate_up, out, m, f);
  return cudaGetLastError();
}

cudaError_t SiluMul(const float* gate, const float* up, float* out, int64_t n,
                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65535);
  SiluMulKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(gate, up, out, n);
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
