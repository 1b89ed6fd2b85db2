#include "kernels/cuda/paged_decode.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/paged_decode_mma.h"
#include "kernels/cuda/paged_units.cuh"

namespace fluxion::kernels::cuda {
namespace {

__device__ __forceinline__ void UnpackBf16x8(const uint4& raw, float out[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// One block of 128 threads per item (a chunk of one (request, KV head)), all `group` query heads
// at once so each K/V row is read once. Spans are taken kSlots / kPageTokens at a time; a tile
// has kSlots row slots (slots past a span's rows score -inf and weigh 0).
//   keys:    kLanesPerRow lanes per row, each a 16-byte load of 8 dims (a 128-dim row is one
//            256-byte read by half a warp); every thread issues all its loads of the tile before
//            using any (kKLoads 16-byte loads in flight per thread), then a shuffle reduction
//            per head;
//   softmax: one warp per head folds the tile into the running max and sum (online softmax);
//   values:  thread (row group rg, dim group dg) loads rows rg, rg + kRowGroups, ... of dims
//            [8 dg, 8 dg + 8), again all loads first, and accumulates them for every head; the
//            row groups are summed once at the end.
// Issuing the loads first is what moves the kernel from latency- to bandwidth-bound: with one
// load in flight per thread, an earlier version of this kernel read HBM at ~0.9 TB/s.
template <int kHeadDim, int kPageTokens>
__global__ void __launch_bounds__(128)
    PagedDecodeKernelV3(const uint8_t* arena, size_t page_bytes, const PageSpan* spans,
                      const PagedItem* items, int group, float scale) {
  constexpr int kThreads = 128, kWarps = 4, kVec = 8;
  constexpr int kG = static_cast<int>(kMaxPagedGroup);
  constexpr int kSlots = 128;
  constexpr int kSpansPerTile = kSlots / kPageTokens;
  constexpr int kLanesPerRow = kHeadDim / kVec;  // 16 (d128) or 8 (d64)
  constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  constexpr int kRowGroups = kThreads / kLanesPerRow;
  constexpr int kKLoads = kSlots / (kWarps * kRowsPerWarp);
  constexpr int kVLoads = kSlots / kRowGroups;
  __shared__ float q[kG][kHeadDim];
  __shared__ float w[kG][kSlots];  // scores, then softmax weights
  __shared__ float run_max[kG], run_sum[kG], correction[kG];
  __shared__ const bf16* span_keys[kSpansPerTile];  // K row `first_row` of each span
  __shared__ int span_rows[kSpansPerTile];
  __shared__ float partial[kRowGroups][kHeadDim];

  const PagedItem item = items[blockIdx.x];
  if (item.out == nullptr) return;  // a padding item of a device-side plan
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int dg = tid % kLanesPerRow, rg = tid / kLanesPerRow;
  const int sub = lane / kLanesPerRow;
  for (int i = tid; i < group * kHeadDim; i += kThreads) q[i / kHeadDim][i % kHeadDim] = item.q[i];
  if (tid < group) {
    run_max[tid] = -INFINITY;
    run_sum[tid] = 0.0f;
  }
  float acc[kG][kVec];
#pragma unroll
  for (int h = 0; h < kG; ++h) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[h][j] = 0.0f;
  }
  constexpr int64_t kValueOffset = static_cast<int64_t>(kPageTokens) * kHeadDim;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  for (int s0 = item.span_begin; s0 < item.span_end; s0 += kSpansPerTile) {
    __syncthreads();  // the previous tile is consumed
    if (tid < kSpansPerTile) {
      const int s = s0 + tid;
      if (s < item.span_end) {
        const PageSpan span = spans[s];
        span_keys[tid] =
            reinterpret_cast<const bf16*>(arena + static_cast<size_t>(span.page) * page_bytes) +
            static_cast<int64_t>(span.first_row) * kHeadDim;
        span_rows[tid] = span.rows;
      } else {
        span_rows[tid] = 0;
      }
    }
    __syncthreads();

    uint4 keys[kKLoads];
#pragma unroll
    for (int i = 0; i < kKLoads; ++i) {
      const int slot = warp * kRowsPerWarp + sub + i * kWarps * kRowsPerWarp;
      const int s = slot / kPageTokens, r = slot % kPageTokens;
      keys[i] = r < span_rows[s] ? *reinterpret_cast<const uint4*>(
                                       span_keys[s] + static_cast<int64_t>(r) * kHeadDim +
                                       dg * kVec)
                                 : zero;
    }
#pragma unroll
    for (int i = 0; i < kKLoads; ++i) {
      const int slot = warp * kRowsPerWarp + sub + i * kWarps * kRowsPerWarp;
      const int s = slot / kPageTokens, r = slot % kPageTokens;
      const bool valid = r < span_rows[s];
      float k[kVec];
      UnpackBf16x8(keys[i], k);
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        if (h < group) {
          float v = 0.0f;
#pragma unroll
          for (int j = 0; j < kVec; ++j) v += q[h][dg * kVec + j] * k[j];
#pragma unroll
          for (int offset = kLanesPerRow / 2; offset > 0; offset >>= 1) {
            v += __shfl_xor_sync(0xffffffffu, v, offset);
          }
          if (dg == 0) w[h][slot] = valid ? v * scale : -INFINITY;
        }
      }
    }
    __syncthreads();

    // The value loads do not depend on the softmax: in flight while it runs.
    uint4 values[kVLoads];
#pragma unroll
    for (int i = 0; i < kVLoads; ++i) {
      const int slot = rg + i * kRowGroups;
      const int s = slot / kPageTokens, r = slot % kPageTokens;
      values[i] = r < span_rows[s] ? *reinterpret_cast<const uint4*>(
                                         span_keys[s] + kValueOffset +
                                         static_cast<int64_t>(r) * kHeadDim + dg * kVec)
                                   : zero;
    }
    for (int h = warp; h < group; h += kWarps) {
      float m = -INFINITY;
      for (int i = lane; i < kSlots; i += 32) m = fmaxf(m, w[h][i]);
      for (int offset = 16; offset > 0; offset >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
      }
      const float old_max = run_max[h];
      const float new_max = fmaxf(old_max, m);
      float sum = 0.0f;
      for (int i = lane; i < kSlots; i += 32) {
        const float e = new_max == -INFINITY ? 0.0f : __expf(w[h][i] - new_max);
        w[h][i] = e;
        sum += e;
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      }
      if (lane == 0) {
        const float c = new_max == -INFINITY ? 1.0f : __expf(old_max - new_max);
        correction[h] = c;
        run_sum[h] = run_sum[h] * c + sum;
        run_max[h] = new_max;
      }
    }
    __syncthreads();

#pragma unroll
    for (int h = 0; h < kG; ++h) {
      if (h < group) {
        const float c = correction[h];
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[h][j] *= c;
      }
    }
#pragma unroll
    for (int i = 0; i < kVLoads; ++i) {
      const int slot = rg + i * kRowGroups;
      float v[kVec];
      UnpackBf16x8(values[i], v);  // an invalid slot loaded zeros and weighs 0
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        if (h < group) {
          const float wt = w[h][slot];
#pragma unroll
          for (int j = 0; j < kVec; ++j) acc[h][j] += wt * v[j];
        }
      }
    }
  }

