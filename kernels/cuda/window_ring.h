// CUDA kernels of the resident window (decode/step/resident_window.h): per (slot, layer, KV head)
// the first `sink` tokens and a ring of the last `window` tokens, bf16, in one array per K and V
// laid out [slot][layer][kv_head][sink + window][head_dim]. Row of token t: t < sink ? t :
// sink + (t - sink) % window; at context c the valid rows are [0, min(c, sink) +
// min(window, max(0, c - sink))).
//
// Both kernels read a step's rows from two device arrays: slots [rows] (int32) and positions
// [rows] (int64: the token of the step; its context is positions[i] + 1), so nothing is built on
// the host per layer.
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_WINDOW_RING_H_
#define FLUXION_KERNELS_CUDA_WINDOW_RING_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/half.h"

namespace fluxion::kernels::cuda {

struct RingLayout {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t sink = 4;
  int64_t window = 64;
  bf16* k = nullptr;  // [slots][num_layers][num_kv_heads][sink + window][head_dim]
  bf16* v = nullptr;
};

// Writes row i's K/V of `layer` (k, v: [rows][num_kv_heads][head_dim] fp32, rounded to bf16) at
// its token's ring row.
cudaError_t RingAppend(const RingLayout& ring, int layer, const float* k, const float* v,
                       const int32_t* slots, const int64_t* positions, int64_t rows,
                       cudaStream_t stream);

// For every row i and query head j: attention of q[i][j] over the valid rows of (slots[i],
// layer, KV head j / group) at context positions[i] + 1: out [rows][num_heads][head_dim] and
// natural-base lse [rows][num_heads] of the scaled scores. q: [rows][num_heads][head_dim] fp32
// post-RoPE. head_dim 32, 64 or 128, sink + window <= 256 (cudaErrorInvalidValue otherwise).
cudaError_t RingAttention(const RingLayout& ring, int layer, const float* q, int64_t num_heads,
                          float scale, const int32_t* slots, const int64_t* positions,
                          int64_t rows, float* out, float* lse, cudaStream_t stream);

// The full-attention KV in HBM (decode/device/hbm_full_attention.h): for one layer, page p of the
// layer's arena `layer_base` holds K then V of `page_tokens` tokens ([page_tokens][head_dim] bf16
// each); (slot, KV head) owns pages [(slot * num_kv_heads + head) * max_pages, ... + max_pages),
// token t in page t / page_tokens, row t % page_tokens. Writes row i's K/V (k, v:
// [rows][num_kv_heads] [head_dim] fp32, rounded to bf16) at positions[i] of slots[i].
cudaError_t HbmPageAppend(bf16* layer_base, int64_t page_tokens, int64_t max_pages,
                          int64_t num_kv_heads, int64_t head_dim, const float* k, const float* v,
                          const int32_t* slots, const int64_t* positions, int64_t rows,
                          cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_WINDOW_RING_H_
