// The per-page selection metadata of the prefill node's pages, computed on the device (issue 15):
// the records of transfer/page_meta.h (format version 1: per (KV head, page) key_min[head_dim]
// then key_max[head_dim], bf16) from the pages WriteLayerPages wrote (kernels/cuda/
// prefill_attention.h), so the host never reads the pages for them.
//
// Bit-identical to transfer::EncodePageMetaRange: each element folds the page's valid rows in
// row order from +inf / -inf with the comparisons std::min / std::max make, so signed zeros and
// ties resolve the same way, and min / max of bf16 values are bf16 values (no rounding).
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_PAGE_META_ENCODE_H_
#define FLUXION_KERNELS_CUDA_PAGE_META_ENCODE_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/prefill_attention.h"

namespace fluxion::kernels::cuda {

// Records of pages [first_page, end_page) of every KV head of `pages` (a `tokens`-token prompt's
// layer) into `dst`, the layer's block on the device (record (h * pages_per_head + i) at
// (h * pages_per_head + i) * 4 * head_dim bytes); the other records are left as they are.
// head_dim <= 1024; 0 <= first_page; end_page clamped to pages_per_head. InvalidValue otherwise.
cudaError_t EncodePageMeta(const LayerPages& pages, int64_t tokens, int64_t first_page,
                           int64_t end_page, void* dst, cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_PAGE_META_ENCODE_H_