  // Sum the row groups' partial outputs, head by head.
#pragma unroll
  for (int h = 0; h < kG; ++h) {
    if (h >= group) break;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kVec; ++j) partial[rg][dg * kVec + j] = acc[h][j];
    __syncthreads();
    const float l = run_sum[h];
    for (int d = tid; d < kHeadDim; d += kThreads) {
      float total = 0.0f;
#pragma unroll
      for (int g = 0; g < kRowGroups; ++g) total += partial[g][d];
      item.out[h * kHeadDim + d] = l > 0.0f ? total / l : 0.0f;
    }
    if (tid == 0) item.lse[h] = l > 0.0f ? run_max[h] + logf(l) : -INFINITY;
  }
}

// ---- v4: warp-private cp.async pipelines, one instantiation per (head_dim, group, page_tokens).
//
// v3 is latency-bound at 19-25% of HBM bandwidth: 254 registers (one kernel for every group),
// two blocks per SM, and a block-wide __syncthreads between each tile's loads and its math, so a
// block has one tile in flight at a time. v4:
//   - each of the 4 warps of a block owns every 4th "unit" of 16 row slots of the chunk and runs
//     its own online softmax, so no block barrier is crossed until the final merge of the four
//     warp states;
//   - a unit's K and V rows (8 KiB at head_dim 128) go global -> shared with 16-byte cp.async
//     (L1 bypassed), kStages units per warp in a ring: while a warp computes unit k, units
//     k+1 .. k+kStages-1 are in flight (2 blocks x 4 warps x 2 units x 8 KiB = 128 KiB per SM,
//     several times what Little's law asks of HBM3e, and enough for PCIe latency too);
//   - the spans of the unit issued next are read one unit ahead, so the cp.async issue never waits
//     on a dependent span load;
//   - group and head_dim are template parameters (group rounded up to 1, 2, 4 or 8; heads past the
//     real group have q = 0 and are not written), so q and the accumulators stay in registers.
// Unit u of an item covers slots [16u, 16u + 16) of the spans laid end to end with page_tokens
// slots each: slot t is row (t % page_tokens) of span t / page_tokens, valid when that row is
// below the span's `rows`. Invalid slots are zero-filled (never read) and score -inf.
// Lane layout (head_dim 128; 64 halves the lanes per row): lane = (row-in-pass, dim group dg) with
// 16 lanes x 8 dims per row, 2 rows per pass, 8 passes per unit; a lane keeps the scores of its
// rows in registers and uses the same rows for the value pass, so scores never touch memory.
constexpr int kV4Warps = paged_units::kWarps, kV4Threads = paged_units::kThreads,
              kV4UnitRows = paged_units::kUnitRows;

