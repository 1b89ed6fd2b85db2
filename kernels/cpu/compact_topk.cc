#include "kernels/cpu/compact_topk.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/topk.h"

namespace fluxion::kernels::cpu {
namespace {

// The row's largest magnitude after `load` (bf16 rounding or none), then its values.
template <typename Load>
float Compact(int64_t n, int8_t* out, Load load) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(load(i)));
  const float inverse = CompactInverse(absmax);
  for (int64_t i = 0; i < n; ++i) out[i] = CompactValue(load(i), inverse);
  return CompactScale(absmax);
}

}  // namespace

float CompactKeyRow(const bf16* row, int64_t n, int8_t* out) {
  return Compact(n, out, [&](int64_t i) { return Bf16ToFloat(row[i]); });
}

float CompactKeyRowFromFloat(const float* row, int64_t n, int8_t* out) {
  return Compact(n, out, [&](int64_t i) { return RoundToBf16(row[i]); });
}

float CompactQueryRow(const float* row, int64_t n, int8_t* out) {
  return Compact(n, out, [&](int64_t i) { return row[i]; });
}

void CompactQueryGroup(const float* q, int64_t group, int64_t head_dim, CompactQuery* out) {
  out->group = group;
  out->head_dim = head_dim;
  out->values.resize(group * head_dim);
  out->scales.resize(group);
  for (int64_t g = 0; g < group; ++g) {
    out->scales[g] = CompactQueryRow(q + g * head_dim, head_dim, out->values.data() + g * head_dim);
  }
}

float CompactGroupScore(const CompactQuery& q, const int8_t* key, float scale) {
  float best = -INFINITY;
  for (int64_t g = 0; g < q.group; ++g) {
    const int8_t* qg = q.values.data() + g * q.head_dim;
    int32_t dot = 0;
    for (int64_t i = 0; i < q.head_dim; ++i) dot += int32_t{qg[i]} * int32_t{key[i]};
    best = std::max(best, CompactScore(dot, q.scales[g], scale));
  }
  return best;
}

void CompactTopKPositions(const float* scores, int64_t n, int64_t k, int32_t first,
                          std::vector<int32_t>* out) {
  k = std::clamp<int64_t>(k, 0, n);
  out->clear();
  if (k == 0) return;
  TopKIndices(scores, n, k, out);
  std::sort(out->begin(), out->end());
  for (int32_t& i : *out) i += first;
}

}  // namespace fluxion::kernels::cpu
