#include "kernels/cuda/top_blocks.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kBins / kThreads;

// kernels/cpu/topk.cc's order-preserving image of a float: NaN lowest.
__device__ __forceinline__ uint32_t SortableKey(float f) {
  const uint32_t u = __float_as_uint(f);
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

// One CTA per (KV head, row). A radix select whose digits are taken relative to the candidates'
// key range (as the CPU's: scores of one head often differ in low mantissa bits only), at most
// three histogram passes over the head's scores (a few thousand floats, in L2), then a stable
// compaction: thread t owns a contiguous chunk, so prefix sums over the chunks give every pick
// its place in ascending order, and the ties taken are the lowest-numbered ones.
__global__ void __launch_bounds__(kThreads)
    TopBlocksKernel(const float* scores, const int32_t* block_tokens, const int64_t* positions,
                    const int64_t* offsets, const TopBlocksRange* ranges,
                    const int64_t* top_offsets, int32_t* top) {
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t s_lo, s_hi;
  __shared__ int s_need, s_bin_count;

  const int64_t i = blockIdx.y, h = blockIdx.x;
  const int64_t block = block_tokens[i];
  const TopBlocksRange r = ranges[i];
  if (block <= 0 || offsets[i] < 0 || r.want <= 0) return;
  const int64_t nb = (positions[i] + 1 + block - 1) / block;
  const int64_t first = r.first, end = r.end < nb ? r.end : nb;
  if (end <= first) return;
  const int n = static_cast<int>(end - first);
  const int want = static_cast<int>(r.want < n ? r.want : n);
  const float* s = scores + offsets[i] + h * nb + first;
  int32_t* out = top + top_offsets[i] + h * r.want;
  const int tid = threadIdx.x;
  if (want == n) {
    for (int j = tid; j < n; j += kThreads) out[j] = static_cast<int32_t>(first + j);
    return;
  }

  // The candidates: keys in [lo, hi]; `need` of them are still to be taken.
  uint32_t lo = ~0u, hi = 0;
  for (int j = tid; j < n; j += kThreads) {
    const uint32_t key = SortableKey(s[j]);
    lo = key < lo ? key : lo;
    hi = key > hi ? key : hi;
  }
  lo = Reduce(temp.reduce).Reduce(lo, MinOp());
  __syncthreads();
  hi = Reduce(temp.reduce).Reduce(hi, MaxOp());
  if (tid == 0) {
    s_lo = lo;
    s_hi = hi;
    s_need = want;
    s_bin_count = n;
  }
  __syncthreads();
  // Narrow [lo, hi] until every candidate is taken or they all share one key.
  while (s_lo != s_hi && s_bin_count != s_need) {
    lo = s_lo;
    hi = s_hi;
    const int shift = max(BitWidth(hi - lo) - kDigitBits, 0);
    for (int b = tid; b < kBins; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int j = tid; j < n; j += kThreads) {
      const uint32_t key = SortableKey(s[j]);
      if (key >= lo && key <= hi) atomicAdd(&hist[(key - lo) >> shift], 1u);
    }
    __syncthreads();
    // Thread t sums bins [kBins - (t + 1) * kBinsPerThread, kBins - t * kBinsPerThread), so an
    // exclusive scan gives the entries above its bins.
    const int top_bin = kBins - 1 - tid * kBinsPerThread;
    int mine = 0;
    for (int b = 0; b < kBinsPerThread; ++b) mine += static_cast<int>(hist[top_bin - b]);
    int above;
    Scan(temp.scan).ExclusiveSum(mine, above);
    const int need = s_need;
    if (above < need && above + mine >= need) {
      int acc = above;
      for (int b = 0; b < kBinsPerThread; ++b) {
        const int bin = top_bin - b;
        const int c = static_cast<int>(hist[bin]);
        if (acc + c >= need) {
          const uint32_t bin_lo = lo + (static_cast<uint32_t>(bin) << shift);
          const uint64_t bin_hi = static_cast<uint64_t>(bin_lo) + (uint64_t{1} << shift) - 1;
          s_lo = bin_lo;
          s_hi = bin_hi < hi ? static_cast<uint32_t>(bin_hi) : hi;
          s_need = need - acc;
          s_bin_count = c;
          break;
        }
        acc += c;
      }
    }
    __syncthreads();
  }
  lo = s_lo;
  hi = s_hi;
  const int need = s_need;

  // Picks: keys above hi, and the first `need` candidates (keys in [lo, hi]) by block number.
  const int chunk = (n + kThreads - 1) / kThreads;
  const int begin = min(tid * chunk, n), stop = min(begin + chunk, n);
  int above = 0, cands = 0;
  for (int j = begin; j < stop; ++j) {
    const uint32_t key = SortableKey(s[j]);
    above += key > hi;
    cands += key >= lo && key <= hi;
  }
  int cands_before;
  Scan(temp.scan).ExclusiveSum(cands, cands_before);
  __syncthreads();
  const int taken = max(0, min(cands, need - cands_before));
  int at;
  Scan(temp.scan).ExclusiveSum(above + taken, at);
  int rank = cands_before;
  for (int j = begin; j < stop; ++j) {
    const uint32_t key = SortableKey(s[j]);
    if (key > hi) {
      out[at++] = static_cast<int32_t>(first + j);
    } else if (key >= lo && rank < need) {
      out[at++] = static_cast<int32_t>(first + j);
      ++rank;
    } else if (key >= lo) {
      ++rank;
    }
  }
}

}  // namespace

cudaError_t TopBlocks(const float* scores, const int32_t* block_tokens, const int64_t* positions,
                      const int64_t* offsets, const TopBlocksRange* ranges,
                      const int64_t* top_offsets, int64_t rows, int64_t num_kv_heads,
                      int32_t* top, cudaStream_t stream) {
  if (rows <= 0 || num_kv_heads <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(num_kv_heads), static_cast<unsigned>(rows));
  TopBlocksKernel<<<grid, kThreads, 0, stream>>>(scores, block_tokens, positions, offsets, ranges,
                                                top_offsets, top);
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
