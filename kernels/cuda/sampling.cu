#include "kernels/cuda/sampling.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kBins = 256;
constexpr int kUnroll = 8;
constexpr int64_t kChunk = int64_t{kThreads} * kUnroll;
// The fast path's first digit: the key's top 12 bits (sign, exponent, 3 mantissa bits: bins of an
// eighth of an octave), and how many keys at or above its chosen bin it can hold and sort.
constexpr int kTopShift = 20;
constexpr int kTopBins = 1 << (32 - kTopShift);
constexpr int kFastCap = 4096;
static_assert(kTopBins == 4 * kThreads, "each thread owns 4 bins of the first digit");

// Order-preserving key of a float: a larger float has a larger key. -0 is folded onto +0 so the
// two tie, as they do in the sampler's comparisons.
__device__ __forceinline__ uint32_t OrderKey(float x) {
  uint32_t b = __float_as_uint(x);
  if (b == 0x80000000u) b = 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float FromKey(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// The radix digit at `shift` of the k-th largest key: `hist` holds the digit counts of the keys
// that share the digits chosen so far; warp 0 finds the bin (from the top) where the running count
// reaches `remaining` and publishes the new prefix and what remains to take among its keys.
__device__ __forceinline__ void ChooseDigit(const uint32_t* hist, uint32_t prefix, int shift,
                                            int remaining, uint32_t* s_prefix, int* s_remaining) {
  const int lane = threadIdx.x & 31;
  if (threadIdx.x >= 32) return;
  // Lane l holds bins 255 - 8l down to 248 - 8l, so lanes run from the largest digits down.
  int c[8], own = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    c[j] = static_cast<int>(hist[kBins - 1 - 8 * lane - j]);
    own += c[j];
  }
  int inclusive = own;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int y = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
    if (lane >= offset) inclusive += y;
  }
  int above = inclusive - own;
  if (above < remaining && remaining <= inclusive) {  // exactly one lane
    int j = 0;
    for (; j < 7; ++j) {
      if (above + c[j] >= remaining) break;
      above += c[j];
    }
    *s_prefix = prefix | (static_cast<uint32_t>(kBins - 1 - 8 * lane - j) << shift);
    *s_remaining = remaining - above;
  }
}

// Bitonic sort, descending, of keys[0..n) padded to a power of two with zeros (which sort last:
// no real entry is 0, as that would be a NaN at id 2^32 - 1). REQUIRES: the padded size fits
// kFastCap; every thread of the block calls it.
__device__ void SortDescending(unsigned long long* keys, int n) {
  int size_all = 1;
  while (size_all < n) size_all <<= 1;
  for (int i = n + threadIdx.x; i < size_all; i += kThreads) keys[i] = 0;
  __syncthreads();
  for (int size = 2; size <= size_all; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < size_all; i += kThreads) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned long long a = keys[i], b = keys[j];
          const bool descending = (i & size) == 0;
          if (descending ? a < b : a > b) {
            keys[i] = b;
            keys[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// The first k sorted entries as ids and the logits themselves (a -0 stays -0).
__device__ void WriteRow(const unsigned long long* keys, const float* x, int k, int32_t* ids,
                         float* values) {
  for (int p = threadIdx.x; p < k; p += kThreads) {
    const uint32_t id = 0xFFFFFFFFu - static_cast<uint32_t>(keys[p] & 0xFFFFFFFFull);
    ids[p] = static_cast<int32_t>(id);
    values[p] = x[id];
  }
}

using SampleScan = cub::BlockScan<int, kThreads>;
using SampleReduce = cub::BlockReduce<double, kThreads>;

// TopCandidatesKernel's shared memory.
struct SampleShared {
  union {
    typename SampleScan::TempStorage scan;
    typename SampleReduce::TempStorage reduce;
  } temp;
  // The fast path's histogram, then the keys it sorts (or the general path's winners).
  union {
    uint32_t top_hist[kTopBins];
    unsigned long long cand[kFastCap];
  } u;
  uint32_t hist[kBins];
  uint32_t prefix, max_key;
  int remaining, count, eq_seen, top_bin, top_taken;
};

// Loads the chunk of the row at `base` (kUnroll coalesced loads per thread, issued together: one
// load at a time left the passes latency-bound); 0 past the row's end.
__device__ __forceinline__ void LoadChunk(const float* __restrict__ x, int64_t vocab, int64_t base,
                                          float (&v)[kUnroll]) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    const int64_t i = base + j * kThreads + threadIdx.x;
    v[j] = i < vocab ? x[i] : 0.0f;
  }
}

// The fast path's first pass: the histogram of the keys' top 12 bits and the row's largest key.
__device__ __forceinline__ void TopBinHistogram(const float* __restrict__ x, int64_t vocab,
                                                SampleShared& sh) {
  const int tid = threadIdx.x, lane = tid & 31;
  for (int b = tid; b < kTopBins; b += kThreads) sh.u.top_hist[b] = 0;
  __syncthreads();
  uint32_t max_key = 0;
  for (int64_t base = 0; base < vocab; base += kChunk) {
    float v[kUnroll];
    LoadChunk(x, vocab, base, v);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (base + j * kThreads + tid < vocab) {
        const uint32_t key = OrderKey(v[j]);
        max_key = max(max_key, key);
        atomicAdd(&sh.u.top_hist[key >> kTopShift], 1u);
      }
    }
  }
  max_key = __reduce_max_sync(0xFFFFFFFFu, max_key);
  if (lane == 0) atomicMax(&sh.max_key, max_key);
  __syncthreads();
}

