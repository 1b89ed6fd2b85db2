#include "kernels/cuda/compact_select.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

namespace fluxion::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// Append.

constexpr int kAppendThreads = 256;
constexpr int kAppendWarps = kAppendThreads / 32;

// The value the host pages store for x.
__device__ __forceinline__ float StoredKey(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// One warp per (row, KV head): the largest magnitude by a warp reduction (max is exact in any
// order), then every value quantized with it.
__global__ void __launch_bounds__(kAppendThreads)
    CompactAppendKernel(CompactKeysLayout layout, int layer, const float* k, const int32_t* slots,
                        const int64_t* positions, int64_t rows) {
  const int lane = threadIdx.x & 31;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kAppendWarps + (threadIdx.x >> 5);
  if (unit >= rows * layout.num_kv_heads) return;
  const int64_t i = unit / layout.num_kv_heads, h = unit % layout.num_kv_heads;
  const int64_t slot = slots[i], pos = positions[i];
  if (slot < 0 || pos < 0 || pos >= layout.max_tokens) return;
  const int64_t d_count = layout.head_dim;
  const float* src = k + unit * d_count;
  float absmax = 0.0f;
  for (int64_t d = lane; d < d_count; d += 32) absmax = fmaxf(absmax, fabsf(StoredKey(src[d])));
  for (int o = 16; o > 0; o >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, o));
  const float inverse = CompactInverse(absmax);
  const int64_t row = layout.RowOffset(slot, layer, h) + pos;
  int8_t* dst = layout.values + row * d_count;
  for (int64_t d = lane; d < d_count; d += 32) dst[d] = CompactValue(StoredKey(src[d]), inverse);
  if (lane == 0) layout.scales[row] = CompactScale(absmax);
}

// ---------------------------------------------------------------------------------------------
// Scoring: every row of a pair's span, into its scratch scores.

constexpr int kMaxGroup = 8;
constexpr int kScoreWarps = 8;
constexpr int kScoreThreads = 32 * kScoreWarps;
constexpr int kUnroll = 4;         // rows a lane has in flight
constexpr int kStepsPerBlock = 8;  // unrolled steps a block makes over its chunk

// A lane reads 16 bytes of a row (one vector load), so head_dim / 16 adjacent lanes hold a row
// and a warp reads 512 contiguous bytes per load.
template <int kHeadDim>
struct ScoreShape {
  static constexpr int kLanesPerRow = kHeadDim / 16;
  static constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  static constexpr int kRowsPerLoad = kScoreWarps * kRowsPerWarp;  // one load of every lane
  static constexpr int kRowsPerStep = kRowsPerLoad * kUnroll;
  static constexpr int kTokensPerBlock = kRowsPerStep * kStepsPerBlock;
};

struct ScoreArgs {
  CompactKeysLayout layout;
  int layer;
  const float* q;
  int64_t num_heads;
  const int32_t* slots;
  const CompactPick* picks;
  const uint64_t* masks;
  int64_t max_span;
  float* scores;
};

// Whether pair p of a row in `slot` selects anything (compact_select.h's conditions).
__device__ __forceinline__ bool Selects(const CompactPick& p, int32_t slot, int64_t max_span) {
  return slot >= 0 && p.k > 0 && p.begin < p.end &&
         static_cast<int64_t>(p.end) - p.begin <= max_span;
}

// The group's query heads (q_group: [kGroup][kHeadDim]) quantized into shared memory, one warp per
// head.
template <int kHeadDim, int kGroup>
__device__ void QuantizeGroup(const float* q_group, int8_t* values, float* scales) {
  constexpr int kPerLane = kHeadDim / 32;
  const int lane = threadIdx.x & 31, g = threadIdx.x >> 5;
  if (g >= kGroup) return;
  float v[kPerLane];
  float absmax = 0.0f;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    v[e] = q_group[g * kHeadDim + lane + 32 * e];
    absmax = fmaxf(absmax, fabsf(v[e]));
  }
  for (int o = 16; o > 0; o >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, o));
  const float inverse = CompactInverse(absmax);
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) {
    values[g * kHeadDim + lane + 32 * e] = CompactValue(v[e], inverse);
  }
  if (lane == 0) scales[g] = CompactScale(absmax);
}

