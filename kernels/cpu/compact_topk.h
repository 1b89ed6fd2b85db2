// Compact-key selection on the CPU (kernels/compact_keys.h): quantizing rows, scoring them and
// picking a step's rows exactly as the device does (kernels/cuda/compact_select.h), so that the
// device selection's choices can be reproduced, tested and evaluated without a GPU.
//
// Thread-safe: no shared state.
#ifndef FLUXION_KERNELS_CPU_COMPACT_TOPK_H_
#define FLUXION_KERNELS_CPU_COMPACT_TOPK_H_

#include <cstdint>
#include <vector>

#include "common/half.h"
#include "kernels/compact_keys.h"

namespace fluxion::kernels::cpu {

// Quantizes a key row of n bf16 values (as the host pages store it) into out[n]; returns its
// scale (CompactScale of the row's largest magnitude).
float CompactKeyRow(const bf16* row, int64_t n, int8_t* out);
// The same for n fp32 values rounded to bf16 first (what the device's append does with the
// step's fp32 K, so a row appended on the device equals the row admitted from the pages).
float CompactKeyRowFromFloat(const float* row, int64_t n, int8_t* out);
// Quantizes a query row of n fp32 values into out[n] (no bf16 rounding); returns its scale.
float CompactQueryRow(const float* row, int64_t n, int8_t* out);

// A GQA group's queries in compact form: group rows of head_dim values and their scales.
struct CompactQuery {
  std::vector<int8_t> values;  // [group][head_dim]
  std::vector<float> scales;   // [group]
  int64_t group = 0, head_dim = 0;
};
// q: [group][head_dim] fp32.
void CompactQueryGroup(const float* q, int64_t group, int64_t head_dim, CompactQuery* out);

// The score of one compact key row (head_dim values, `scale`) for the group: CompactScore's max
// over the group's query heads.
float CompactGroupScore(const CompactQuery& q, const int8_t* key, float scale);

// The k largest of n scores (ties to the lower index, as TopKIndices), as positions
// first + index, ascending, into *out (replaced). k is clamped to [0, n].
void CompactTopKPositions(const float* scores, int64_t n, int64_t k, int32_t first,
                          std::vector<int32_t>* out);

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_COMPACT_TOPK_H_
