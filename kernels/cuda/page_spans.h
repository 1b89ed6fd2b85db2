// The span list of full attention over HBM pages (decode/device/hbm_full_attention.h), built on the
// device: the host computes only the per-(row, KV head) offsets (rows x KV heads + 1 values) and
// this kernel writes the spans, so a step's host work and upload no longer grow with the context
// (at 16 x 32K or 4 x 128K the host-built list was ~262K spans, ~3 MB, every step).
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_PAGE_SPANS_H_
#define FLUXION_KERNELS_CUDA_PAGE_SPANS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/paged_attention.h"

namespace fluxion::kernels::cuda {

// For every row i < rows and KV head h < kv_heads (pair p = i * kv_heads + h), whose context is
// positions[i] + 1 tokens in the pages (slots[i] * kv_heads + h) * max_pages + j, j = 0, 1, ...:
// spans[indptr[p] + j] = {that page, 0, min(page_tokens, context - j * page_tokens)} for
// j < indptr[p + 1] - indptr[p]. slots [rows], positions [rows], indptr [rows * kv_heads + 1],
// spans [indptr[rows * kv_heads]], all device memory. REQUIRES (the caller checked):
// indptr[p + 1] - indptr[p] == ceil((positions[i] + 1) / page_tokens) <= max_pages.
cudaError_t FillPageSpans(const int32_t* slots, const int64_t* positions, const int64_t* indptr,
                          int64_t rows, int64_t kv_heads, int64_t max_pages, int64_t page_tokens,
                          PageSpan* spans, cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_PAGE_SPANS_H_
