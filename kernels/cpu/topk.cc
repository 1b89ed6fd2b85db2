#include "kernels/cpu/topk.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

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
// head), and allocating the keys each time was a visible share of a block selection.
struct TopKScratch {
  std::vector<uint32_t> keys;
  std::vector<int32_t> cand, next;
};

}  // namespace

// Each pass buckets the candidates by the top kDigitBits bits of (key - lo), lo / hi the smallest
// and largest candidate key, so a pass narrows the range 2048-fold wherever the scores sit. (Fixed
// digits of the raw key put every score of a narrow range, e.g. a head's Quest bounds, which
// differ in their low mantissa bits only, in one bucket: a wasted pass.) At most three passes
// reach a range of one key.
void TopKIndices(const float* scores, int64_t n, int64_t k, std::vector<int32_t>* out) {
  out->clear();
  k = std::min(k, n);
  if (k <= 0) return;
  if (k == n) {
    out->resize(n);
    std::iota(out->begin(), out->end(), 0);
    return;
  }
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
  std::vector<int32_t>& next = scratch.next;
  int64_t need = k;
  uint32_t hist[kBuckets];
  // One pass: histogram of the candidates' digits, then entries above the threshold bucket go
  // out and those in it stay candidates (in index order), with their key range. The first pass
  // walks all n entries directly; later ones walk the (few) candidates.
  auto pass = [&](auto&& for_each_candidate) {
    const int shift = std::max(BitWidth(hi - lo) - kDigitBits, 0);
    const int buckets = static_cast<int>((hi - lo) >> shift) + 1;
    std::fill(hist, hist + buckets, 0u);
    for_each_candidate([&](int32_t i) { ++hist[(keys[i] - lo) >> shift]; });
    const uint32_t b = static_cast<uint32_t>(ThresholdBucket(hist, buckets, &need));
    next.clear();
    uint32_t next_lo = ~0u, next_hi = 0;
    for_each_candidate([&](int32_t i) {
      const uint32_t digit = (keys[i] - lo) >> shift;
      if (digit > b) {
        out->push_back(i);
      } else if (digit == b) {
        next.push_back(i);
        next_lo = std::min(next_lo, keys[i]);
        next_hi = std::max(next_hi, keys[i]);
      }
    });
    cand.swap(next);
    lo = next_lo;
    hi = next_hi;
  };
  if (lo == hi) {
    cand.resize(n);
    std::iota(cand.begin(), cand.end(), 0);
  } else {
    pass([&](auto&& fn) {
      for (int64_t i = 0; i < n; ++i) fn(static_cast<int32_t>(i));
    });
  }
  // The candidates (in index order) all lie in [lo, hi] and `need` of them are still wanted.
  while (lo != hi && static_cast<int64_t>(cand.size()) != need) {
    pass([&](auto&& fn) {
      for (int32_t i : cand) fn(i);
    });
  }
  // Either every candidate is wanted, or they all equal the k-th largest key: take the lowest
  // indices.
  out->insert(out->end(), cand.begin(), cand.begin() + need);
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