// The bin of the first digit holding the k-th largest key (sh.top_bin) and how many keys lie in or
// above it (sh.top_taken). Thread t owns bins 4095 - 4t down to 4092 - 4t, so a scan in thread
// order runs from the largest keys down; the thread whose range holds the k-th largest publishes.
__device__ __forceinline__ void ChooseTopBin(int k, SampleShared& sh) {
  const int tid = threadIdx.x;
  int c[4], own = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    c[j] = static_cast<int>(sh.u.top_hist[kTopBins - 1 - 4 * tid - j]);
    own += c[j];
  }
  int above = 0, total = 0;
  SampleScan(sh.temp.scan).ExclusiveSum(own, above, total);
  if (above < k && k <= above + own) {
    int j = 0;
    for (; j < 3; ++j) {
      if (above + c[j] >= k) break;
      above += c[j];
    }
    sh.top_bin = kTopBins - 1 - 4 * tid - j;
    sh.top_taken = above + c[j];  // every key in or above the bin
    sh.count = 0;
  }
  __syncthreads();
}

// The fast path's second pass: every key in or above sh.top_bin into sh.u.cand (one shared atomic
// per warp for the warp's takers); returns this thread's part of the normaliser.
__device__ __forceinline__ double GatherTopBin(const float* __restrict__ x, int64_t vocab,
                                               double t, double max_value, SampleShared& sh) {
  const int tid = threadIdx.x, lane = tid & 31;
  const uint32_t top_bin = static_cast<uint32_t>(sh.top_bin);
  double sum = 0.0;
  for (int64_t base = 0; base < vocab; base += kChunk) {
    float v[kUnroll];
    LoadChunk(x, vocab, base, v);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = base + j * kThreads + tid;
      const bool valid = i < vocab;
      const uint32_t key = OrderKey(v[j]);
      if (valid && t > 0.0) sum += exp((static_cast<double>(v[j]) - max_value) / t);
      const bool take = valid && (key >> kTopShift) >= top_bin;
      const unsigned ballot = __ballot_sync(0xFFFFFFFFu, take);
      int slot = 0;
      if (lane == 0 && ballot != 0) slot = atomicAdd(&sh.count, __popc(ballot));
      slot = __shfl_sync(0xFFFFFFFFu, slot, 0);
      if (take) {
        sh.u.cand[slot + __popc(ballot & ((1u << lane) - 1u))] =
            (static_cast<unsigned long long>(key) << 32) |
            (0xFFFFFFFFu - static_cast<uint32_t>(i));
      }
    }
  }
  __syncthreads();
  return sum;
}

// The general path's radix select: after the pass at `shift`, the prefix holds the top digits of
// the k-th largest key and `remaining` how many of the keys sharing them are still to be taken (k
// - the count of keys above the prefix). Returns the k-th largest key, with sh.remaining the
// count of keys equal to it to take; the first pass also finds the row's largest key
// (sh.max_key).
__device__ __forceinline__ uint32_t RadixThreshold(const float* __restrict__ x, int64_t vocab,
                                                   int k, SampleShared& sh) {
  const int tid = threadIdx.x, lane = tid & 31;
  uint32_t prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < kBins; b += kThreads) sh.hist[b] = 0;
    __syncthreads();
    uint32_t max_key = 0;
    // Uniform trip count over the block, so every lane of a warp takes part in the match.
    for (int64_t base = 0; base < vocab; base += kChunk) {
      float v[kUnroll];
      LoadChunk(x, vocab, base, v);
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const bool valid = base + j * kThreads + tid < vocab;
        const uint32_t key = valid ? OrderKey(v[j]) : 0u;
        max_key = max(max_key, key);
        const bool in = valid && (key & mask) == prefix;
        const int bin = in ? static_cast<int>((key >> shift) & 0xFFu) : kBins;
        // Logits crowd a few bins (the top digit is the sign and most of the exponent): one
        // shared atomic per distinct bin of the warp instead of one per lane.
        const unsigned peers = __match_any_sync(0xFFFFFFFFu, bin);
        if (in && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[bin], __popc(peers));
      }
    }
    if (shift == 24) {
      max_key = __reduce_max_sync(0xFFFFFFFFu, max_key);
      if (lane == 0) atomicMax(&sh.max_key, max_key);
    }
    __syncthreads();
    ChooseDigit(sh.hist, prefix, shift, remaining, &sh.prefix, &sh.remaining);
    __syncthreads();
    prefix = sh.prefix;
    remaining = sh.remaining;
    mask |= 0xFFu << shift;
    __syncthreads();
  }
  return prefix;
}

