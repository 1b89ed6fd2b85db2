// Device selection from compact keys (kernels/compact_keys.h; docs/SPARSE.md, "Device selection"):
// the hybrid step appends each step's K to the int8 compact copy in HBM, then scores every middle
// row of a (row, KV head) against the group's quantized queries and picks the k best on the
// device, so only the chosen positions cross to the host. At 8B shapes and 128K tokens that choice
// took 170-209 ms per step on the CPU; here the scan reads each compact row once (132 bytes at
// head_dim 128) and the ranking reads the scores from L2.
//
// Both functions follow kernels/compact_keys.h bit for bit: CompactKeysAppend stores what
// kernels::cpu::CompactKeyRowFromFloat stores, and CompactTopK picks exactly what
// kernels::cpu::CompactQueryGroup + CompactGroupScore + CompactTopKPositions pick on the same
// compact rows: the k largest scores, ties to the lower position, a zero score of either sign
// counting as +0.0.
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_COMPACT_SELECT_H_
#define FLUXION_KERNELS_CUDA_COMPACT_SELECT_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/compact_keys.h"

namespace fluxion::kernels::cuda {

// Quantizes the step's K of `layer` (k: [rows][num_kv_heads][head_dim] fp32 in device memory; each
// value first rounded to bf16 round-to-nearest-even, as the host pages store it, then quantized per
// (row, KV head) with kernels::CompactInverse/CompactValue/CompactScale of the bf16 values' largest
// magnitude) into layout rows (slots[i], layer, h, positions[i]). Rows with slots[i] < 0 or
// positions[i] outside [0, layout.max_tokens) are skipped. slots/positions: device arrays [rows].
// Any head_dim; layer outside [0, num_layers): cudaErrorInvalidValue.
cudaError_t CompactKeysAppend(const CompactKeysLayout& layout, int layer, const float* k,
                              const int32_t* slots, const int64_t* positions, int64_t rows,
                              cudaStream_t stream);

// For every row i and KV head h with p = picks[i * layout.num_kv_heads + h], p.k > 0 and
// p.begin < p.end: quantizes each query head g of h's GQA group (group = num_heads / num_kv_heads;
// query head h * group + g; q: [rows][num_heads][head_dim] fp32 device memory) with
// CompactInverse/CompactValue/CompactScale of its largest magnitude (no bf16 rounding), scores
// every compact row t in [p.begin, p.end) of (slots[i], layer, h) as max_g
// CompactScore(dot_int32(q_g, k_t), q_scale_g, k_scale_t), and writes the min(p.k, p.end - p.begin)
// positions with the largest scores, ascending, to out[p.offset + j]: ties go to the lower position
// (exactly kernels::cpu::CompactTopKPositions over the same scores). A pick with p.mask >= 0
// scores its non-candidates (CompactCandidate over `masks`, device memory; null when no pick has
// a mask) -infinity, so its p.k (at most its candidates) picks come from the candidates.
// `scores` is device scratch of rows * num_kv_heads * max_span floats, max_span >= every
// p.end - p.begin (a pair wider than max_span, or of a row with slots[i] < 0, is skipped: nothing
// is written for it). picks, slots, out: device memory; layout.values 16-byte aligned
// (cudaMalloc's are). head_dim 32, 64 or 128, a group of 1..8 heads, layer in [0, num_layers)
// and rows <= 65535, else cudaErrorInvalidValue.
cudaError_t CompactTopK(const CompactKeysLayout& layout, int layer, const float* q,
                        int64_t num_heads, const int32_t* slots, const CompactPick* picks,
                        const uint64_t* masks, int64_t rows, int64_t max_span, float* scores,
                        int32_t* out, cudaStream_t stream);

// CompactTopK's two halves, for timing each (`fluxion bench selection`): CompactScores writes
// every selecting pair's scores into `scores` (pairs with p.k >= the span are not scored);
// CompactSelectBest picks from them into `out`. Same arguments and errors as CompactTopK.
cudaError_t CompactScores(const CompactKeysLayout& layout, int layer, const float* q,
                          int64_t num_heads, const int32_t* slots, const CompactPick* picks,
                          const uint64_t* masks, int64_t rows, int64_t max_span, float* scores,
                          cudaStream_t stream);
cudaError_t CompactSelectBest(const CompactKeysLayout& layout, const int32_t* slots,
                              const CompactPick* picks, int64_t rows, int64_t max_span,
                              const float* scores, int32_t* out, cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_COMPACT_SELECT_H_
