#include "kernels/cuda/prefill_attention.h"

#include <cuda_bf16.h>

#include <cmath>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerBlock = kWarps * 16;  // each warp owns 16 query rows
constexpr int kKeysPerTile = 64;

// K and V tiles in shared memory, double-buffered: [stage][key][head_dim + 8] bf16. The 8-element
// pad puts consecutive rows 4 banks apart, so the 32-bit K reads (lane = 4 * row + word) and the
// ldmatrix reads of V (8 rows of 16 bytes per phase) are free of bank conflicts.
template <int D>
struct Tiles {
  static constexpr int kLd = D + 8;
  static constexpr size_t kTile = size_t{kKeysPerTile} * kLd;  // elements
  static constexpr size_t kBytes = 2 /*stages*/ * 2 /*K, V*/ * kTile * sizeof(__nv_bfloat16);
};

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; src_bytes 0 fills zeros (keys past the end).
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddress(dst)),
               "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CommitAsync() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void WaitAsync() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + D, fp32 accumulators.
__device__ __forceinline__ void Mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory (K's B fragments: its rows are the keys).
__device__ __forceinline__ void LdMatrixX4(uint32_t* r, const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(row_address)));
}

// Four 8x8 b16 matrices from shared memory, transposed (V's B fragments for two dim tiles).
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t* r, const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(row_address)));
}

// Issues the loads of key tile `k0` (K and V, every row whose key < kv_end; zeros after).
template <int D>
__device__ __forceinline__ void LoadTile(__nv_bfloat16* k_tile, __nv_bfloat16* v_tile,
                                         const __nv_bfloat16* head_pages, int64_t pt, int64_t k0,
                                         int64_t kv_end) {
  constexpr int kVecPerRow = D / 8;
  for (int i = threadIdx.x; i < kKeysPerTile * kVecPerRow; i += kThreads) {
    const int r = i / kVecPerRow, c = (i % kVecPerRow) * 8;
    const int64_t key = k0 + r;
    const bool ok = key < kv_end;
    const __nv_bfloat16* page =
        head_pages + (ok ? (key / pt) * 2 * pt * D + (key % pt) * D + c : 0);
    CopyAsync16(k_tile + r * Tiles<D>::kLd + c, page, ok ? 16 : 0);
    CopyAsync16(v_tile + r * Tiles<D>::kLd + c, page + pt * D, ok ? 16 : 0);
  }
}