// The general path's gather: every key above `threshold` and the `remaining` lowest-id keys equal
// to it into sh.u.cand, in sub-chunks of id order (so ties at the threshold are ranked by id);
// returns this thread's part of the normaliser.
__device__ __forceinline__ double GatherAtThreshold(const float* __restrict__ x, int64_t vocab,
                                                    uint32_t threshold, int remaining, double t,
                                                    double max_value, SampleShared& sh) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    sh.count = 0;
    sh.eq_seen = 0;
  }
  __syncthreads();
  double sum = 0.0;
  for (int64_t base = 0; base < vocab; base += kChunk) {
    float v[kUnroll];
    LoadChunk(x, vocab, base, v);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = base + j * kThreads + tid;
      const bool valid = i < vocab;
      const uint32_t key = OrderKey(v[j]);
      if (valid && t > 0.0) sum += exp((static_cast<double>(v[j]) - max_value) / t);
      const bool eq = valid && key == threshold;
      bool take = valid && key > threshold;
      // A scan only in the sub-chunks that hold a tie while some are still wanted: rare except
      // in rows of equal values.
      if (__syncthreads_or(eq) && sh.eq_seen < remaining) {
        int rank = 0, total = 0;
        SampleScan(sh.temp.scan).ExclusiveSum(eq ? 1 : 0, rank, total);
        take = take || (eq && sh.eq_seen + rank < remaining);
        __syncthreads();  // every thread has read eq_seen (and the scan's storage is free)
        if (tid == 0) sh.eq_seen += total;
      }
      if (take) {
        // Descending by key, then ascending by id: the sampler's order as one 64-bit number.
        sh.u.cand[atomicAdd(&sh.count, 1)] = (static_cast<unsigned long long>(key) << 32) |
                                             (0xFFFFFFFFu - static_cast<uint32_t>(i));
      }
    }
  }
  __syncthreads();
  return sum;
}

// Sorts row `row`'s `taken` candidates, writes the first k, and the normaliser (the block's sum of
// `sum`) when asked.
__device__ __forceinline__ void FinishRow(const float* __restrict__ x, int64_t row, int taken,
                                          int k, double t, double sum, int32_t* ids,
                                          float* values, double* normalisers, SampleShared& sh) {
  SortDescending(sh.u.cand, taken);
  WriteRow(sh.u.cand, x, k, ids + row * k, values + row * k);
  if (normalisers != nullptr) {
    const double total = SampleReduce(sh.temp.reduce).Sum(sum);
    if (threadIdx.x == 0) normalisers[row] = t > 0.0 ? total : 0.0;
  }
}

// One block per row; see sampling.h for the method. Fast path: one pass histograms the top 12
// bits (and finds the max); if every key in or above the bin holding the k-th largest fits in
// shared memory, a second pass gathers them (and sums the normaliser) and a sort finishes: two
// reads of the row instead of five. Rows where that bin is crowded (many equal or near-equal
// logits) take the general path: a radix select of the k-th largest key, then one gather.
__global__ void __launch_bounds__(kThreads)
    TopCandidatesKernel(const float* __restrict__ logits, int64_t vocab, int k,
                        const double* __restrict__ temperatures, int32_t* __restrict__ ids,
                        float* __restrict__ values, double* __restrict__ normalisers) {
  __shared__ SampleShared sh;
  const int64_t row = blockIdx.x;
  const float* __restrict__ x = logits + row * vocab;
  const double t = temperatures != nullptr ? temperatures[row] : 0.0;
  if (threadIdx.x == 0) sh.max_key = 0;

  TopBinHistogram(x, vocab, sh);
  ChooseTopBin(k, sh);
  const double max_value = FromKey(sh.max_key);
  if (sh.top_taken <= kFastCap) {
    const double sum = GatherTopBin(x, vocab, t, max_value, sh);
    FinishRow(x, row, sh.top_taken, k, t, sum, ids, values, normalisers, sh);
    return;
  }
  __syncthreads();
  const uint32_t threshold = RadixThreshold(x, vocab, k, sh);
  const double sum = GatherAtThreshold(x, vocab, threshold, sh.remaining, t, max_value, sh);
  FinishRow(x, row, k, k, t, sum, ids, values, normalisers, sh);
}

}  // namespace

cudaError_t TopCandidates(const float* logits, int64_t rows, int64_t vocab, int64_t k,
                          const double* temperatures, int32_t* ids, float* values,
                          double* normalisers, cudaStream_t stream) {
  if (rows < 0 || k < 1 || k > kMaxTopCandidates || vocab < 1 || vocab > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  const int n = static_cast<int>(k < vocab ? k : vocab);
  TopCandidatesKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      logits, vocab, n, temperatures, ids, values, normalisers);
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
