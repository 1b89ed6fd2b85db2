#include "kernels/cpu/topk.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>

#include <omp.h>

#include "kernels/cpu/cpu_pool.h"

namespace fluxion::kernels::cpu {
namespace {

// Maps a float to a uint32 whose unsigned order is the float order: positive values get the sign
// bit set, negative values are bit-inverted; NaN maps to 0 (lowest). Branch-free so the
// conversion loop vectorises.
inline uint32_t SortableKey(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t flip = static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u;
  const uint32_t key = u ^ flip;
  return (u & 0x7fffffffu) > 0x7f800000u ? 0u : key;
}

// Finds, in hist[0, buckets), the bucket holding the `need`-th largest entry counting from the
// top; subtracts the entries of the buckets above it from `need`.
inline int ThresholdBucket(const uint32_t* hist, int buckets, int64_t* need) {
  int bucket = buckets - 1;
  for (; bucket > 0; --bucket) {
    if (hist[bucket] >= *need) break;
    *need -= hist[bucket];
  }
  return bucket;
}

constexpr int kDigitBits = 11;
constexpr int kBuckets = 1 << kDigitBits;

// Bits needed to write v (0 for 0).
inline int BitWidth(uint32_t v) { return v == 0 ? 0 : 32 - __builtin_clz(v); }

// Scratch reused by every call on a thread: the step calls this once per (request, layer, KV
// head), and allocating the keys each time was a visible share of a block selection. The task
// version's chunk bounds, histograms and offsets live here too (its tasks write the caller's).
struct TopKScratch {
  std::vector<uint32_t> keys;
  std::vector<int32_t> cand, next;
  std::vector<uint32_t> chunk_lo, chunk_hi, chunk_hist;
  std::vector<int64_t> above_at, equal_at;
};

// The digit shift and bucket count of a pass over keys in [lo, hi].
struct Digits {
  int shift;
  int buckets;
  Digits(uint32_t lo, uint32_t hi)
      : shift(std::max(BitWidth(hi - lo) - kDigitBits, 0)),
        buckets(static_cast<int>((hi - lo) >> shift) + 1) {}
};

// Given the candidates `cand` (in index order) that all lie in [lo, hi], of which `need` are
// still wanted, and the entries already taken in *out: the remaining passes over the (few)
// candidates, then the lowest-index candidates of the k-th largest key.
void FinishSelection(TopKScratch& scratch, uint32_t lo, uint32_t hi, int64_t need,
                     std::vector<int32_t>* out) {
  const std::vector<uint32_t>& keys = scratch.keys;
  std::vector<int32_t>& cand = scratch.cand;
  std::vector<int32_t>& next = scratch.next;
  uint32_t hist[kBuckets];
  while (lo != hi && static_cast<int64_t>(cand.size()) != need) {
    const Digits dg(lo, hi);
    std::fill(hist, hist + dg.buckets, 0u);
    for (int32_t i : cand) ++hist[(keys[i] - lo) >> dg.shift];
    const uint32_t b = static_cast<uint32_t>(ThresholdBucket(hist, dg.buckets, &need));
    next.clear();
    uint32_t next_lo = ~0u, next_hi = 0;
    for (int32_t i : cand) {
      const uint32_t digit = (keys[i] - lo) >> dg.shift;
      if (digit > b) {
        out->push_back(i);
      } else if (digit == b) {
        next.push_back(i);
        next_lo = std::min(next_lo, keys[i]);
        next_hi = std::max(next_hi, keys[i]);
      }
    }
    cand.swap(next);
    lo = next_lo;
    hi = next_hi;
  }
  // Either every candidate is wanted, or they all equal the k-th largest key: take the lowest
  // indices.
  out->insert(out->end(), cand.begin(), cand.begin() + need);
}

// The trivial cases of both versions: true when *out is final.
bool Trivial(int64_t n, int64_t* k, std::vector<int32_t>* out) {
  out->clear();
  *k = std::min(*k, n);
  if (*k <= 0) return true;
  if (*k == n) {
    out->resize(n);
    std::iota(out->begin(), out->end(), 0);
    return true;
  }
  return false;
}

}  // namespace

// Each pass buckets the candidates by the top kDigitBits bits of (key - lo), lo / hi the smallest
// and largest candidate key, so a pass narrows the range 2048-fold wherever the scores sit. (Fixed
// digits of the raw key put every score of a narrow range, e.g. a head's Quest bounds, which
// differ in their low mantissa bits only, in one bucket: a wasted pass.) At most three passes
// reach a range of one key.
void TopKIndices(const float* scores, int64_t n, int64_t k, std::vector<int32_t>* out) {
  if (Trivial(n, &k, out)) return;
  out->reserve(k);
  thread_local TopKScratch scratch;
  std::vector<uint32_t>& keys = scratch.keys;
  keys.resize(n);
  uint32_t lo = ~0u, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = SortableKey(scores[i]);
    lo = std::min(lo, keys[i]);
    hi = std::max(hi, keys[i]);
  }
  std::vector<int32_t>& cand = scratch.cand;
  cand.clear();
  int64_t need = k;
  if (lo == hi) {
    cand.resize(n);
    std::iota(cand.begin(), cand.end(), 0);
    FinishSelection(scratch, lo, hi, need, out);
    return;
  }
  // The first pass walks all n entries directly: histogram of the digits, then entries above
  // the threshold bucket go out and those in it stay candidates (in index order), with their
  // key range.
  const Digits dg(lo, hi);
  uint32_t hist[kBuckets];
  std::fill(hist, hist + dg.buckets, 0u);
  for (int64_t i = 0; i < n; ++i) ++hist[(keys[i] - lo) >> dg.shift];
  const uint32_t b = static_cast<uint32_t>(ThresholdBucket(hist, dg.buckets, &need));
  uint32_t next_lo = ~0u, next_hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t digit = (keys[i] - lo) >> dg.shift;
    if (digit > b) {
      out->push_back(static_cast<int32_t>(i));
    } else if (digit == b) {
      cand.push_back(static_cast<int32_t>(i));
      next_lo = std::min(next_lo, keys[i]);
      next_hi = std::max(next_hi, keys[i]);
    }
  }
  FinishSelection(scratch, next_lo, next_hi, need, out);
}