// 8 bf16 (one 16-byte load, taken by value so that it is one 128-bit shared load) to fp32: a
// bf16 is the high half of the fp32 with the same value, so two bit operations per pair.
__device__ __forceinline__ void Bf16x8ToFloat(const uint4 raw, float out[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

using paged_units::CpAsyncCommit;
using paged_units::CpAsyncWait;

// kScatter (PagedKernel::kV4Scatter): the score reduction over a row's lanes is a reduce-scatter
// across heads (a lane halves the heads it carries at each of the first log2(group) shuffle
// steps), so a lane ends with the full score of one head: 5 shuffles + 5 adds per row pass at
// group 4 instead of 16 + 16, and a quarter of the exponentials; the value pass then gathers the
// group's weights of its row with one shuffle per head. HeadOfLane / LaneOfHead give that layout.
template <int kG, int kLanes>
__device__ __forceinline__ int HeadOfLane(int lane) {
  int h = 0;
#pragma unroll
  for (int half = kG / 2, o = kLanes / 2; half > 0; half /= 2, o /= 2) {
    if (lane & o) h += half;
  }
  return h;
}
template <int kG, int kLanes>
__device__ __forceinline__ int LaneOfHead(int h) {
  int lane = 0;
#pragma unroll
  for (int half = kG / 2, o = kLanes / 2; half > 0; half /= 2, o /= 2) {
    if (h & half) lane += o;
  }
  return lane;
}
// v[0..kG) partial dot products of this lane's dims -> the full score of head HeadOfLane(lane)
// over the kLanes lanes of its row (the xor offsets stay inside a row's lanes).
template <int kG, int kLanes>
__device__ __forceinline__ float ReduceScatter(float (&v)[kG], int lane) {
  static_assert(kG <= kLanes, "one head per lane at least");
  int count = kG;
#pragma unroll
  for (int o = kLanes / 2; o > 0; o /= 2) {
    if (count > 1) {
      const int half = count / 2;
      const bool upper = (lane & o) != 0;
#pragma unroll
      for (int i = 0; i < kG / 2; ++i) {
        if (i < half) {
          const float send = upper ? v[i] : v[i + half];
          const float keep = upper ? v[i + half] : v[i];
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
      }
      count = half;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    }
  }
  return v[0];
}

// kStages 3: two units in flight per warp while it computes one, 2 blocks per SM (96 KiB each at
// d128). kStages 2 (PagedKernel::kV4TwoStage): one unit in flight, but 64 KiB and at most 168
// registers at group <= 4, so 3 blocks (12 warps) per SM hide more of the math's latency.
template <int kHeadDim, int kG, int kPageTokens, int kStages>
struct V4Shape {
  static constexpr int kMinBlocksPerSm = kStages >= 3 || kG > 4 ? 2 : 3;
  static constexpr int kLanesPerRow = kHeadDim / 8;         // 16-byte chunks per row
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;     // 2 (d128) or 4 (d64)
  static constexpr int kPasses = kV4UnitRows / kRowsPerPass;  // 8 or 4
  static constexpr int kUnitElems = kV4UnitRows * kHeadDim;  // bf16 per matrix per unit
  static constexpr int kStageElems = 2 * kUnitElems;         // K then V
  static constexpr int kWarpElems = kStages * kStageElems;
  static constexpr size_t kSmemBytes = sizeof(bf16) * kV4Warps * kWarpElems;
  static_assert(static_cast<size_t>(kG) * (kHeadDim + 2) * sizeof(float) <=
                sizeof(bf16) * kWarpElems);  // the warp's final state fits its ring
};

template <int kHeadDim, int kG, int kPageTokens, int kStages, bool kScatter>
__global__ void __launch_bounds__(kV4Threads,
                                  (V4Shape<kHeadDim, kG, kPageTokens, kStages>::kMinBlocksPerSm))
    PagedDecodeKernelV4(const uint8_t* arena, size_t page_bytes, const PageSpan* spans,
                        const PagedItem* items, int group, float scale_log2) {
  using S = V4Shape<kHeadDim, kG, kPageTokens, kStages>;
  extern __shared__ uint4 v4_smem[];
  __shared__ uint32_t valid_masks[kV4Warps][kStages];

  const PagedItem item = items[blockIdx.x];
  if (item.out == nullptr) return;  // a padding item of a device-side plan
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int dg = lane % S::kLanesPerRow, row_in_pass = lane / S::kLanesPerRow;
  bf16* const ring = reinterpret_cast<bf16*>(v4_smem) + warp * S::kWarpElems;
  using Loader = paged_units::UnitLoader<kHeadDim, kPageTokens, kHeadDim>;
  const Loader loader(arena, page_bytes, spans + item.span_begin,
                      item.span_end - item.span_begin);
  const int units = loader.units;

  // q of this lane's 8 dims for every head, pre-scaled so that scores are in base 2.
  float q[kG][8];
#pragma unroll
  for (int h = 0; h < kG; ++h) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      q[h][j] = h < group ? item.q[h * kHeadDim + dg * 8 + j] * scale_log2 : 0.0f;
    }
  }
  float m[kG], l[kG], acc[kG][8];
#pragma unroll
  for (int h = 0; h < kG; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[h][j] = 0.0f;
  }
  // kScatter: this lane's head, its running max and sum over the lane's rows, and the lanes (in
  // this lane's row) holding each head's score.
  const int my_head = HeadOfLane<kG, S::kLanesPerRow>(dg);
  float m_mine = -INFINITY, l_mine = 0.0f;
  const int row_base = row_in_pass * S::kLanesPerRow;

  auto issue = [&](int u, int stage, const typename Loader::Spans& us) {
    const uint32_t mask =
        loader.Issue(u, reinterpret_cast<uint16_t*>(ring + stage * S::kStageElems), us, lane);
    if (lane == 0 && u < units) valid_masks[warp][stage] = mask;
  };

  auto compute = [&](int stage) {
    const bf16* ks = ring + stage * S::kStageElems;
    const bf16* vs = ks + S::kUnitElems;
    const uint32_t mask = valid_masks[warp][stage];
    if constexpr (kScatter) {
      float s[S::kPasses];  // the score (then weight) of head my_head for each of the lane's rows
#pragma unroll
      for (int i = 0; i < S::kPasses; ++i) {
        const int t = i * S::kRowsPerPass + row_in_pass;
        float k[8];
        Bf16x8ToFloat(*reinterpret_cast<const uint4*>(ks + t * kHeadDim + dg * 8), k);
        float v[kG];
#pragma unroll
        for (int h = 0; h < kG; ++h) {
          v[h] = 0.0f;
#pragma unroll
          for (int j = 0; j < 8; ++j) v[h] = fmaf(q[h][j], k[j], v[h]);
        }
        const float score = ReduceScatter<kG, S::kLanesPerRow>(v, dg);
        s[i] = (mask >> t) & 1u ? score : -INFINITY;
      }
      float mx = s[0];
#pragma unroll
      for (int i = 1; i < S::kPasses; ++i) mx = fmaxf(mx, s[i]);
#pragma unroll
      for (int offset = S::kLanesPerRow; offset < 32; offset <<= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
      }
      // Every lane tracks every head's maximum (warp-uniform) for the accumulator rescale.
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        const float head_max =
            __shfl_sync(0xffffffffu, mx, LaneOfHead<kG, S::kLanesPerRow>(h));
        const float m_new = fmaxf(m[h], head_max);
        if (m_new != m[h] && m_new != -INFINITY) {
          const float c = exp2f(m[h] - m_new);  // 0 when m was -inf
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[h][j] *= c;
          m[h] = m_new;
        }
      }
      const float m_new = fmaxf(m_mine, mx);
      if (m_new != -INFINITY) {
        if (m_new != m_mine) {
          l_mine *= exp2f(m_mine - m_new);
          m_mine = m_new;
        }
#pragma unroll
        for (int i = 0; i < S::kPasses; ++i) {
          s[i] = exp2f(s[i] - m_new);  // 0 for an invalid slot
          l_mine += s[i];
        }
      } else {
#pragma unroll
        for (int i = 0; i < S::kPasses; ++i) s[i] = 0.0f;
      }
#pragma unroll
      for (int i = 0; i < S::kPasses; ++i) {
        const int t = i * S::kRowsPerPass + row_in_pass;
        float v[8];
        Bf16x8ToFloat(*reinterpret_cast<const uint4*>(vs + t * kHeadDim + dg * 8), v);
#pragma unroll
        for (int h = 0; h < kG; ++h) {
          const float p =
              __shfl_sync(0xffffffffu, s[i], row_base + LaneOfHead<kG, S::kLanesPerRow>(h));
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[h][j] = fmaf(p, v[j], acc[h][j]);
        }
      }
    } else {
      float s[S::kPasses][kG];
#pragma unroll
      for (int i = 0; i < S::kPasses; ++i) {
        const int t = i * S::kRowsPerPass + row_in_pass;
        float k[8];
        Bf16x8ToFloat(*reinterpret_cast<const uint4*>(ks + t * kHeadDim + dg * 8), k);
        const bool valid = (mask >> t) & 1u;
#pragma unroll
        for (int h = 0; h < kG; ++h) {
          float v = 0.0f;
#pragma unroll
          for (int j = 0; j < 8; ++j) v = fmaf(q[h][j], k[j], v);
#pragma unroll
          for (int offset = S::kLanesPerRow / 2; offset > 0; offset >>= 1) {
            v += __shfl_xor_sync(0xffffffffu, v, offset);
          }
          s[i][h] = valid ? v : -INFINITY;
        }
      }
#pragma unroll
      for (int h = 0; h < kG; ++h) {
        float mx = s[0][h];
#pragma unroll
        for (int i = 1; i < S::kPasses; ++i) mx = fmaxf(mx, s[i][h]);
#pragma unroll
        for (int offset = S::kLanesPerRow; offset < 32; offset <<= 1) {
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
        }
        const float m_new = fmaxf(m[h], mx);
        if (m_new == -INFINITY) {  // nothing valid yet: the state stays empty
#pragma unroll
          for (int i = 0; i < S::kPasses; ++i) s[i][h] = 0.0f;
          continue;
        }
        if (m_new != m[h]) {  // warp-uniform; once the maximum settles most units skip this
          const float c = exp2f(m[h] - m_new);  // 0 when m was -inf
          m[h] = m_new;
          l[h] *= c;
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[h][j] *= c;
        }
#pragma unroll
        for (int i = 0; i < S::kPasses; ++i) {
          const float p = exp2f(s[i][h] - m_new);  // 0 for an invalid slot
          s[i][h] = p;
          l[h] += p;
        }
      }
#pragma unroll
      for (int i = 0; i < S::kPasses; ++i) {
        const int t = i * S::kRowsPerPass + row_in_pass;
        float v[8];
        Bf16x8ToFloat(*reinterpret_cast<const uint4*>(vs + t * kHeadDim + dg * 8), v);
#pragma unroll
        for (int h = 0; h < kG; ++h) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[h][j] = fmaf(s[i][h], v[j], acc[h][j]);
        }
      }
    }
  };

  // The ring: unit k of this warp is u = warp + k * kV4Warps, in stage k % kStages. One commit
  // group per unit (empty past the end) keeps wait_group's count uniform.
  auto unit_of = [warp](int k) { return warp + k * kV4Warps; };
