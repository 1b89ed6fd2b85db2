#include "kernels/cuda/page_meta_encode.h"

#include <cuda_bf16.h>

namespace fluxion::kernels::cuda {
namespace {

// One block per (KV head, page), one thread per key element.
__global__ void EncodePageMetaKernel(LayerPages pages, int64_t tokens, int64_t first_page,
                                     __nv_bfloat16* __restrict__ dst) {
  const int64_t d = pages.head_dim, pt = pages.page_tokens, pph = pages.pages_per_head;
  const int64_t h = blockIdx.y, i = first_page + blockIdx.x, t = threadIdx.x;
  const int64_t index = h * pph + i;
  const __nv_bfloat16* keys = static_cast<const __nv_bfloat16*>(pages.base) + index * 2 * pt * d;
  const int64_t rows = tokens - i * pt < pt ? tokens - i * pt : pt;
  float mn = INFINITY, mx = -INFINITY;
  for (int64_t r = 0; r < rows; ++r) {
    const float x = __bfloat162float(keys[r * d + t]);
    mn = x < mn ? x : mn;  // std::min(mn, x)
    mx = mx < x ? x : mx;  // std::max(mx, x)
  }
  __nv_bfloat16* record = dst + index * 2 * d;
  record[t] = __float2bfloat16_rn(mn);  // exact: a bf16 value (or +-inf for no row)
  record[d + t] = __float2bfloat16_rn(mx);
}

}  // namespace

cudaError_t EncodePageMeta(const LayerPages& pages, int64_t tokens, int64_t first_page,
                           int64_t end_page, void* dst, cudaStream_t stream) {
  if (pages.head_dim < 1 || pages.head_dim > 1024 || pages.page_tokens < 1 || first_page < 0 ||
      pages.num_kv_heads < 1 || pages.num_kv_heads > 65535 || tokens < 0) {
    return cudaErrorInvalidValue;
  }
  if (end_page > pages.pages_per_head) end_page = pages.pages_per_head;
  if (end_page <= first_page) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(end_page - first_page),
                  static_cast<unsigned>(pages.num_kv_heads));
  EncodePageMetaKernel<<<grid, static_cast<unsigned>(pages.head_dim), 0, stream>>>(
      pages, tokens, first_page, static_cast<__nv_bfloat16*>(dst));
  return cudaGetLastError();
}

}  // namespace fluxion::kernels::cuda