// 16 int8 products summed exactly.
__device__ __forceinline__ int Dot16(const int4& a, const int4& b) {
  int d = __dp4a(a.x, b.x, 0);
  d = __dp4a(a.y, b.y, d);
  d = __dp4a(a.z, b.z, d);
  return __dp4a(a.w, b.w, d);
}

// The sum over a row's kLanes adjacent lanes, in every one of them (integer: exact in any order).
template <int kLanes>
__device__ __forceinline__ int SumOverRow(int v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// grid (chunks of kTokensPerBlock rows, KV heads, rows). Each block quantizes the group's queries
// (a few KB from L2), keeps this lane's 16 bytes of each in registers, then streams its chunk of
// compact rows, kUnroll loads in flight per lane. Pairs that take their whole span (k >= span)
// need no scores and are not read.
template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kScoreThreads) CompactScoreKernel(ScoreArgs a) {
  using Shape = ScoreShape<kHeadDim>;
  constexpr int kLanes = Shape::kLanesPerRow;
  const int64_t i = blockIdx.z, h = blockIdx.y;
  const int64_t pair = i * a.layout.num_kv_heads + h;
  const CompactPick p = a.picks[pair];
  const int32_t slot = a.slots[i];
  if (!Selects(p, slot, a.max_span)) return;
  const int64_t n = static_cast<int64_t>(p.end) - p.begin;
  if (p.k >= n) return;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * Shape::kTokensPerBlock;
  if (first >= n) return;
  const int64_t stop = min(n, first + Shape::kTokensPerBlock);

  __shared__ __align__(16) int8_t q_values[kGroup * kHeadDim];
  __shared__ float q_scales[kGroup];
  QuantizeGroup<kHeadDim, kGroup>(a.q + (i * a.num_heads + h * kGroup) * kHeadDim, q_values,
                                  q_scales);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = lane % kLanes;  // which 16 bytes of its row this lane reads
  int4 qw[kGroup];
  float qs[kGroup];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    qw[g] = reinterpret_cast<const int4*>(q_values + g * kHeadDim)[part];
    qs[g] = q_scales[g];
  }

  const int64_t row0 = a.layout.RowOffset(slot, a.layer, h) + p.begin;
  const int4* keys = reinterpret_cast<const int4*>(a.layout.values + row0 * kHeadDim);
  const float* key_scales = a.layout.scales + row0;
  float* out = a.scores + pair * a.max_span;
  const int row_in_load = warp * Shape::kRowsPerWarp + lane / kLanes;
  for (int64_t base = first; base < stop; base += Shape::kRowsPerStep) {
    int4 kv[kUnroll];
    float ks[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + u * Shape::kRowsPerLoad + row_in_load;
      if (t < stop) {
        kv[u] = __ldcs(keys + t * kLanes + part);  // read once: don't keep it in the caches
        ks[u] = __ldcs(key_scales + t);
      } else {
        kv[u] = make_int4(0, 0, 0, 0);
        ks[u] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // std::max over the group in its order, as kernels::cpu::CompactGroupScore.
      float best = -INFINITY;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const float s = CompactScore(SumOverRow<kLanes>(Dot16(qw[g], kv[u])), qs[g], ks[u]);
        best = best < s ? s : best;
      }
      const int64_t t = base + u * Shape::kRowsPerLoad + row_in_load;
      if (part == 0 && t < stop) out[t] = CompactCandidate(p, a.masks, t) ? best : -INFINITY;
    }
  }
}

template <int kHeadDim, int kGroup>
void LaunchScores(const ScoreArgs& a, int64_t rows, cudaStream_t stream) {
  constexpr int64_t kChunk = ScoreShape<kHeadDim>::kTokensPerBlock;
  const dim3 grid(static_cast<unsigned>((a.max_span + kChunk - 1) / kChunk),
                  static_cast<unsigned>(a.layout.num_kv_heads), static_cast<unsigned>(rows));
  CompactScoreKernel<kHeadDim, kGroup><<<grid, kScoreThreads, 0, stream>>>(a);
}