#pragma unroll
  for (int k = 0; k < kStages - 1; ++k) {
    issue(unit_of(k), k, loader.LoadSpans(unit_of(k)));
    CpAsyncCommit();
  }
  typename Loader::Spans next = loader.LoadSpans(unit_of(kStages - 1));
  const int my_units = units > warp ? (units - warp + kV4Warps - 1) / kV4Warps : 0;
  for (int k = 0; k < my_units; ++k) {
    issue(unit_of(k + kStages - 1), (k + kStages - 1) % kStages, next);
    CpAsyncCommit();
    next = loader.LoadSpans(unit_of(k + kStages));
    CpAsyncWait<kStages - 1>();  // unit k has landed (this lane's copies)
    __syncwarp();                  // ... and every lane's
    compute(k % kStages);
    __syncwarp();  // the stage is free before the next iteration refills it
  }
  CpAsyncWait<0>();
  __syncwarp();

  if constexpr (kScatter) {  // every head's sum from a lane of this row holding it
#pragma unroll
    for (int h = 0; h < kG; ++h) {
      l[h] = __shfl_sync(0xffffffffu, l_mine, row_base + LaneOfHead<kG, S::kLanesPerRow>(h));
    }
  }
  // Sum the warp's row groups (lanes with the same dg hold disjoint rows).
