#include "decode/sparse/block_bounds.h"

#include <algorithm>

namespace fluxion::decode::sparse {

void BlockBounds::Update(const PagedKv& kv, int layer, int kv_head) {
  const int64_t pt = kv.shape().page_tokens, d = kv.shape().head_dim;
  const int64_t per = block_tokens_ / pt;
  const int64_t length = kv.length(layer);
  const int64_t pages = (length + pt - 1) / pt;
  const int64_t full_pages = length / pt;
  blocks_ = (pages + per - 1) / per;
  min_.resize(blocks_ * d);
  max_.resize(blocks_ * d);
  const float* page_min = kv.key_min(layer, kv_head);
  const float* page_max = kv.key_max(layer, kv_head);
  for (int64_t b = final_blocks_; b < blocks_; ++b) {
    float* lo = &min_[b * d];
    float* hi = &max_[b * d];
    const int64_t first = b * per, end = std::min(pages, first + per);
    std::copy(page_min + first * d, page_min + (first + 1) * d, lo);
    std::copy(page_max + first * d, page_max + (first + 1) * d, hi);
    for (int64_t p = first + 1; p < end; ++p) {
      for (int64_t i = 0; i < d; ++i) {
        lo[i] = std::min(lo[i], page_min[p * d + i]);
        hi[i] = std::max(hi[i], page_max[p * d + i]);
      }
    }
  }
  final_blocks_ = full_pages / per;
}

}  // namespace fluxion::decode::sparse