// FlashAttention-2's forward on mma.sync: one block per (64 query rows, query head), each warp
// 16 rows whose Q fragments, scores, probabilities and output stay in registers (the scores'
// accumulator layout is the next product's A layout, so P never touches shared memory); K/V tiles
// of 64 keys stream through shared memory with cp.async, the next tile loading while this one is
// used. Thread (g = lane / 4, t = lane % 4) holds rows g and g + 8 of its warp's 16. One function
// on purpose, past the house's ~120 lines: the fragments stay in registers across the phases,
// which inline helpers put at risk (the decode FMA kernel's split made ptxas spill:
// paged_decode.cu).
template <int D>
__global__ void __launch_bounds__(kThreads, 2)
    PrefillAttentionKernel(LayerPages pages, const float* __restrict__ q, int64_t first,
                           int64_t rows, int num_heads, int group, float scale_log2,
                           float* __restrict__ out) {
  using T = Tiles<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* tiles = reinterpret_cast<__nv_bfloat16*>(smem);
  auto k_tile = [&](int stage) { return tiles + (2 * stage) * T::kTile; };
  auto v_tile = [&](int stage) { return tiles + (2 * stage + 1) * T::kTile; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock;
  const int head = blockIdx.y;
  const int64_t block_rows = rows - r0 < kRowsPerBlock ? rows - r0 : kRowsPerBlock;
  const int64_t kv_end = first + r0 + block_rows;
  const int64_t pt = pages.page_tokens;
  const __nv_bfloat16* head_pages = reinterpret_cast<const __nv_bfloat16*>(pages.base) +
                                    (head / group) * pages.pages_per_head * 2 * pt * D;
  LoadTile<D>(k_tile(0), v_tile(0), head_pages, pt, 0, kv_end);
  CommitAsync();

  // Q fragments (A layout), rounded to bf16: rows g, g + 8 of the warp; dims 2t, 2t+1 (+8).
  const int64_t wrow = r0 + warp * 16;  // the warp's first row in the chunk
  const int64_t row_a = wrow + g, row_b = wrow + g + 8;
  uint32_t qf[D / 16][4];
  for (int kk = 0; kk < D / 16; ++kk) {
    for (int half = 0; half < 2; ++half) {
      const int c = kk * 16 + half * 8 + 2 * t;
      float2 a = make_float2(0, 0), b = make_float2(0, 0);
      if (row_a < rows) a = *reinterpret_cast<const float2*>(q + (row_a * num_heads + head) * D + c);
      if (row_b < rows) b = *reinterpret_cast<const float2*>(q + (row_b * num_heads + head) * D + c);
      qf[kk][half * 2] = PackBf16(a.x, a.y);
      qf[kk][half * 2 + 1] = PackBf16(b.x, b.y);
    }
  }
  const int64_t pos_a = first + row_a, pos_b = first + row_b;
  const int64_t warp_last = first + wrow + 15;
  float o[D / 8][4];
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

  int stage = 0;
  for (int64_t k0 = 0; k0 < kv_end; k0 += kKeysPerTile, stage ^= 1) {
    if (k0 + kKeysPerTile < kv_end) {  // the next tile loads while this one is used
      LoadTile<D>(k_tile(stage ^ 1), v_tile(stage ^ 1), head_pages, pt, k0 + kKeysPerTile, kv_end);
      CommitAsync();
      WaitAsync<1>();
    } else {
      WaitAsync<0>();
    }
    __syncthreads();
    if (k0 <= warp_last) {  // else every key of the tile is after all of this warp's rows
      const __nv_bfloat16* kt = k_tile(stage);
      float s[kKeysPerTile / 8][4];
      // K's B fragments for two key tiles per ldmatrix.x4 (one instruction instead of eight
      // 32-bit loads): lanes 0-15 address tile n's 8 keys (dims +0, +8), lanes 16-31 tile n + 1's.
      const __nv_bfloat16* krow =
          kt + ((lane / 16) * 8 + lane % 8) * T::kLd + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int n = 0; n < kKeysPerTile / 8; n += 2) {
        s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        s[n + 1][0] = s[n + 1][1] = s[n + 1][2] = s[n + 1][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t b[4];
          LdMatrixX4(b, krow + n * 8 * T::kLd + kk * 16);
          Mma16816(s[n], qf[kk], b[0], b[1]);
          Mma16816(s[n + 1], qf[kk], b[2], b[3]);
        }
      }
      // Scale, mask past each row's position, and the online softmax's running max.
      const bool diagonal = k0 + kKeysPerTile - 1 > first + wrow;
      float tile_a = -INFINITY, tile_b = -INFINITY;
#pragma unroll
      for (int n = 0; n < kKeysPerTile / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t key = k0 + n * 8 + 2 * t + e;
          float a = s[n][e] * scale_log2, b = s[n][2 + e] * scale_log2;
          if (diagonal || key >= kv_end) {
            if (key > pos_a || row_a >= rows) a = -INFINITY;
            if (key > pos_b || row_b >= rows) b = -INFINITY;
          }
          s[n][e] = a;
          s[n][2 + e] = b;
          tile_a = fmaxf(tile_a, a);
          tile_b = fmaxf(tile_b, b);
        }
      }
      for (int x = 1; x <= 2; x *= 2) {
        tile_a = fmaxf(tile_a, __shfl_xor_sync(0xffffffffu, tile_a, x));
        tile_b = fmaxf(tile_b, __shfl_xor_sync(0xffffffffu, tile_b, x));
      }
      const float new_a = fmaxf(m_a, tile_a), new_b = fmaxf(m_b, tile_b);
      // A row that has seen nothing yet (past the chunk's end) keeps zeros.
      const float base_a = new_a == -INFINITY ? 0.0f : new_a;
      const float base_b = new_b == -INFINITY ? 0.0f : new_b;
      const float alpha_a = exp2f(m_a - base_a), alpha_b = exp2f(m_b - base_b);
      m_a = new_a;
      m_b = new_b;
      float sum_a = 0.0f, sum_b = 0.0f;
      uint32_t p[kKeysPerTile / 16][4];  // A fragments of P, 16 keys each
#pragma unroll
      for (int n = 0; n < kKeysPerTile / 8; ++n) {
        const float p0 = exp2f(s[n][0] - base_a), p1 = exp2f(s[n][1] - base_a);
        const float p2 = exp2f(s[n][2] - base_b), p3 = exp2f(s[n][3] - base_b);
        sum_a += p0 + p1;
        sum_b += p2 + p3;
        p[n / 2][(n % 2) * 2] = PackBf16(p0, p1);
        p[n / 2][(n % 2) * 2 + 1] = PackBf16(p2, p3);
      }
      l_a = l_a * alpha_a + sum_a;  // per-thread partial sums; the row's four threads add up last
      l_b = l_b * alpha_b + sum_b;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][0] *= alpha_a;
        o[n][1] *= alpha_a;
        o[n][2] *= alpha_b;
        o[n][3] *= alpha_b;
      }
      const __nv_bfloat16* vt = v_tile(stage);
#pragma unroll
      for (int kc = 0; kc < kKeysPerTile / 16; ++kc) {
        const __nv_bfloat16* vrow = vt + (kc * 16 + (lane % 16)) * T::kLd + (lane / 16) * 8;
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
          uint32_t b[4];
          LdMatrixX4Trans(b, vrow + n * 8);
          Mma16816(o[n], p[kc], b[0], b[1]);
          Mma16816(o[n + 1], p[kc], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is loaded again
  }

  for (int x = 1; x <= 2; x *= 2) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, x);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, x);
  }
  const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
  for (int n = 0; n < D / 8; ++n) {
    const int c = n * 8 + 2 * t;
    if (row_a < rows) {
      *reinterpret_cast<float2*>(out + (row_a * num_heads + head) * D + c) =
          make_float2(o[n][0] * inv_a, o[n][1] * inv_a);
    }
    if (row_b < rows) {
      *reinterpret_cast<float2*>(out + (row_b * num_heads + head) * D + c) =
          make_float2(o[n][2] * inv_b, o[n][3] * inv_b);
    }
  }
}

template <int D>
cudaError_t LaunchAttention(const LayerPages& pages, const float* q, int64_t first, int64_t rows,
                            int64_t num_heads, float scale, float* out, cudaStream_t stream) {
  constexpr size_t kSmem = Tiles<D>::kBytes;
  cudaError_t e = cudaFuncSetAttribute(PrefillAttentionKernel<D>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kSmem));
  if (e != cudaSuccess) return e;
  // Blocks of the latest rows first: they have the most keys, and the short ones fill in after.
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
