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

}  // namespace

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
  // Pass 1 (all entries): keys and a histogram of their top 11 bits.
  std::vector<uint32_t> keys(n);
  uint32_t hist[2048] = {};
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = SortableKey(scores[i]);
    ++hist[keys[i] >> 21];
  }
  int64_t need = k;
  const uint32_t b1 = static_cast<uint32_t>(ThresholdBucket(hist, 2048, &need));
  // Entries in higher buckets are in; entries in the threshold bucket are candidates (about
  // n / 2048 of them for spread-out scores), in index order.
  std::vector<int32_t> cand;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t top = keys[i] >> 21;
    if (top > b1) {
      out->push_back(static_cast<int32_t>(i));
    } else if (top == b1) {
      cand.push_back(static_cast<int32_t>(i));
    }
  }
  // Passes 2 and 3 over the shrinking candidate list: the middle 11 bits, then the low 10.
  const int shifts[2] = {10, 0};
  const int masks[2] = {2047, 1023};
  std::vector<int32_t> next;
  for (int pass = 0; pass < 2; ++pass) {
    std::fill(hist, hist + 2048, 0u);
    for (int32_t i : cand) ++hist[(keys[i] >> shifts[pass]) & masks[pass]];
    const uint32_t b = static_cast<uint32_t>(ThresholdBucket(hist, masks[pass] + 1, &need));
    next.clear();
    for (int32_t i : cand) {
      const uint32_t digit = (keys[i] >> shifts[pass]) & masks[pass];
      if (digit > b) {
        out->push_back(i);
      } else if (digit == b) {
        next.push_back(i);
      }
    }
    cand.swap(next);
  }
  // The remaining candidates all equal the k-th largest key: take the lowest indices.
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