#pragma unroll
  for (int h = 0; h < kG; ++h) {
#pragma unroll
    for (int offset = S::kLanesPerRow; offset < 32; offset <<= 1) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], offset);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] += __shfl_xor_sync(0xffffffffu, acc[h][j], offset);
    }
  }
  // Each warp parks its state in its own (now idle) ring: [kG] m, [kG] l, [kG][kHeadDim] acc.
  float* state = reinterpret_cast<float*>(ring);
  if (lane < S::kLanesPerRow) {
#pragma unroll
    for (int h = 0; h < kG; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) state[2 * kG + h * kHeadDim + dg * 8 + j] = acc[h][j];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < kG; ++h) {
      state[h] = m[h];
      state[kG + h] = l[h];
    }
  }
  __syncthreads();
  const bf16* const rings = reinterpret_cast<const bf16*>(v4_smem);
  paged_units::MergeWarpStates<kG, kHeadDim>(
      [rings](int w) { return reinterpret_cast<const float*>(rings + w * S::kWarpElems); },
      group, item.out, item.lse);
}

// The arguments every v4 launch passes through the dispatch below.
struct V4Args {
  unsigned blocks;
  cudaStream_t stream;
  const uint8_t* arena;
  size_t page_bytes;
  const PageSpan* spans;
  const PagedItem* items;
  int group;
  float scale;
};

