#include "kernels/cuda/page_spans.h"

#include <algorithm>

namespace fluxion::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Blocks along x stride over a pair's pages; one pair per blockIdx.y.
__global__ void FillPageSpansKernel(const int32_t* slots, const int64_t* positions,
                                    const int64_t* indptr, int64_t kv_heads, int64_t max_pages,
                                    int64_t page_tokens, PageSpan* spans) {
  const int64_t pair = blockIdx.y;
  const int64_t row = pair / kv_heads, head = pair % kv_heads;
  const int64_t begin = indptr[pair], count = indptr[pair + 1] - begin;
  const int64_t context = positions[row] + 1;
  const int64_t first_page = (static_cast<int64_t>(slots[row]) * kv_heads + head) * max_pages;
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < count;
       j += int64_t{gridDim.x} * blockDim.x) {
    PageSpan s;
    s.page = static_cast<int32_t>(first_page + j);
    s.first_row = 0;
    s.rows = static_cast<int32_t>(min(page_tokens, context - j * page_tokens));
    spans[begin + j] = s;
  }
}

}  // namespace

cudaError_t FillPageSpans(const int32_t* slots, const int64_t* positions, const int64_t* indptr,
                          int64_t rows, int64_t kv_heads, int64_t max_pages, int64_t page_tokens,
                          PageSpan* spans, cudaStream_t stream) {
  const int64_t pairs = rows * kv_heads;
  if (pairs == 0) return cudaSuccess;
  if (pairs > 65535 || page_tokens <= 0) return cudaErrorInvalidValue;
  // Enough blocks along x for the longest pair at one page a thread (a 128K context at 16 tokens
  // a page is 8192 pages: 32 blocks); the grid-stride loop covers any remainder.
  const int64_t x_blocks = std::min<int64_t>((max_pages + kThreads - 1) / kThreads, 1024);
  FillPageSpansKernel<<<dim3(static_cast<unsigned>(std::max<int64_t>(x_blocks, 1)),
                             static_cast<unsigned>(pairs)),
                        kThreads, 0, stream>>>(slots, positions, indptr, kv_heads, max_pages,
                                               page_tokens, spans);
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
