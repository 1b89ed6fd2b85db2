// Compact keys: the int8 copy of a request's K that device selection scores against
// (docs/SPARSE.md, "Device selection"). The hybrid step keeps it in HBM beside the page bounds, so
// choosing a step's rows reads no host memory; only the chosen rows' K/V are read from the host
// pages.
//
// One compact row is a K row of head_dim values (as the host pages store it, bf16) quantized
// symmetrically to int8 with one fp32 scale: scale = absmax / 127, value = round_half_even(x *
// (127 / absmax)). A query row (one query head) is quantized the same way from its fp32 values. The
// score of key row t for a GQA group is
//
//     score(t) = max over the group's query heads g of  float(dot_int(q_g, k_t)) * (s_g * s_t)
//
// with the dot product in exact int32 arithmetic. Every step of it is exact or one IEEE operation
// with round-to-nearest, so the CPU (kernels/cpu/compact_topk.h) and the GPU
// (kernels/cuda/compact_select.h) compute the same scores bit for bit, and pick the same rows: the
// k largest, ties to the lower position. That is what lets CI and `fluxion eval tasks` measure the
// device selection's quality on the CPU.
//
// Why int8 with a per-row scale: it is 132 bytes per 128-value row (52% of the bf16 K row), the
// scan of a 128K-token Llama-3.1-8B request is 4.4 GB of HBM reads per step (~1.3 ms on an H100),
// and on the trained model its top-k recall of the exact scores' top-k is in docs/SPARSE.md.
//
// Host and device code; header only.
#ifndef FLUXION_KERNELS_COMPACT_KEYS_H_
#define FLUXION_KERNELS_COMPACT_KEYS_H_

#include <cstdint>

#if defined(__CUDACC__)
#define FLUXION_HOST_DEVICE __host__ __device__
#else
#define FLUXION_HOST_DEVICE
#include <cmath>
#endif

namespace fluxion::kernels {

inline constexpr float kCompactLevels = 127.0f;

// The scale a row of largest magnitude `absmax` is stored with (0 for an all-zero row).
FLUXION_HOST_DEVICE inline float CompactScale(float absmax) { return absmax / kCompactLevels; }

// Rows whose largest magnitude is below this quantize to zeros: 127 / absmax would overflow to
// infinity below ~3.7e-37, and 0 x infinity is NaN, which the two sides would round differently.
inline constexpr float kCompactTiny = 1e-30f;

// What values are multiplied by before rounding (0 for an all-zero or tiny row: every value 0).
FLUXION_HOST_DEVICE inline float CompactInverse(float absmax) {
  return absmax > kCompactTiny ? kCompactLevels / absmax : 0.0f;
}

// One value, rounded half to even (the default rounding mode on both sides), clamped to +-127.
FLUXION_HOST_DEVICE inline int8_t CompactValue(float x, float inverse) {
  const float y = x * inverse;
#if defined(__CUDA_ARCH__)
  int v = __float2int_rn(y);
#else
  int v = static_cast<int>(std::nearbyint(y));
#endif
  v = v > 127 ? 127 : (v < -127 ? -127 : v);
  return static_cast<int8_t>(v);
}

// A key row's score for one query head from the exact integer dot product and the two scales.
// The + 0.0f turns a -0.0 (a negative dot times a scale product that underflowed) into +0.0, so
// equal scores have one bit pattern and the radix selections on both sides order them as equal.
FLUXION_HOST_DEVICE inline float CompactScore(int32_t dot, float q_scale, float k_scale) {
  return static_cast<float>(dot) * (q_scale * k_scale) + 0.0f;
}

// Where the device keeps compact rows: per (slot, layer, KV head) `max_tokens` rows of head_dim
// int8 values and as many fp32 scales, position-indexed.
struct CompactKeysLayout {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_tokens = 0;
  int8_t* values = nullptr;  // [slots][num_layers][num_kv_heads][max_tokens][head_dim]
  float* scales = nullptr;   // [slots][num_layers][num_kv_heads][max_tokens]

  // Rows of (slot, layer, head) start at this row index (times head_dim for values).
  FLUXION_HOST_DEVICE int64_t RowOffset(int64_t slot, int64_t layer, int64_t head) const {
    return ((slot * num_layers + layer) * num_kv_heads + head) * max_tokens;
  }
  // Bytes one slot holds.
  int64_t SlotBytes() const {
    return num_layers * num_kv_heads * max_tokens *
           (head_dim * static_cast<int64_t>(sizeof(int8_t)) + static_cast<int64_t>(sizeof(float)));
  }
};

// One (row, KV head)'s selection for a step: the k middle rows of [begin, end) with the largest
// scores, written ascending at out + offset (the caller lays the picks of a step side by side).
// k <= 0 or begin >= end: nothing. mask >= 0: only candidates compete, the rows whose bit is set in
// the step's candidate words from word `mask` on (bit j of word mask + j / 64, lowest bit first:
// position begin + j; LFPS's table picks); k must not exceed the candidates then (non-candidates
// score -infinity and would fill the rest).
struct CompactPick {
  int32_t begin = 0, end = 0, k = 0;
  int32_t mask = -1;
  int64_t offset = 0;
};

// Whether row `j` of pick p's span competes (CompactPick::mask).
FLUXION_HOST_DEVICE inline bool CompactCandidate(const CompactPick& p, const uint64_t* masks,
                                                 int64_t j) {
  return p.mask < 0 || ((masks[p.mask + (j >> 6)] >> (j & 63)) & 1u) != 0;
}

}  // namespace fluxion::kernels

#endif  // FLUXION_KERNELS_COMPACT_KEYS_H_