template <int kHeadDim, int kG, int kPageTokens, int kStages, bool kScatter>
cudaError_t LaunchV4(const V4Args& a) {
  using S = V4Shape<kHeadDim, kG, kPageTokens, kStages>;
  auto* kernel = &PagedDecodeKernelV4<kHeadDim, kG, kPageTokens, kStages, kScatter>;
  // Above 48 KiB of dynamic shared memory must be asked for (per device: so on every launch; it
  // is a host-side attribute write, no stream work).
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(S::kSmemBytes));
      e != cudaSuccess) {
    return e;
  }
  kernel<<<a.blocks, kV4Threads, S::kSmemBytes, a.stream>>>(
      a.arena, a.page_bytes, a.spans, a.items, a.group, a.scale * 1.4426950408889634f);
  return cudaGetLastError();
}

template <int kHeadDim, int kG, int kStages, bool kScatter>
cudaError_t LaunchV4ForPageTokens(int64_t page_tokens, const V4Args& a) {
  switch (page_tokens) {
    case 8:
      return LaunchV4<kHeadDim, kG, 8, kStages, kScatter>(a);
    case 16:
      return LaunchV4<kHeadDim, kG, 16, kStages, kScatter>(a);
    case 32:
      return LaunchV4<kHeadDim, kG, 32, kStages, kScatter>(a);
    case 64:
      return LaunchV4<kHeadDim, kG, 64, kStages, kScatter>(a);
    default:
      return cudaErrorInvalidValue;
  }
}

