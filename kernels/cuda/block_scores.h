// Quest block scoring on the device for the hybrid decode step (decode/step/resident_window.h,
// "Selection metadata"): per (slot, layer, KV head) the page bounds of every stored page (the
// element-wise min and max of the page's bf16 keys: exactly PagedKv::key_min / key_max, kept in
// bf16 because the min and max of bf16 values are bf16 values), and per step the Quest upper
// bound of every block of a row's context, so the CPU reads a few scores per block instead of
// 2 x head_dim bounds per page (at 8B shapes and 128K tokens that scan is 2.1 GB per step:
// bench/results/decode-block-scores-zerocopy-8b-h200-20261202.json).
//
// A row's block size is a multiple of the page size (block_tokens[i]; 0: the row is not scored
// and its bounds are not maintained). Block b of a context of c tokens covers pages
// [b * ppb, min((b + 1) * ppb, ceil(c / page_tokens))), ppb = block / page_tokens; its score is
// max over the group's query heads g of sum_d max(q_gd * lo_d, q_gd * hi_d), lo / hi the
// element-wise min / max of those pages' bounds: kernels::cpu::QuestBlockBounds's formula, with
// another summation order (scores agree to fp32 rounding).
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_BLOCK_SCORES_H_
#define FLUXION_KERNELS_CUDA_BLOCK_SCORES_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/half.h"

namespace fluxion::kernels::cuda {

struct PageBoundsLayout {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t page_tokens = 16;
  int64_t max_pages = 0;  // pages of one (slot, layer, KV head)
  bf16* min = nullptr;    // [slots][num_layers][num_kv_heads][max_pages][head_dim]
  bf16* max = nullptr;

};

// Where (slot, layer, head)'s bounds start in min / max (host and device code).
__host__ __device__ inline int64_t BoundsOffset(const PageBoundsLayout& b, int64_t slot,
                                                int64_t layer, int64_t head) {
  return ((slot * b.num_layers + layer) * b.num_kv_heads + head) * b.max_pages * b.head_dim;
}

// Folds row i's K of `layer` (k: [rows][num_kv_heads][head_dim] fp32, rounded to bf16 as the host
// pages store it) into the bounds of the page of positions[i] of slots[i]; the first token of a
// page sets them. Rows with block_tokens[i] == 0 are skipped. The caller keeps positions below
// max_pages * page_tokens.
cudaError_t PageBoundsAppend(const PageBoundsLayout& bounds, int layer, const float* k,
                             const int32_t* slots, const int64_t* positions,
                             const int32_t* block_tokens, int64_t rows, cudaStream_t stream);

// For every row i with block_tokens[i] > 0 and offsets[i] >= 0, at context positions[i] + 1: the
// scores of its
// nb_i = ceil(context / block_tokens[i]) blocks for every KV head h at
// scores[offsets[i] + h * nb_i + b]. q: [rows][num_heads][head_dim] fp32 post-RoPE (unscaled).
// `max_blocks` >= every nb_i (sizes the grid). head_dim 32, 64 or 128 and a GQA group of at most
// 8 query heads (cudaErrorInvalidValue otherwise).
cudaError_t QuestBlockScores(const PageBoundsLayout& bounds, int layer, const float* q,
                             int64_t num_heads, const int32_t* slots, const int64_t* positions,
                             const int32_t* block_tokens, const int64_t* offsets, int64_t rows,
                             int64_t max_blocks, float* scores, cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_BLOCK_SCORES_H_
