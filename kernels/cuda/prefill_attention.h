// CUDA kernels of the prefill node's attention (issue 15): the prompt's K/V written straight into
// the wire's page layout in HBM (transfer/kv_pages.h: per layer, head-major then page, each page K
// then V as [page_tokens][head_dim] bf16), and a causal flash-style attention of a chunk of query
// rows over those pages. Keeping the cache in the wire layout means the device-to-host copy of a
// finished piece is one contiguous run per KV head, and nothing is packed on the host.
//
// The attention tiles 64 query rows of one head against 64-key tiles on tensor cores (mma.sync,
// bf16 inputs, fp32 accumulation) with the online softmax of FlashAttention-2: the score matrix is
// never materialized, so memory stays O(rows) at any context. Queries are the layer's fp32 q
// (post-RoPE), rounded to bf16 on load, as torch's bf16 SDPA sees them.
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_PREFILL_ATTENTION_H_
#define FLUXION_KERNELS_CUDA_PREFILL_ATTENTION_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace fluxion::kernels::cuda {

// Where one layer's pages live on the device: pages_per_head pages per KV head, head-major, each
// 2 * page_tokens * head_dim bf16 (K rows then V rows).
struct LayerPages {
  void* base = nullptr;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t page_tokens = 16;
  int64_t pages_per_head = 0;
};

// Rows [first, first + rows) of the layer: k and v [rows][num_kv_heads][head_dim] fp32 (rows
// `row_stride` floats apart) rounded to bf16 into their pages. REQUIRES: first + rows <=
// pages_per_head * page_tokens.
cudaError_t WriteLayerPages(const LayerPages& pages, const float* k, const float* v,
                            int64_t row_stride, int64_t first, int64_t rows, cudaStream_t stream);

// Causal attention of query rows at positions [first, first + rows) over keys [0, first + rows)
// of `pages`: q [rows][num_heads][head_dim] fp32, out the same shape; query head h reads KV head
// h / (num_heads / num_kv_heads); softmax(scale * q.k). head_dim 32, 64 or 128 (InvalidValue
// otherwise). REQUIRES: the pages hold keys [0, first + rows).
cudaError_t CausalPrefillAttention(const LayerPages& pages, const float* q, int64_t first,
                                   int64_t rows, int64_t num_heads, float scale, float* out,
                                   cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_PREFILL_ATTENTION_H_