template <int kHeadDim>
void LaunchScoresForGroup(int64_t group, const ScoreArgs& a, int64_t rows, cudaStream_t stream) {
  switch (group) {
    case 1:
      return LaunchScores<kHeadDim, 1>(a, rows, stream);
    case 2:
      return LaunchScores<kHeadDim, 2>(a, rows, stream);
    case 3:
      return LaunchScores<kHeadDim, 3>(a, rows, stream);
    case 4:
      return LaunchScores<kHeadDim, 4>(a, rows, stream);
    case 5:
      return LaunchScores<kHeadDim, 5>(a, rows, stream);
    case 6:
      return LaunchScores<kHeadDim, 6>(a, rows, stream);
    case 7:
      return LaunchScores<kHeadDim, 7>(a, rows, stream);
    default:
      return LaunchScores<kHeadDim, 8>(a, rows, stream);
  }
}

// ---------------------------------------------------------------------------------------------
// Selection: the k best of a pair's scores.

constexpr int kSelectThreads = 1024;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kBins / kSelectThreads;
constexpr int kCacheKeys = 8192;  // candidate keys kept in shared memory
constexpr int kPerThread = 8;     // consecutive scores a thread compacts per tile
constexpr int kTile = kSelectThreads * kPerThread;
static_assert(kTile < (1 << 16), "a tile's counts are packed in 16 bits");

// kernels/cpu/topk.cc's order-preserving image of a float (NaN lowest), with -0.0 taken as +0.0:
// they are equal scores, so they tie (lower position first) as float comparison has it. The
// device's product of a negative dot and a scale product that underflowed is -0.0 where the CPU's
// compiled CompactGroupScore may give +0.0 (GCC 12 -O3 compiles that product as an FMA adding
// +0.0).
__device__ __forceinline__ uint32_t SortableKey(float f) {
  const uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);
  const uint32_t flip = static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? 0u : (u ^ flip);
}

__device__ __forceinline__ int BitWidth(uint32_t v) { return v == 0 ? 0 : 32 - __clz(v); }

struct MinOp {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a < b ? a : b; }
};
struct MaxOp {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
};

// Calls f(j, key) for every score j < n, coalesced (float4 loads where s allows them).
template <typename F>
__device__ __forceinline__ void ForEachScore(const float* s, int n, F&& f) {
  int j0 = 0;
  if ((reinterpret_cast<uintptr_t>(s) & 15) == 0) {
    const int vecs = n / 4;
    for (int v = threadIdx.x; v < vecs; v += kSelectThreads) {
      const float4 x = reinterpret_cast<const float4*>(s)[v];
      f(4 * v, SortableKey(x.x));
      f(4 * v + 1, SortableKey(x.y));
      f(4 * v + 2, SortableKey(x.z));
      f(4 * v + 3, SortableKey(x.w));
    }
    j0 = 4 * vecs;
  }
  for (int j = j0 + threadIdx.x; j < n; j += kSelectThreads) f(j, SortableKey(s[j]));
}

// Loads the keys of scores [j0, j0 + kPerThread) ∩ [0, n) from `cache` (every key, in order) or
// from s; returns how many there are.
__device__ __forceinline__ int LoadTileKeys(const float* s, const uint32_t* cache, int n, int j0,
                                            uint32_t* keys) {
  const int count = max(0, min(kPerThread, n - j0));
  if (count == kPerThread && cache != nullptr) {
#pragma unroll
    for (int v = 0; v < kPerThread / 4; ++v) {
      const uint4 x = reinterpret_cast<const uint4*>(cache + j0)[v];
      keys[4 * v] = x.x;
      keys[4 * v + 1] = x.y;
      keys[4 * v + 2] = x.z;
      keys[4 * v + 3] = x.w;
    }
  } else if (count == kPerThread && (reinterpret_cast<uintptr_t>(s + j0) & 15) == 0) {
#pragma unroll
    for (int v = 0; v < kPerThread / 4; ++v) {
      const float4 x = reinterpret_cast<const float4*>(s + j0)[v];
      keys[4 * v] = SortableKey(x.x);
      keys[4 * v + 1] = SortableKey(x.y);
      keys[4 * v + 2] = SortableKey(x.z);
      keys[4 * v + 3] = SortableKey(x.w);
    }
  } else {
    for (int e = 0; e < count; ++e) {
      keys[e] = cache != nullptr ? cache[j0 + e] : SortableKey(s[j0 + e]);
    }
  }
  return count;
}

