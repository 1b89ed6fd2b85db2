// v5 of the paged decode kernel (PagedKernel::kV5): warp-private cp.async rings of 16-row units
// (paged_units.cuh), with the math on the tensor cores.
//
// Why: a CUDA-core version of this kernel read HBM-resident pages at ~3.6 TB/s where cuDNN's
// SDPA reaches ~4.3 (H200), and its math was CUDA-core work per row: a bf16 -> fp32 conversion,
// group FMAs per element for the scores and again for the values, and a shuffle reduction of
// every row's score across 16 lanes (half of the SM's shuffle rate at 4 TB/s). Here a unit is two mma.sync
// products per warp, as in FlashAttention's decode with the GQA group packed into the rows:
//   S (16 x 16) = Q (16 rows: the group's heads, zero past `group`) x K^T (16 keys), K's B
//                 fragments read with ldmatrix from rows padded to head_dim + 8 (no bank
//                 conflicts);
//   O^T (head_dim x 8 heads) += V^T x P^T, V^T's A fragments with ldmatrix.trans and P^T's B
//                 fragments straight from S's accumulators (lane (g, t) holds head g's scores
//                 of keys 2t, 2t+1 (+8): exactly the B layout of head g), so P never touches
//                 shared memory and the output takes head_dim / 4 registers per lane, none of
//                 them padding.
// S's rows 8-15 are always empty (group <= 8), wasted tensor work: the tensor cores still have
// several times the rate a memory-bound step needs.
// Precision: Q and P are split into bf16 hi + lo halves (x = hi + lo to ~2^-16 relative) and
// both products run twice, so the result matches fp32 Q and P to fp32 rounding (the
// tests hold every kernel to the same tolerance); K and V are bf16 already, accumulation fp32.
#include "kernels/cuda/paged_decode_mma.h"

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/paged_units.cuh"

namespace fluxion::kernels::cuda {
namespace {

namespace pu = paged_units;

constexpr int kGroupRows = 8;  // Q rows a lane pair holds (rows g of the mma's 16)

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + D, fp32 accumulators; A's rows 8-15 are zero.
__device__ __forceinline__ void MmaTopRows(float* d, uint32_t a0, uint32_t a2, uint32_t b0,
                                           uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// D = A(16x16 bf16, row) * B(16x8 bf16, col) + D.
__device__ __forceinline__ void Mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t* r, const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(row_address)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t* r, const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddress(row_address)));
}

// (lo, hi) fp32 pair -> bf16 hi halves (round to nearest) and the bf16 of what they miss.
struct SplitPair {
  uint32_t hi, lo;
};
__device__ __forceinline__ SplitPair Split(float x, float y) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  const float2 back = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x - back.x, y - back.y);
  return {*reinterpret_cast<const uint32_t*>(&h), *reinterpret_cast<const uint32_t*>(&l)};
}

template <int kHeadDim, int kPageTokens, int kStages>
struct V5Shape {
  static constexpr int kLd = kHeadDim + 8;  // padded rows: ldmatrix without bank conflicts
  using Loader = pu::UnitLoader<kHeadDim, kPageTokens, kLd>;
  static constexpr int kWarpElems = kStages * Loader::kStageElems;
  static constexpr size_t kSmemBytes = sizeof(uint16_t) * pu::kWarps * kWarpElems;
  static constexpr int kMinBlocksPerSm = kStages >= 3 ? 2 : 3;
  static_assert(sizeof(float) * (2 * kGroupRows + kGroupRows * kHeadDim) <=
                sizeof(uint16_t) * kWarpElems);  // the warp's final state fits its ring
};