template <int kHeadDim, int kStages, bool kScatter>
cudaError_t LaunchV4ForGroup(int64_t page_tokens, const V4Args& a) {
  if (a.group == 1) return LaunchV4ForPageTokens<kHeadDim, 1, kStages, kScatter>(page_tokens, a);
  if (a.group == 2) return LaunchV4ForPageTokens<kHeadDim, 2, kStages, kScatter>(page_tokens, a);
  if (a.group <= 4) return LaunchV4ForPageTokens<kHeadDim, 4, kStages, kScatter>(page_tokens, a);
  return LaunchV4ForPageTokens<kHeadDim, 8, kStages, kScatter>(page_tokens, a);
}

template <int kHeadDim>
cudaError_t LaunchV3ForPageTokens(int64_t page_tokens, unsigned blocks, cudaStream_t stream,
                                const uint8_t* arena, size_t page_bytes, const PageSpan* spans,
                                const PagedItem* items, int group, float scale) {
  switch (page_tokens) {
    case 8:
      PagedDecodeKernelV3<kHeadDim, 8><<<blocks, 128, 0, stream>>>(arena, page_bytes, spans, items,
                                                                 group, scale);
      break;
    case 16:
      PagedDecodeKernelV3<kHeadDim, 16><<<blocks, 128, 0, stream>>>(arena, page_bytes, spans,
                                                                  items, group, scale);
      break;
    case 32:
      PagedDecodeKernelV3<kHeadDim, 32><<<blocks, 128, 0, stream>>>(arena, page_bytes, spans,
                                                                  items, group, scale);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t PagedDecodeAttention(const uint8_t* arena, size_t page_bytes, int64_t page_tokens,
                                 int64_t head_dim, const PageSpan* spans, const PagedItem* items,
                                 int64_t num_items, int64_t group, float scale,
                                 cudaStream_t stream, PagedKernel kernel) {
  if (num_items == 0) return cudaSuccess;
  // 16-byte aligned pages and arena: every row is read with 16-byte loads.
  const bool page_tokens_ok =
      kernel == PagedKernel::kV3
          ? (page_tokens == 8 || page_tokens == 16 || page_tokens == 32)
          : (page_tokens == 8 || page_tokens == 16 || page_tokens == 32 || page_tokens == 64);
  if (group < 1 || group > kMaxPagedGroup || num_items > 2147483647 || !page_tokens_ok ||
      page_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(arena) % 16 != 0 ||
      page_bytes < static_cast<size_t>(2 * page_tokens * head_dim * sizeof(bf16))) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks = static_cast<unsigned>(num_items);
  const int g = static_cast<int>(group);
  if (kernel == PagedKernel::kV5 || kernel == PagedKernel::kV5TwoStage) {
    return LaunchPagedDecodeV5({blocks, stream, arena, page_bytes, page_tokens, head_dim, spans,
                                items, g, scale},
                               kernel == PagedKernel::kV5TwoStage ? 2 : 3);
  }
  if (kernel != PagedKernel::kV3) {
    const V4Args args{blocks, stream, arena, page_bytes, spans, items, g, scale};
    switch (head_dim) {
      case 64:  // the variants are instantiated for head_dim 128 only; 64 runs kV4
        return LaunchV4ForGroup<64, 3, false>(page_tokens, args);
      case 128:
        switch (kernel) {
          case PagedKernel::kV4TwoStage:
            return LaunchV4ForGroup<128, 2, false>(page_tokens, args);
          case PagedKernel::kV4Scatter:
            return LaunchV4ForGroup<128, 3, true>(page_tokens, args);
          default:
            return LaunchV4ForGroup<128, 3, false>(page_tokens, args);
        }
      default:
        return cudaErrorInvalidValue;
    }
  }
  switch (head_dim) {
    case 64:
      return LaunchV3ForPageTokens<64>(page_tokens, blocks, stream, arena, page_bytes, spans,
                                       items, g, scale);
    case 128:
      return LaunchV3ForPageTokens<128>(page_tokens, blocks, stream, arena, page_bytes, spans,
                                        items, g, scale);
    default:
      return cudaErrorInvalidValue;
  }
}

const char* PagedKernelName(PagedKernel kernel) {
  switch (kernel) {
    case PagedKernel::kV3:
      return "v3";
    case PagedKernel::kV4:
      return "v4";
    case PagedKernel::kV4TwoStage:
      return "v4s2";
    case PagedKernel::kV4Scatter:
      return "v4t";
    case PagedKernel::kV5:
      return "v5";
    case PagedKernel::kV5TwoStage:
      return "v5s2";
  }
  return "unknown";
}

bool PagedKernelFromName(const std::string& name, PagedKernel* kernel) {
  for (PagedKernel k : {PagedKernel::kV3, PagedKernel::kV4, PagedKernel::kV4TwoStage,
                        PagedKernel::kV4Scatter, PagedKernel::kV5, PagedKernel::kV5TwoStage}) {
    if (name == PagedKernelName(k)) {
      *kernel = k;
      return true;
    }
  }
  return false;
}

int PagedBlocksPerSm(PagedKernel kernel) {
  switch (kernel) {
    case PagedKernel::kV3:
      return 4;
    case PagedKernel::kV4:
      return 2;
    case PagedKernel::kV4TwoStage:
      return 3;
    case PagedKernel::kV4Scatter:
      return 2;
    case PagedKernel::kV5:
      return 2;
    case PagedKernel::kV5TwoStage:
      return 3;
  }
  return 2;
}

int64_t ChoosePagedChunkRows(PagedKernel kernel, int64_t total_rows, int64_t items,
                             int num_sms) {
  if (kernel == PagedKernel::kV3) return ChooseChunkRows(total_rows, num_sms);
  // One wave of v4 blocks: each item gets floor(slots / items) chunks (at least one), so the grid
  // fills the GPU once with equal chunks and leaves no tail wave.
  const int64_t slots = PagedBlocksPerSm(kernel) * static_cast<int64_t>(std::max(1, num_sms));
  const int64_t n = std::max<int64_t>(1, items);
  const int64_t per_item = std::max<int64_t>(1, slots / n);
  const int64_t rows_per_item = (std::max<int64_t>(0, total_rows) + n - 1) / n;
  const int64_t rows = (rows_per_item + per_item - 1) / per_item;
  return std::max<int64_t>(kMinV4ChunkRows, (rows + 15) / 16 * 16);
}

int64_t ChooseChunkRows(int64_t total_rows, int num_sms) {
  const int64_t target_blocks = 4 * static_cast<int64_t>(std::max(1, num_sms));
  const int64_t rows = (total_rows + target_blocks - 1) / target_blocks;
  return std::clamp<int64_t>((rows + 127) / 128 * 128, 128, 8192);
}

std::vector<int32_t> SplitByRows(const PageSpan* spans, int32_t begin, int32_t end,
                                 int64_t max_rows) {
  std::vector<int32_t> bounds = {begin};
  int64_t rows = 0;
  for (int32_t s = begin; s < end; ++s) {
    if (rows > 0 && rows + spans[s].rows > max_rows) {
      bounds.push_back(s);
      rows = 0;
    }
    rows += spans[s].rows;
  }
  if (end > begin) bounds.push_back(end);
  return bounds;
}

}  // namespace fluxion::kernels::cuda