using SelectReduce = cub::BlockReduce<uint32_t, kSelectThreads>;
using SelectScan = cub::BlockScan<uint32_t, kSelectThreads>;

// CompactSelectKernel's shared memory: the block's reduce/scan storage, the histogram, the cached
// candidate keys, and the narrowing's state: candidates are the keys in [lo, hi], `need` of them
// still to take, `bin_count` of them in all; `fill` counts keys collected into the cache.
struct SelectShared {
  union {
    typename SelectReduce::TempStorage reduce;
    typename SelectScan::TempStorage scan;
  } temp;
  uint32_t hist[kBins];
  alignas(16) uint32_t cache[kCacheKeys];
  uint32_t lo, hi;
  int need, bin_count, fill;
};

// The key range of the n scores into sh.lo / sh.hi (every key cached in position order when the
// span fits the cache), with need = k and bin_count = n.
__device__ __forceinline__ void KeyRange(const float* s, int n, int k, bool all_cached,
                                         SelectShared& sh) {
  uint32_t lo = ~0u, hi = 0;
  ForEachScore(s, n, [&](int j, uint32_t key) {
    lo = min(lo, key);
    hi = max(hi, key);
    if (all_cached) sh.cache[j] = key;
  });
  lo = SelectReduce(sh.temp.reduce).Reduce(lo, MinOp());
  __syncthreads();
  hi = SelectReduce(sh.temp.reduce).Reduce(hi, MaxOp());
  if (threadIdx.x == 0) {
    sh.lo = lo;
    sh.hi = hi;
    sh.need = k;
    sh.bin_count = n;
    sh.fill = 0;
  }
  __syncthreads();
}

// Narrows [sh.lo, sh.hi] by histogram passes until every candidate is taken or they all share
// one key; `cached`: keys in the cache (a superset of the candidates), or -1 (read the scores).
__device__ __forceinline__ void NarrowToThreshold(const float* s, int n, int cached,
                                                  SelectShared& sh) {
  const int tid = threadIdx.x;
  while (sh.lo != sh.hi && sh.bin_count != sh.need) {
    const uint32_t lo = sh.lo, hi = sh.hi;
    const int need = sh.need, count = sh.bin_count;
    const int shift = max(BitWidth(hi - lo) - kDigitBits, 0);
    const bool collect = cached < 0 && count <= kCacheKeys;
    for (int b = tid; b < kBins; b += kSelectThreads) sh.hist[b] = 0;
    __syncthreads();
    auto visit = [&](uint32_t key) {
      if (key < lo || key > hi) return;
      atomicAdd(&sh.hist[(key - lo) >> shift], 1u);
      if (collect) sh.cache[atomicAdd(&sh.fill, 1)] = key;
    };
    if (cached >= 0) {
      for (int j = tid; j < cached; j += kSelectThreads) visit(sh.cache[j]);
    } else {
      ForEachScore(s, n, [&](int, uint32_t key) { visit(key); });
    }
    __syncthreads();
    if (collect) cached = count;
    // Thread t sums bins [kBins - (t + 1) * kBinsPerThread, kBins - t * kBinsPerThread), so an
    // exclusive scan gives the candidates above its bins.
    const int top_bin = kBins - 1 - tid * kBinsPerThread;
    uint32_t mine = 0;
    for (int b = 0; b < kBinsPerThread; ++b) mine += sh.hist[top_bin - b];
    uint32_t above;
    SelectScan(sh.temp.scan).ExclusiveSum(mine, above);
    if (static_cast<int>(above) < need && static_cast<int>(above + mine) >= need) {
      int acc = static_cast<int>(above);
      for (int b = 0; b < kBinsPerThread; ++b) {
        const int bin = top_bin - b;
        const int c = static_cast<int>(sh.hist[bin]);
        if (acc + c >= need) {
          const uint32_t bin_lo = lo + (static_cast<uint32_t>(bin) << shift);
          const uint64_t bin_hi = static_cast<uint64_t>(bin_lo) + (uint64_t{1} << shift) - 1;
          sh.lo = bin_lo;
          sh.hi = bin_hi < hi ? static_cast<uint32_t>(bin_hi) : hi;
          sh.need = need - acc;
          sh.bin_count = c;
          break;
        }
        acc += c;
      }
    }
    __syncthreads();
  }
}