// One block of four warps per item; warp w computes units w, w + 4, ...; lane (g = lane / 4,
// t = lane % 4) holds head g's scores for keys 2t, 2t + 1 (+8) of a unit, head g's softmax state,
// and the output of heads 2t, 2t + 1 for dims 16 mt + g (+8). One function on purpose, past the
// house's ~120 lines: the fragments stay in registers across the phases, which inline helpers put
// at risk (the FMA kernel's split made ptxas spill: paged_decode.cu).
template <int kHeadDim, int kPageTokens, int kStages>
__global__ void __launch_bounds__(pu::kThreads,
                                  (V5Shape<kHeadDim, kPageTokens, kStages>::kMinBlocksPerSm))
    PagedDecodeKernelV5(const uint8_t* arena, size_t page_bytes, const PageSpan* spans,
                        const PagedItem* items, int group, float scale_log2) {
  using S = V5Shape<kHeadDim, kPageTokens, kStages>;
  using Loader = typename S::Loader;
  constexpr int kKSteps = kHeadDim / 16, kDimTiles = kHeadDim / 16;
  extern __shared__ uint4 v5_smem[];
  __shared__ uint32_t valid_masks[pu::kWarps][kStages];

  const PagedItem item = items[blockIdx.x];
  if (item.out == nullptr) return;  // a padding item of a device-side plan
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane / 4, t = lane % 4;
  uint16_t* const ring = reinterpret_cast<uint16_t*>(v5_smem) + warp * S::kWarpElems;
  const Loader loader(arena, page_bytes, spans + item.span_begin,
                      item.span_end - item.span_begin);
  const int units = loader.units;
  const bool head_valid = g < group;

  // Q's A fragments (row g = head g), pre-scaled to base 2 and split hi + lo.
  uint32_t q_hi[kKSteps][2], q_lo[kKSteps][2];
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int c = kk * 16 + half * 8 + 2 * t;
      float2 x = make_float2(0.0f, 0.0f);
      if (head_valid) x = *reinterpret_cast<const float2*>(item.q + g * kHeadDim + c);
      const SplitPair p = Split(x.x * scale_log2, x.y * scale_log2);
      q_hi[kk][half] = p.hi;
      q_lo[kk][half] = p.lo;
    }
  }
  float o[kDimTiles][4];  // O^T tile mt: [0], [1] dim 16 mt + g, heads 2t, 2t + 1; [2], [3] dim + 8
#pragma unroll
  for (int n = 0; n < kDimTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m = -INFINITY, l = 0.0f;  // head g's running max (base 2) and this lane's partial sum

  auto issue = [&](int u, int stage, const typename Loader::Spans& us) {
    const uint32_t mask = loader.Issue(u, ring + stage * Loader::kStageElems, us, lane);
    if (lane == 0 && u < units) valid_masks[warp][stage] = mask;
  };

  auto compute = [&](int stage) {
    const uint16_t* ks = ring + stage * Loader::kStageElems;
    const uint16_t* vs = ks + Loader::kMatrixElems;
    const uint32_t mask = valid_masks[warp][stage];
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    // Lanes 0-15 address keys 0-7 (dims +0, +8), lanes 16-31 keys 8-15: b[0..1] are key tile
    // 0's fragments, b[2..3] key tile 1's.
    const uint16_t* krow = ks + ((lane / 16) * 8 + lane % 8) * S::kLd + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t b[4];
      LdMatrixX4(b, krow + kk * 16);
      MmaTopRows(s[0], q_hi[kk][0], q_hi[kk][1], b[0], b[1]);
      MmaTopRows(s[1], q_hi[kk][0], q_hi[kk][1], b[2], b[3]);
      MmaTopRows(s[0], q_lo[kk][0], q_lo[kk][1], b[0], b[1]);
      MmaTopRows(s[1], q_lo[kk][0], q_lo[kk][1], b[2], b[3]);
    }
    // Mask empty slots and padding heads, then the online softmax of row g (its four lanes).
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = n * 8 + 2 * t + e;
        if (!head_valid || ((mask >> key) & 1u) == 0) s[n][e] = -INFINITY;
        mx = fmaxf(mx, s[n][e]);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Every lane goes on to the mma.sync below (it needs the whole warp): a head with nothing
    // valid yet (a padding head always) takes its weights against base 0, all exactly 0.
    const float m_new = fmaxf(m, mx);
    float c = 1.0f;
    if (m_new != m && m_new != -INFINITY) {
      c = exp2f(m - m_new);  // 0 when m was -inf
      l *= c;
      m = m_new;
    }
    // The output of heads 2t, 2t + 1 takes their factors from their quads (lanes 8t, 8t + 4);
    // once the maxima settle most units skip this.
    if (__any_sync(0xffffffffu, c != 1.0f)) {
      const float c0 = __shfl_sync(0xffffffffu, c, 8 * t);
      const float c1 = __shfl_sync(0xffffffffu, c, 8 * t + 4);
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        o[n][0] *= c0;
        o[n][1] *= c1;
        o[n][2] *= c0;
        o[n][3] *= c1;
      }
    }
    const float base = m == -INFINITY ? 0.0f : m;
    float p[2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      p[n][0] = exp2f(s[n][0] - base);  // 0 for a masked slot
      p[n][1] = exp2f(s[n][1] - base);
      l += p[n][0] + p[n][1];
    }
    // P^T's B fragments: keys 2t, 2t + 1 (b0) and 8 + 2t, 9 + 2t (b1) of head g.
    const SplitPair p0 = Split(p[0][0], p[0][1]), p1 = Split(p[1][0], p[1][1]);
    // V^T's A fragments for dims [16 mt, 16 mt + 16): matrix i from the addresses of lanes
    // 8i .. 8i + 7 (keys 0-7 / 8-15, dims +0 / +8), transposed.
    const uint16_t* vrow = vs + ((lane / 16) * 8 + lane % 8) * S::kLd + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int mt = 0; mt < kDimTiles; ++mt) {
      uint32_t a[4];
      LdMatrixX4Trans(a, vrow + mt * 16);
      Mma(o[mt], a, p0.hi, p1.hi);
      Mma(o[mt], a, p0.lo, p1.lo);
    }
  };

  // The ring: unit k of this warp is u = warp + 4k, in stage k % kStages; one commit
  // group per unit (empty past the end) keeps wait_group's count uniform.
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) {
    issue(warp + k * pu::kWarps, k, loader.LoadSpans(warp + k * pu::kWarps));
    pu::CpAsyncCommit();
  }
  typename Loader::Spans next = loader.LoadSpans(warp + (kStages - 1) * pu::kWarps);
  const int my_units = units > warp ? (units - warp + pu::kWarps - 1) / pu::kWarps : 0;
  for (int k = 0; k < my_units; ++k) {
    issue(warp + (k + kStages - 1) * pu::kWarps, (k + kStages - 1) % kStages, next);
    pu::CpAsyncCommit();
    next = loader.LoadSpans(warp + (k + kStages) * pu::kWarps);
    pu::CpAsyncWait<kStages - 1>();  // unit k has landed (this lane's copies)
    __syncwarp();                     // ... and every lane's
    compute(k % kStages);
    __syncwarp();  // the stage is free before the next iteration refills it
  }
  pu::CpAsyncWait<0>();
  __syncwarp();

  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  // Park the warp's state in its (now idle) ring: [8] m, [8] l, [8][kHeadDim] output.
  float* state = reinterpret_cast<float*>(ring);
  float* const out_of_head = state + 2 * kGroupRows;  // [8][kHeadDim]