// The first pass (the O(n) part) in three rounds of tasks over chunks of the entries: keys and
// each chunk's range; each chunk's histogram; each chunk's entries above the threshold bucket and
// in it, written at the chunk's offsets (prefix sums of its histogram), so both lists come out in
// index order as the one-walk pass writes them. The later passes and the tie rule are the same
// code, so the output is the same vector.
void TopKIndicesInTasks(const float* scores, int64_t n, int64_t k, std::vector<int32_t>* out,
                        int64_t chunk) {
  chunk = std::max<int64_t>(chunk, 1);
  if (n < 2 * chunk || !omp_in_parallel()) {
    TopKIndices(scores, n, k, out);
    return;
  }
  if (Trivial(n, &k, out)) return;
  thread_local TopKScratch scratch;
  TopKScratch& x = scratch;
  const int64_t chunks = (n + chunk - 1) / chunk;
  x.keys.resize(n);
  x.chunk_lo.resize(chunks);
  x.chunk_hi.resize(chunks);
  auto range_of = [&](int64_t c) {
    return std::make_pair(c * chunk, std::min(n, (c + 1) * chunk));
  };
  RunAsTasks(chunks, [&](int64_t c) {
    const auto [begin, end] = range_of(c);
    uint32_t lo = ~0u, hi = 0;
    for (int64_t i = begin; i < end; ++i) {
      x.keys[i] = SortableKey(scores[i]);
      lo = std::min(lo, x.keys[i]);
      hi = std::max(hi, x.keys[i]);
    }
    x.chunk_lo[c] = lo;
    x.chunk_hi[c] = hi;
  });
  const uint32_t lo = *std::min_element(x.chunk_lo.begin(), x.chunk_lo.end());
  const uint32_t hi = *std::max_element(x.chunk_hi.begin(), x.chunk_hi.end());
  int64_t need = k;
  x.cand.clear();
  if (lo == hi) {
    x.cand.resize(n);
    std::iota(x.cand.begin(), x.cand.end(), 0);
    FinishSelection(x, lo, hi, need, out);
    return;
  }
  const Digits dg(lo, hi);
  x.chunk_hist.assign(chunks * dg.buckets, 0u);
  RunAsTasks(chunks, [&](int64_t c) {
    const auto [begin, end] = range_of(c);
    uint32_t* hist = x.chunk_hist.data() + c * dg.buckets;
    for (int64_t i = begin; i < end; ++i) ++hist[(x.keys[i] - lo) >> dg.shift];
  });
  uint32_t hist[kBuckets];
  std::fill(hist, hist + dg.buckets, 0u);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t* h = x.chunk_hist.data() + c * dg.buckets;
    for (int j = 0; j < dg.buckets; ++j) hist[j] += h[j];
  }
  const uint32_t b = static_cast<uint32_t>(ThresholdBucket(hist, dg.buckets, &need));
  x.above_at.resize(chunks + 1);
  x.equal_at.resize(chunks + 1);
  x.above_at[0] = x.equal_at[0] = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t* h = x.chunk_hist.data() + c * dg.buckets;
    int64_t above = 0;
    for (int j = static_cast<int>(b) + 1; j < dg.buckets; ++j) above += h[j];
    x.above_at[c + 1] = x.above_at[c] + above;
    x.equal_at[c + 1] = x.equal_at[c] + h[b];
  }
  out->reserve(k);
  out->resize(x.above_at[chunks]);
  x.cand.resize(x.equal_at[chunks]);
  // Each chunk's range of its threshold-bucket entries, reusing the chunk bounds.
  RunAsTasks(chunks, [&](int64_t c) {
    const auto [begin, end] = range_of(c);
    int32_t* above = out->data() + x.above_at[c];
    int32_t* equal = x.cand.data() + x.equal_at[c];
    uint32_t next_lo = ~0u, next_hi = 0;
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t digit = (x.keys[i] - lo) >> dg.shift;
      if (digit > b) {
        *above++ = static_cast<int32_t>(i);
      } else if (digit == b) {
        *equal++ = static_cast<int32_t>(i);
        next_lo = std::min(next_lo, x.keys[i]);
        next_hi = std::max(next_hi, x.keys[i]);
      }
    }
    x.chunk_lo[c] = next_lo;
    x.chunk_hi[c] = next_hi;
  });
  const uint32_t next_lo = *std::min_element(x.chunk_lo.begin(), x.chunk_lo.end());
  const uint32_t next_hi = *std::max_element(x.chunk_hi.begin(), x.chunk_hi.end());
  FinishSelection(x, next_lo, next_hi, need, out);
}

void TopKIndicesNthElement(const float* scores, int64_t n, int64_t k, std::vector<int32_t>* out) {
  out->resize(n);
  std::iota(out->begin(), out->end(), 0);
  k = std::min(k, n);
  if (k <= 0) {
    out->clear();
    return;
  }
  auto by_score = [&](int32_t a, int32_t b) {
    const uint32_t ka = SortableKey(scores[a]), kb = SortableKey(scores[b]);
    return ka > kb || (ka == kb && a < b);
  };
  std::nth_element(out->begin(), out->begin() + (k - 1), out->end(), by_score);
  out->resize(k);
}

}  // namespace fluxion::kernels::cpu