// The ordered compaction: score j goes to dst[A(j) + min(E(j), need)], A(j) / E(j) the scores
// before j above hi / in [lo, hi]; those in [lo, hi] only while E(j) < need. `tile_cache`: every
// key in position order, or null (read the scores).
__device__ __forceinline__ void WriteSelected(const float* s, const uint32_t* tile_cache, int n,
                                              int k, int32_t begin, int32_t* dst,
                                              SelectShared& sh) {
  const uint32_t lo = sh.lo, hi = sh.hi;
  const int need = sh.need;
  const int taken_above = k - need;  // scores with keys above hi: all taken
  const int tid = threadIdx.x;
  int above_run = 0, equal_run = 0;
  for (int tile = 0; tile < n; tile += kTile) {
    const int j0 = tile + tid * kPerThread;
    uint32_t keys[kPerThread];
    const int count = LoadTileKeys(s, tile_cache, n, j0, keys);
    uint32_t counts = 0;  // above hi << 16 | in [lo, hi]
    for (int e = 0; e < count; ++e) {
      counts += keys[e] > hi ? (1u << 16) : (keys[e] >= lo ? 1u : 0u);
    }
    uint32_t before, total;
    SelectScan(sh.temp.scan).ExclusiveSum(counts, before, total);
    int a = above_run + static_cast<int>(before >> 16);
    int e_count = equal_run + static_cast<int>(before & 0xffffu);
    for (int e = 0; e < count; ++e) {
      const int32_t position = begin + j0 + e;
      if (keys[e] > hi) {
        dst[a + min(e_count, need)] = position;
        ++a;
      } else if (keys[e] >= lo) {
        if (e_count < need) dst[a + e_count] = position;
        ++e_count;
      }
    }
    above_run += static_cast<int>(total >> 16);
    equal_run += static_cast<int>(total & 0xffffu);
    // Every pick is written once the scores above hi and `need` at it are seen.
    if (above_run == taken_above && equal_run >= need) break;
    __syncthreads();  // the scan's storage is reused
  }
}

// One CTA of kSelectThreads per (KV head, row). A radix select whose digits are taken relative to
// the candidates' key range (as kernels::cpu::TopKIndices's), so at most three histogram passes
// reach the k-th largest key; candidates are kept in shared memory once they fit (from the start
// for spans up to kCacheKeys, else from the pass whose candidates do), so later passes read no
// global memory. Then one ordered compaction over tiles of kTile scores: thread t owns kPerThread
// consecutive scores, and a block scan of its counts above the threshold and at it gives every
// pick its place, ascending, with the ties taken lowest positions first, without a sort.
__global__ void __launch_bounds__(kSelectThreads)
    CompactSelectKernel(const int32_t* slots, const CompactPick* picks, int64_t max_span,
                        const float* scores, int32_t* out) {
  __shared__ SelectShared sh;
  const int64_t i = blockIdx.y;
  const int64_t pair = i * gridDim.x + blockIdx.x;
  const CompactPick p = picks[pair];
  if (!Selects(p, slots[i], max_span)) return;
  const int n = p.end - p.begin;
  const int k = p.k < n ? p.k : n;
  int32_t* dst = out + p.offset;
  if (k == n) {
    for (int j = threadIdx.x; j < n; j += kSelectThreads) dst[j] = p.begin + j;
    return;
  }
  const float* s = scores + pair * max_span;
  const bool all_cached = n <= kCacheKeys;
  KeyRange(s, n, k, all_cached, sh);
  NarrowToThreshold(s, n, all_cached ? n : -1, sh);
  WriteSelected(s, all_cached ? sh.cache : nullptr, n, k, p.begin, dst, sh);
}

}  // namespace