#pragma unroll
  for (int mt = 0; mt < kDimTiles; ++mt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = 2 * t + (e & 1), d = 16 * mt + g + (e >> 1) * 8;
      if (h < group) out_of_head[h * kHeadDim + d] = o[mt][e];
    }
  }
  if (head_valid && t == 0) {
    state[g] = m;
    state[kGroupRows + g] = l;
  }
  __syncthreads();
  const uint16_t* const rings = reinterpret_cast<const uint16_t*>(v5_smem);
  pu::MergeWarpStates<kGroupRows, kHeadDim>(
      [rings](int w) { return reinterpret_cast<const float*>(rings + w * S::kWarpElems); },
      group, item.out, item.lse);
}

template <int kHeadDim, int kPageTokens, int kStages>
cudaError_t LaunchV5(const PagedLaunch& a) {
  using S = V5Shape<kHeadDim, kPageTokens, kStages>;
  auto* kernel = &PagedDecodeKernelV5<kHeadDim, kPageTokens, kStages>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(S::kSmemBytes));
      e != cudaSuccess) {
    return e;
  }
  kernel<<<a.blocks, pu::kThreads, S::kSmemBytes, a.stream>>>(
      a.arena, a.page_bytes, a.spans, a.items, a.group,
      a.scale * 1.4426950408889634f /* log2(e): the softmax runs in base 2 */);
  return cudaGetLastError();
}

template <int kHeadDim, int kStages>
cudaError_t LaunchV5ForPageTokens(const PagedLaunch& a) {
  switch (a.page_tokens) {
    case 8:
      return LaunchV5<kHeadDim, 8, kStages>(a);
    case 16:
      return LaunchV5<kHeadDim, 16, kStages>(a);
    case 32:
      return LaunchV5<kHeadDim, 32, kStages>(a);
    case 64:
      return LaunchV5<kHeadDim, 64, kStages>(a);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchPagedDecodeV5(const PagedLaunch& a) {
  if (a.group < 1 || a.group > kGroupRows) return cudaErrorInvalidValue;
  switch (a.head_dim) {
    case 64:
      return LaunchV5ForPageTokens<64, 3>(a);
    case 128:
      return LaunchV5ForPageTokens<128, 3>(a);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace fluxion::kernels::cuda
