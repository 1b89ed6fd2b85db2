#include "kernels/cuda/block_scores.h"

#include <cuda_bf16.h>

#include <cmath>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kMaxGroup = 8;
constexpr int kWarpsPerBlock = 8;
constexpr int kBlocksPerWarp = 4;  // score blocks handled by one warp, one after another

__device__ __forceinline__ __nv_bfloat16* Bf(bf16* p) {
  return reinterpret_cast<__nv_bfloat16*>(p);
}

// One block per (row, KV head), one thread per element.
__global__ void PageBoundsAppendKernel(PageBoundsLayout b, int layer, const float* k,
                                       const int32_t* slots, const int64_t* positions,
                                       const int32_t* block_tokens) {
  const int64_t i = blockIdx.x / b.num_kv_heads, h = blockIdx.x % b.num_kv_heads;
  if (block_tokens[i] <= 0) return;
  const int64_t pos = positions[i];
  const int64_t page = pos / b.page_tokens;
  const bool first = pos % b.page_tokens == 0;
  const int64_t at = BoundsOffset(b, slots[i], layer, h) + page * b.head_dim;
  const float* src = k + (i * b.num_kv_heads + h) * b.head_dim;
  for (int64_t d = threadIdx.x; d < b.head_dim; d += blockDim.x) {
    // The bounds describe the stored (bf16) key, as PagedKv's do.
    const __nv_bfloat16 kr = __float2bfloat16_rn(src[d]);
    if (first) {
      Bf(b.min)[at + d] = kr;
      Bf(b.max)[at + d] = kr;
    } else {
      Bf(b.min)[at + d] = __hmin(Bf(b.min)[at + d], kr);
      Bf(b.max)[at + d] = __hmax(Bf(b.max)[at + d], kr);
    }
  }
}

// kN consecutive bf16 values (kN * 2 bytes, aligned to that) as floats, in one load.
template <int kN>
__device__ __forceinline__ void LoadBf16(const bf16* p, float* out) {
  if constexpr (kN == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    out[0] = a.x;
    out[1] = a.y;
    out[2] = b.x;
    out[3] = b.y;
  } else if constexpr (kN == 2) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
    out[0] = a.x;
    out[1] = a.y;
  } else {
    out[0] = __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
  }
}

// grid (ceil(max_blocks / (kWarpsPerBlock * kBlocksPerWarp)), num_kv_heads, rows); each warp
// scores kBlocksPerWarp consecutive blocks, each lane kHeadDim / 32 consecutive elements of the
// head (one vector load per page and bound).
template <int kHeadDim>
__global__ void QuestBlockScoresKernel(PageBoundsLayout b, int layer, const float* q,
                                       int64_t num_heads, const int32_t* slots,
                                       const int64_t* positions, const int32_t* block_tokens,
                                       const int64_t* offsets, float* scores) {
  constexpr int kPerLane = kHeadDim / 32;
  const int64_t i = blockIdx.z, h = blockIdx.y;
  const int64_t block = block_tokens[i];
  if (block <= 0 || offsets[i] < 0) return;
  const int64_t context = positions[i] + 1;
  const int64_t nb = (context + block - 1) / block;
  const int64_t pages = (context + b.page_tokens - 1) / b.page_tokens;
  const int64_t ppb = block / b.page_tokens;
  const int64_t group = num_heads / b.num_kv_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t first =
      (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp) * kBlocksPerWarp;
  if (first >= nb) return;
  // This lane's elements of the group's queries, loaded once for the warp's blocks.
  float qv[kMaxGroup][kPerLane];
  for (int g = 0; g < kMaxGroup; ++g) {
    for (int e = 0; e < kPerLane; ++e) {
      qv[g][e] =
          g < group ? q[(i * num_heads + h * group + g) * kHeadDim + lane * kPerLane + e] : 0.f;
    }
  }
  const int64_t base = BoundsOffset(b, slots[i], layer, h);
  float* out = scores + offsets[i] + h * nb;
  for (int64_t blk = first; blk < first + kBlocksPerWarp && blk < nb; ++blk) {
    float lo[kPerLane], hi[kPerLane];
    for (int e = 0; e < kPerLane; ++e) {
      lo[e] = INFINITY;
      hi[e] = -INFINITY;
    }
    const int64_t p_end = min((blk + 1) * ppb, pages);
    for (int64_t p = blk * ppb; p < p_end; ++p) {
      const int64_t at = base + p * kHeadDim + lane * kPerLane;
      float mn[kPerLane], mx[kPerLane];
      LoadBf16<kPerLane>(b.min + at, mn);
      LoadBf16<kPerLane>(b.max + at, mx);
      for (int e = 0; e < kPerLane; ++e) {
        lo[e] = fminf(lo[e], mn[e]);
        hi[e] = fmaxf(hi[e], mx[e]);
      }
    }
    float best = -INFINITY;
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      float acc = 0.0f;
      for (int e = 0; e < kPerLane; ++e) acc += fmaxf(qv[g][e] * lo[e], qv[g][e] * hi[e]);
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      best = fmaxf(best, acc);
    }
    if (lane == 0) out[blk] = best;
  }
}

}  // namespace

cudaError_t PageBoundsAppend(const PageBoundsLayout& bounds, int layer, const float* k,
                             const int32_t* slots, const int64_t* positions,
                             const int32_t* block_tokens, int64_t rows, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const int threads = bounds.head_dim < 128 ? static_cast<int>(bounds.head_dim) : 128;
  PageBoundsAppendKernel<<<static_cast<unsigned>(rows * bounds.num_kv_heads), threads, 0,
                           stream>>>(bounds, layer, k, slots, positions, block_tokens);
  return cudaGetLastError();
}

cudaError_t QuestBlockScores(const PageBoundsLayout& bounds, int layer, const float* q,
                             int64_t num_heads, const int32_t* slots, const int64_t* positions,
                             const int32_t* block_tokens, const int64_t* offsets, int64_t rows,
                             int64_t max_blocks, float* scores, cudaStream_t stream) {
  if (rows <= 0 || max_blocks <= 0) return cudaSuccess;
  if (bounds.num_kv_heads <= 0 || num_heads % bounds.num_kv_heads != 0 ||
      num_heads / bounds.num_kv_heads > kMaxGroup) {
    return cudaErrorInvalidValue;
  }
  const int64_t per_cta = kWarpsPerBlock * kBlocksPerWarp;
  const dim3 grid(static_cast<unsigned>((max_blocks + per_cta - 1) / per_cta),
                  static_cast<unsigned>(bounds.num_kv_heads), static_cast<unsigned>(rows));
  const int threads = 32 * kWarpsPerBlock;
  switch (bounds.head_dim) {
    case 32:
      QuestBlockScoresKernel<32><<<grid, threads, 0, stream>>>(
          bounds, layer, q, num_heads, slots, positions, block_tokens, offsets, scores);
      break;
    case 64:
      QuestBlockScoresKernel<64><<<grid, threads, 0, stream>>>(
          bounds, layer, q, num_heads, slots, positions, block_tokens, offsets, scores);
      break;
    case 128:
      QuestBlockScoresKernel<128><<<grid, threads, 0, stream>>>(
          bounds, layer, q, num_heads, slots, positions, block_tokens, offsets, scores);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
