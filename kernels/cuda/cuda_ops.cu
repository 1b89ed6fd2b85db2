#include "kernels/cuda/cuda_ops.h"

#include <algorithm>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row: each thread sums a strided slice of squares, the block reduces through
// shared memory, then every thread scales its slice.
__global__ void RmsNormKernel(const float* __restrict__ x, const float* __restrict__ weight,
                              float eps, float* y, int64_t d) {
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
  float* out = y + blockIdx.x * d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[j] = row[j] * inv * weight[j];
}

__global__ void SiluMulKernel(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + __expf(-g)) * up[i];
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
  RmsNormKernel<<<static_cast<unsigned>(m), kThreads, 0, stream>>>(x, weight, eps, y, d);
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
