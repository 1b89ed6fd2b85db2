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

// One block of kNormThreads per row: each thread sums a strided slice of squares (unrolled, so a
// thread's loads are in flight together: at decode m = 1..16 rows the kernel is latency-bound,
// one block per row), warps reduce by shuffles and then across warps through shared memory, and
// every thread scales its slice (the same arithmetic for both outputs).
constexpr int kNormThreads = 1024;
static_assert(kNormThreads == 32 * 32, "the second reduction stage takes one warp sum per lane");

template <typename Out>
__global__ void __launch_bounds__(kNormThreads)
    RmsNormKernel(const float* __restrict__ x, const float* __restrict__ weight, float eps, Out* y,
                  int64_t d) {
  __shared__ float warp_sums[kNormThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float* row = x + blockIdx.x * d;
  float ss = 0.0f;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < d; j += kNormThreads) {
    const float v = row[j];
    ss += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, offset);
  if (lane == 0) warp_sums[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    float s = warp_sums[lane];  // kNormThreads / 32 == 32 warps: one value per lane
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) warp_sums[0] = s;
  }
  __syncthreads();
  const float inv = rsqrtf(warp_sums[0] / static_cast<float>(d) + eps);
  Out* out = y + blockIdx.x * d;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < d; j += kNormThreads) {
    Store(out + j, row[j] * inv * weight[j]);
  }
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
  RmsNormKernel<float><<<static_cast<unsigned>(m), kNormThreads, 0, stream>>>(x, weight, eps, y,
                                                                         d);
  return cudaGetLastError();
}

cudaError_t RmsNormBf16(const float* x, const float* weight, float eps, bf16* y, int64_t m,
                        int64_t d, cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  RmsNormKernel<bf16><<<static_cast<unsigned>(m), kNormThreads, 0, stream>>>(x, weight, eps, y,
                                                                        d);
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
