#include "kernels/cuda/window_ring.h"

#include <cuda_bf16.h>

#include <cmath>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kMaxRingRows = 256;

__device__ __forceinline__ int64_t RingRow(int64_t token, int64_t sink, int64_t window) {
  return token < sink ? token : sink + (token - sink) % window;
}

__device__ __forceinline__ int64_t ValidRows(int64_t context, int64_t sink, int64_t window) {
  const int64_t rest = context - sink > 0 ? context - sink : 0;
  return (context < sink ? context : sink) + (rest < window ? rest : window);
}

__device__ __forceinline__ int64_t HeadBase(const RingLayout& r, int32_t slot, int layer,
                                            int64_t head) {
  return ((static_cast<int64_t>(slot) * r.num_layers + layer) * r.num_kv_heads + head) *
         (r.sink + r.window) * r.head_dim;
}

__device__ __forceinline__ float Load(const bf16* p) {
  return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
}

// One block per (row, KV head); one thread per element of the head.
__global__ void RingAppendKernel(RingLayout r, int layer, const float* k, const float* v,
                                 const int32_t* slots, const int64_t* positions) {
  const int64_t i = blockIdx.x / r.num_kv_heads, h = blockIdx.x % r.num_kv_heads;
  const int64_t dst = HeadBase(r, slots[i], layer, h) +
                      RingRow(positions[i], r.sink, r.window) * r.head_dim;
  const int64_t src = (i * r.num_kv_heads + h) * r.head_dim;
  for (int64_t d = threadIdx.x; d < r.head_dim; d += blockDim.x) {
    reinterpret_cast<__nv_bfloat16*>(r.k)[dst + d] = __float2bfloat16_rn(k[src + d]);
    reinterpret_cast<__nv_bfloat16*>(r.v)[dst + d] = __float2bfloat16_rn(v[src + d]);
  }
}

// One block per (row, query head), 128 threads: every warp scores rows, then thread t < kHeadDim
// accumulates element t of the output over all valid rows (at most kMaxRingRows: one tile).
template <int kHeadDim>
__global__ void RingAttentionKernel(RingLayout r, int layer, const float* q, int64_t num_heads,
                                    float scale, const int32_t* slots, const int64_t* positions,
                                    float* out, float* lse) {
  constexpr int kWarps = 4;
  __shared__ float qs[kHeadDim];
  __shared__ float scores[kMaxRingRows];
  __shared__ float stats[2];
  const int64_t i = blockIdx.x, j = blockIdx.y;
  const int64_t group = num_heads / r.num_kv_heads;
  const int64_t base = HeadBase(r, slots[i], layer, j / group);
  const int64_t rows = ValidRows(positions[i] + 1, r.sink, r.window);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* qi = q + (i * num_heads + j) * kHeadDim;
  for (int d = tid; d < kHeadDim; d += blockDim.x) qs[d] = qi[d];
  __syncthreads();
  for (int64_t row = warp; row < rows; row += kWarps) {
    const bf16* key = r.k + base + row * kHeadDim;
    float dot = 0.0f;
    for (int d = lane; d < kHeadDim; d += 32) dot += qs[d] * Load(key + d);
    for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) scores[row] = dot * scale;
  }
  __syncthreads();
  if (tid == 0) {
    float m = -INFINITY;
    for (int64_t row = 0; row < rows; ++row) m = fmaxf(m, scores[row]);
    float l = 0.0f;
    for (int64_t row = 0; row < rows; ++row) l += __expf(scores[row] - m);
    stats[0] = m;
    stats[1] = l;
  }
  __syncthreads();
  const float m = stats[0], l = stats[1];
  if (tid < kHeadDim) {
    float acc = 0.0f;
    for (int64_t row = 0; row < rows; ++row) {
      acc += __expf(scores[row] - m) * Load(r.v + base + row * kHeadDim + tid);
    }
    out[(i * num_heads + j) * kHeadDim + tid] = rows > 0 ? acc / l : 0.0f;
  }
  if (tid == 0) lse[i * num_heads + j] = rows > 0 ? m + logf(l) : -INFINITY;
}

__global__ void HbmPageAppendKernel(bf16* base, int64_t page_tokens, int64_t max_pages,
                                    int64_t num_kv_heads, int64_t head_dim, const float* k,
                                    const float* v, const int32_t* slots,
                                    const int64_t* positions) {
  const int64_t i = blockIdx.x / num_kv_heads, h = blockIdx.x % num_kv_heads;
  const int64_t t = positions[i];
  const int64_t page = (static_cast<int64_t>(slots[i]) * num_kv_heads + h) * max_pages +
                       t / page_tokens;
  auto* dst_k = reinterpret_cast<__nv_bfloat16*>(base) + page * 2 * page_tokens * head_dim +
                (t % page_tokens) * head_dim;
  auto* dst_v = dst_k + page_tokens * head_dim;
  const int64_t src = (i * num_kv_heads + h) * head_dim;
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    dst_k[d] = __float2bfloat16_rn(k[src + d]);
    dst_v[d] = __float2bfloat16_rn(v[src + d]);
  }
}

}  // namespace

cudaError_t HbmPageAppend(bf16* layer_base, int64_t page_tokens, int64_t max_pages,
                          int64_t num_kv_heads, int64_t head_dim, const float* k, const float* v,
                          const int32_t* slots, const int64_t* positions, int64_t rows,
                          cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows * num_kv_heads > 2147483647 || head_dim <= 0) return cudaErrorInvalidValue;
  const int threads = head_dim < 128 ? static_cast<int>(head_dim) : 128;
  HbmPageAppendKernel<<<static_cast<unsigned>(rows * num_kv_heads), threads, 0, stream>>>(
      layer_base, page_tokens, max_pages, num_kv_heads, head_dim, k, v, slots, positions);
  return cudaGetLastError();
}

cudaError_t RingAppend(const RingLayout& ring, int layer, const float* k, const float* v,
                       const int32_t* slots, const int64_t* positions, int64_t rows,
                       cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows * ring.num_kv_heads > 2147483647 || ring.head_dim <= 0) return cudaErrorInvalidValue;
  const int threads = ring.head_dim < 128 ? static_cast<int>(ring.head_dim) : 128;
  RingAppendKernel<<<static_cast<unsigned>(rows * ring.num_kv_heads), threads, 0, stream>>>(
      ring, layer, k, v, slots, positions);
  return cudaGetLastError();
}

cudaError_t RingAttention(const RingLayout& ring, int layer, const float* q, int64_t num_heads,
                          float scale, const int32_t* slots, const int64_t* positions,
                          int64_t rows, float* out, float* lse, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (ring.sink + ring.window > kMaxRingRows || rows > 2147483647 || num_heads > 65535 ||
      num_heads % ring.num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(num_heads));
  switch (ring.head_dim) {
    case 32:
      RingAttentionKernel<32><<<grid, 128, 0, stream>>>(ring, layer, q, num_heads, scale, slots,
                                                        positions, out, lse);
      break;
    case 64:
      RingAttentionKernel<64><<<grid, 128, 0, stream>>>(ring, layer, q, num_heads, scale, slots,
                                                        positions, out, lse);
      break;
    case 128:
      RingAttentionKernel<128><<<grid, 128, 0, stream>>>(ring, layer, q, num_heads, scale, slots,
                                                         positions, out, lse);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