cudaError_t CompactKeysAppend(const CompactKeysLayout& layout, int layer, const float* k,
                              const int32_t* slots, const int64_t* positions, int64_t rows,
                              cudaStream_t stream) {
  if (layer < 0 || layer >= layout.num_layers) return cudaErrorInvalidValue;
  const int64_t units = rows * layout.num_kv_heads;
  if (units <= 0 || layout.head_dim <= 0) return cudaSuccess;
  const int64_t blocks = (units + kAppendWarps - 1) / kAppendWarps;
  CompactAppendKernel<<<static_cast<unsigned>(blocks), kAppendThreads, 0, stream>>>(
      layout, layer, k, slots, positions, rows);
  return cudaGetLastError();
}

namespace {

// CompactTopK's argument checks, shared by its two halves.
cudaError_t CheckSelectArgs(const CompactKeysLayout& layout, int layer, int64_t num_heads,
                            int64_t rows) {
  if (layer < 0 || layer >= layout.num_layers || layout.num_kv_heads <= 0 ||
      layout.num_kv_heads > 65535 || rows > 65535 || num_heads % layout.num_kv_heads != 0 ||
      (reinterpret_cast<uintptr_t>(layout.values) & 15) != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t group = num_heads / layout.num_kv_heads;
  if (group < 1 || group > kMaxGroup) return cudaErrorInvalidValue;
  switch (layout.head_dim) {
    case 32:
    case 64:
    case 128:
      return cudaSuccess;
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t CompactScores(const CompactKeysLayout& layout, int layer, const float* q,
                          int64_t num_heads, const int32_t* slots, const CompactPick* picks,
                          const uint64_t* masks, int64_t rows, int64_t max_span, float* scores,
                          cudaStream_t stream) {
  if (const cudaError_t e = CheckSelectArgs(layout, layer, num_heads, rows); e != cudaSuccess) {
    return e;
  }
  // Every pair that selects is at most max_span wide: nothing to do without one.
  if (rows <= 0 || max_span <= 0) return cudaSuccess;
  const int64_t group = num_heads / layout.num_kv_heads;
  const ScoreArgs a{layout, layer, q, num_heads, slots, picks, masks, max_span, scores};
  switch (layout.head_dim) {
    case 32:
      LaunchScoresForGroup<32>(group, a, rows, stream);
      break;
    case 64:
      LaunchScoresForGroup<64>(group, a, rows, stream);
      break;
    default:
      LaunchScoresForGroup<128>(group, a, rows, stream);
      break;
  }
  return cudaGetLastError();
}

cudaError_t CompactSelectBest(const CompactKeysLayout& layout, const int32_t* slots,
                              const CompactPick* picks, int64_t rows, int64_t max_span,
                              const float* scores, int32_t* out, cudaStream_t stream) {
  if (layout.num_kv_heads <= 0 || layout.num_kv_heads > 65535 || rows > 65535) {
    return cudaErrorInvalidValue;
  }
  if (rows <= 0 || max_span <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(layout.num_kv_heads), static_cast<unsigned>(rows));
  CompactSelectKernel<<<grid, kSelectThreads, 0, stream>>>(slots, picks, max_span, scores, out);
  return cudaGetLastError();
}

cudaError_t CompactTopK(const CompactKeysLayout& layout, int layer, const float* q,
                        int64_t num_heads, const int32_t* slots, const CompactPick* picks,
                        const uint64_t* masks, int64_t rows, int64_t max_span, float* scores,
                        int32_t* out, cudaStream_t stream) {
  if (const cudaError_t e = CompactScores(layout, layer, q, num_heads, slots, picks, masks, rows,
                                          max_span, scores, stream);
      e != cudaSuccess) {
    return e;
  }
  return CompactSelectBest(layout, slots, picks, rows, max_span, scores, out, stream);
}

}  // namespace fluxion::kernels::cuda
