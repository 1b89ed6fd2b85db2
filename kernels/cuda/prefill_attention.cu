#include "kernels/cuda/prefill_attention.h"

#include <cuda_bf16.h>
#include <mma.h>

#include <cmath>

namespace fluxion::kernels::cuda {
namespace {

using namespace nvcuda;  // wmma

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerBlock = kWarps * 16;  // each warp owns 16 query rows
constexpr int kKeysPerTile = 64;

// The block's shared memory, by section. Row strides are padded off the 32 banks and keep every
// WMMA fragment pointer 32-byte aligned (ldm a multiple of 8 for bf16, of 4 for fp32).
template <int D>
struct Smem {
  static constexpr int kLdQK = D + 8;            // bf16: Q, K and V tiles
  static constexpr int kLdS = kKeysPerTile + 4;  // fp32: a warp's scores
  static constexpr int kLdP = kKeysPerTile + 8;  // bf16: a warp's probabilities
  static constexpr int kLdO = D + 4;             // fp32: a warp's output accumulator
  static constexpr size_t kQ = size_t{kRowsPerBlock} * kLdQK * 2;
  static constexpr size_t kK = size_t{kKeysPerTile} * kLdQK * 2;
  static constexpr size_t kS = size_t{kWarps} * 16 * kLdS * 4;
  static constexpr size_t kP = size_t{kWarps} * 16 * kLdP * 2;
  static constexpr size_t kO = size_t{kWarps} * 16 * kLdO * 4;
  static constexpr size_t kBytes = kQ + 2 * kK + kS + kP + kO;
};

using AFrag = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using KFrag = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major>;
using VFrag = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using CFrag = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// One block: query rows [r0, r0 + 64) of the chunk and one query head. Each warp keeps its 16
// rows' output in shared memory (a WMMA accumulator's element-to-row mapping is opaque, and the
// online softmax rescales by row) and its Q fragments in registers; lane pairs own a row's
// softmax state (lane / 2 = row, lane % 2 = which half of the tile's columns).
template <int D>
__global__ void __launch_bounds__(kThreads)
    PrefillAttentionKernel(LayerPages pages, const float* __restrict__ q, int64_t first,
                           int64_t rows, int num_heads, int group, float scale_log2,
                           float* __restrict__ out) {
  using S = Smem<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(smem + S::kQ);
  __nv_bfloat16* vs = reinterpret_cast<__nv_bfloat16*>(smem + S::kQ + S::kK);
  float* ss = reinterpret_cast<float*>(smem + S::kQ + 2 * S::kK);
  __nv_bfloat16* ps = reinterpret_cast<__nv_bfloat16*>(smem + S::kQ + 2 * S::kK + S::kS);
  float* os = reinterpret_cast<float*>(smem + S::kQ + 2 * S::kK + S::kS + S::kP);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int head = blockIdx.y;
  const int64_t block_rows = rows - r0 < kRowsPerBlock ? rows - r0 : kRowsPerBlock;
  const int64_t kv_end = first + r0 + block_rows;  // keys this block's rows can see

  for (int i = threadIdx.x; i < kRowsPerBlock * D; i += kThreads) {
    const int r = i / D, c = i % D;
    const float x = r < block_rows ? q[((r0 + r) * num_heads + head) * D + c] : 0.0f;
    qs[r * S::kLdQK + c] = __float2bfloat16_rn(x);
  }
  float* ow = os + warp * 16 * S::kLdO;
  for (int i = lane; i < 16 * D; i += 32) ow[(i / D) * S::kLdO + i % D] = 0.0f;
  __syncthreads();
  AFrag qf[D / 16];
  for (int kk = 0; kk < D / 16; ++kk) {
    wmma::load_matrix_sync(qf[kk], qs + warp * 16 * S::kLdQK + kk * 16, S::kLdQK);
  }

  const int my_row = lane / 2, half = lane % 2;
  const int64_t my_pos = first + r0 + warp * 16 + my_row;
  const bool row_valid = warp * 16 + my_row < block_rows;
  const int64_t warp_last = first + r0 + warp * 16 + 15;
  float m = -INFINITY, l = 0.0f;

  const int64_t pt = pages.page_tokens;
  const __nv_bfloat16* head_pages = reinterpret_cast<const __nv_bfloat16*>(pages.base) +
                                    (head / group) * pages.pages_per_head * 2 * pt * D;
  float* sw = ss + warp * 16 * S::kLdS;
  __nv_bfloat16* pw = ps + warp * 16 * S::kLdP;
  constexpr int kVecPerRow = D / 8;  // 16-byte vectors of 8 bf16

  for (int64_t k0 = 0; k0 < kv_end; k0 += kKeysPerTile) {
    __syncthreads();  // every warp is done with the previous tile
    for (int i = threadIdx.x; i < kKeysPerTile * kVecPerRow; i += kThreads) {
      const int r = i / kVecPerRow, c = (i % kVecPerRow) * 8;
      const int64_t key = k0 + r;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (key < kv_end) {  // zeros past the end: a masked probability times garbage could be NaN
        const __nv_bfloat16* page = head_pages + (key / pt) * 2 * pt * D + (key % pt) * D + c;
        kv = *reinterpret_cast<const uint4*>(page);
        vv = *reinterpret_cast<const uint4*>(page + pt * D);
      }
      *reinterpret_cast<uint4*>(ks + r * S::kLdQK + c) = kv;
      *reinterpret_cast<uint4*>(vs + r * S::kLdQK + c) = vv;
    }
    __syncthreads();
    if (k0 > warp_last) continue;  // every key of this tile is after all of this warp's rows

    for (int nt = 0; nt < kKeysPerTile / 16; ++nt) {
      CFrag sf;
      wmma::fill_fragment(sf, 0.0f);
      for (int kk = 0; kk < D / 16; ++kk) {
        KFrag kf;
        wmma::load_matrix_sync(kf, ks + nt * 16 * S::kLdQK + kk * 16, S::kLdQK);
        wmma::mma_sync(sf, qf[kk], kf, sf);
      }
      wmma::store_matrix_sync(sw + nt * 16, sf, S::kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    const float* srow = sw + my_row * S::kLdS + half * 32;
    float s[32];
    float tile_max = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int64_t key = k0 + half * 32 + c;
      s[c] = row_valid && key <= my_pos ? srow[c] * scale_log2 : -INFINITY;
      tile_max = fmaxf(tile_max, s[c]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const bool none = m_new == -INFINITY;  // nothing seen yet (a row past the chunk)
    const float alpha = none ? 1.0f : exp2f(m - m_new);
    float sum = 0.0f;
    __nv_bfloat16* prow = pw + my_row * S::kLdP + half * 32;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const float p = none ? 0.0f : exp2f(s[c] - m_new);
      sum += p;
      prow[c] = __float2bfloat16_rn(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    float* orow = ow + my_row * S::kLdO + half * (D / 2);
    for (int c = 0; c < D / 2; ++c) orow[c] *= alpha;
    __syncwarp();

    AFrag pf[kKeysPerTile / 16];
    for (int kk = 0; kk < kKeysPerTile / 16; ++kk) {
      wmma::load_matrix_sync(pf[kk], pw + kk * 16, S::kLdP);
    }
    for (int dt = 0; dt < D / 16; ++dt) {
      CFrag of;
      wmma::load_matrix_sync(of, ow + dt * 16, S::kLdO, wmma::mem_row_major);
      for (int kk = 0; kk < kKeysPerTile / 16; ++kk) {
        VFrag vf;
        wmma::load_matrix_sync(vf, vs + kk * 16 * S::kLdQK + dt * 16, S::kLdQK);
        wmma::mma_sync(of, pf[kk], vf, of);
      }
      wmma::store_matrix_sync(ow + dt * 16, of, S::kLdO, wmma::mem_row_major);
    }
    __syncwarp();
  }

  if (row_valid) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const float* orow = ow + my_row * S::kLdO + half * (D / 2);
    float* dst = out + ((r0 + warp * 16 + my_row) * num_heads + head) * D + half * (D / 2);
    for (int c = 0; c < D / 2; ++c) dst[c] = orow[c] * inv;
  }
}

template <int D>
cudaError_t LaunchAttention(const LayerPages& pages, const float* q, int64_t first, int64_t rows,
                            int64_t num_heads, float scale, float* out, cudaStream_t stream) {
  constexpr size_t kSmem = Smem<D>::kBytes;
  cudaError_t e = cudaFuncSetAttribute(PrefillAttentionKernel<D>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kSmem));
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                  static_cast<unsigned>(num_heads));
  const int group = static_cast<int>(num_heads / pages.num_kv_heads);
  PrefillAttentionKernel<D><<<grid, kThreads, kSmem, stream>>>(
      pages, q, first, rows, static_cast<int>(num_heads), group,
      scale * 1.4426950408889634f /* log2(e): the softmax runs in base 2 */, out);
  return cudaGetLastError();
}

// One block per (row, KV head); threads over the head's elements.
__global__ void WritePagesKernel(LayerPages p, const float* __restrict__ k,
                                 const float* __restrict__ v, int64_t row_stride, int64_t first) {
  const int64_t i = blockIdx.x, h = blockIdx.y;
  const int64_t token = first + i, d = p.head_dim, pt = p.page_tokens;
  __nv_bfloat16* page = reinterpret_cast<__nv_bfloat16*>(p.base) +
                        (h * p.pages_per_head + token / pt) * 2 * pt * d + (token % pt) * d;
  const float* ki = k + i * row_stride + h * d;
  const float* vi = v + i * row_stride + h * d;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    page[c] = __float2bfloat16_rn(ki[c]);
    page[pt * d + c] = __float2bfloat16_rn(vi[c]);
  }
}

}  // namespace

cudaError_t WriteLayerPages(const LayerPages& pages, const float* k, const float* v,
                            int64_t row_stride, int64_t first, int64_t rows, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (first < 0 || first + rows > pages.pages_per_head * pages.page_tokens) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(pages.num_kv_heads));
  const int threads = pages.head_dim < 128 ? static_cast<int>(pages.head_dim) : 128;
  WritePagesKernel<<<grid, threads, 0, stream>>>(pages, k, v, row_stride, first);
  return cudaGetLastError();
}

cudaError_t CausalPrefillAttention(const LayerPages& pages, const float* q, int64_t first,
                                   int64_t rows, int64_t num_heads, float scale, float* out,
                                   cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (pages.num_kv_heads <= 0 || num_heads % pages.num_kv_heads != 0 || first < 0 ||
      first + rows > pages.pages_per_head * pages.page_tokens) {
    return cudaErrorInvalidValue;
  }
  switch (pages.head_dim) {
    case 32: return LaunchAttention<32>(pages, q, first, rows, num_heads, scale, out, stream);
    case 64: return LaunchAttention<64>(pages, q, first, rows, num_heads, scale, out, stream);
    case 128: return LaunchAttention<128>(pages, q, first, rows, num_heads, scale, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fluxion::kernels::cuda
