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

// One block per row; see sampling.h for the method. Each pass reads the row in chunks of kUnroll
// coalesced loads per thread, issued together: one load at a time left the passes latency-bound.
__global__ void __launch_bounds__(kThreads)
    TopCandidatesKernel(const float* __restrict__ logits, int64_t vocab, int k,
                        const double* __restrict__ temperatures, int32_t* __restrict__ ids,
                        float* __restrict__ values, double* __restrict__ normalisers) {
  using Scan = cub::BlockScan<int, kThreads>;
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  // The fast path's histogram, then the keys it sorts (or the general path's winners).
  __shared__ union {
    uint32_t top_hist[kTopBins];
    unsigned long long cand[kFastCap];
  } u;
  unsigned long long* cand = u.cand;
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t s_prefix, s_max_key;
  __shared__ int s_remaining, s_count, s_eq_seen, s_top_bin, s_top_taken;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int64_t row = blockIdx.x;
  const float* __restrict__ x = logits + row * vocab;
  const double t = temperatures != nullptr ? temperatures[row] : 0.0;
  if (tid == 0) s_max_key = 0;

  // Fast path: one pass histograms the top 12 bits (and finds the max); if every key in or above
  // the bin holding the k-th largest fits in shared memory, a second pass gathers them (and sums
  // the normaliser) and a sort finishes: two reads of the row instead of five. Rows where that
  // bin is crowded (many equal or near-equal logits) take the general path below.
  for (int b = tid; b < kTopBins; b += kThreads) u.top_hist[b] = 0;
  __syncthreads();
  {
    uint32_t max_key = 0;
    for (int64_t base = 0; base < vocab; base += kChunk) {
      float v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = base + j * kThreads + tid;
        v[j] = i < vocab ? x[i] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        if (base + j * kThreads + tid < vocab) {
          const uint32_t key = OrderKey(v[j]);
          max_key = max(max_key, key);
          atomicAdd(&u.top_hist[key >> kTopShift], 1u);
        }
      }
    }
    max_key = __reduce_max_sync(0xFFFFFFFFu, max_key);
    if (lane == 0) atomicMax(&s_max_key, max_key);
  }
  __syncthreads();
  {
    // Thread t owns bins 4095 - 4t down to 4092 - 4t, so a scan in thread order runs from the
    // largest keys down; the thread whose range holds the k-th largest publishes its bin.
    int c[4], own = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c[j] = static_cast<int>(u.top_hist[kTopBins - 1 - 4 * tid - j]);
      own += c[j];
    }
    int above = 0, total = 0;
    Scan(temp.scan).ExclusiveSum(own, above, total);
    if (above < k && k <= above + own) {
      int j = 0;
      for (; j < 3; ++j) {
        if (above + c[j] >= k) break;
        above += c[j];
      }
      s_top_bin = kTopBins - 1 - 4 * tid - j;
      s_top_taken = above + c[j];  // every key in or above the bin
      s_count = 0;
    }
  }
  __syncthreads();
  const double max_value = FromKey(s_max_key);
  if (s_top_taken <= kFastCap) {
    const uint32_t top_bin = static_cast<uint32_t>(s_top_bin);
    double sum = 0.0;
    for (int64_t base = 0; base < vocab; base += kChunk) {
      float v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = base + j * kThreads + tid;
        v[j] = i < vocab ? x[i] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = base + j * kThreads + tid;
        const bool valid = i < vocab;
        const uint32_t key = OrderKey(v[j]);
        if (valid && t > 0.0) sum += exp((static_cast<double>(v[j]) - max_value) / t);
        const bool take = valid && (key >> kTopShift) >= top_bin;
        // One shared atomic per warp for the warp's takers.
        const unsigned ballot = __ballot_sync(0xFFFFFFFFu, take);
        int slot = 0;
        if (lane == 0 && ballot != 0) slot = atomicAdd(&s_count, __popc(ballot));
        slot = __shfl_sync(0xFFFFFFFFu, slot, 0);
        if (take) {
          cand[slot + __popc(ballot & ((1u << lane) - 1u))] =
              (static_cast<unsigned long long>(key) << 32) |
              (0xFFFFFFFFu - static_cast<uint32_t>(i));
        }
      }
    }
    __syncthreads();
    SortDescending(cand, s_top_taken);
    WriteRow(cand, x, k, ids + row * k, values + row * k);
    if (normalisers != nullptr) {
      const double total = Reduce(temp.reduce).Sum(sum);
      if (tid == 0) normalisers[row] = t > 0.0 ? total : 0.0;
    }
    return;
  }
  __syncthreads();

  // Radix select: after the pass at `shift`, `prefix` holds the top digits of the k-th largest
  // key and `remaining` how many of the keys sharing them are still to be taken (k - the count
  // of keys above the prefix).
  uint32_t prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < kBins; b += kThreads) hist[b] = 0;
    __syncthreads();
    uint32_t max_key = 0;
    // Uniform trip count over the block, so every lane of a warp takes part in the match.
    for (int64_t base = 0; base < vocab; base += kChunk) {
      float v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = base + j * kThreads + tid;
        v[j] = i < vocab ? x[i] : 0.0f;
      }
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
        if (in && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
      }
    }
    if (shift == 24) {
      max_key = __reduce_max_sync(0xFFFFFFFFu, max_key);
      if (lane == 0) atomicMax(&s_max_key, max_key);
    }
    __syncthreads();
    ChooseDigit(hist, prefix, shift, remaining, &s_prefix, &s_remaining);
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    mask |= 0xFFu << shift;
    __syncthreads();
  }

  // Gather every key above the threshold and the `remaining` lowest-id keys equal to it; sum the
  // normaliser on the way.
  const uint32_t threshold = prefix;
  if (tid == 0) {
    s_count = 0;
    s_eq_seen = 0;
  }
  __syncthreads();
  double sum = 0.0;
  for (int64_t base = 0; base < vocab; base += kChunk) {
    float v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = base + j * kThreads + tid;
      v[j] = i < vocab ? x[i] : 0.0f;
    }
    // Sub-chunks in id order, so that ties at the threshold are ranked by id.
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
      if (__syncthreads_or(eq) && s_eq_seen < remaining) {
        int rank = 0, total = 0;
        Scan(temp.scan).ExclusiveSum(eq ? 1 : 0, rank, total);
        take = take || (eq && s_eq_seen + rank < remaining);
        __syncthreads();  // every thread has read s_eq_seen (and the scan's storage is free)
        if (tid == 0) s_eq_seen += total;
      }
      if (take) {
        // Descending by key, then ascending by id: the sampler's order as one 64-bit number.
        cand[atomicAdd(&s_count, 1)] = (static_cast<unsigned long long>(key) << 32) |
                                       (0xFFFFFFFFu - static_cast<uint32_t>(i));
      }
    }
  }
  __syncthreads();

  SortDescending(cand, k);
  WriteRow(cand, x, k, ids + row * k, values + row * k);
  if (normalisers != nullptr) {
    const double total = Reduce(temp.reduce).Sum(sum);
    if (tid == 0) normalisers[row] = t > 0.0 ? total : 0.0;
  }
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
