// Quest min/max key bounds of one (layer, KV head) at a coarser block size than the page,
// derived from the page metadata (PagedKv::key_min/key_max) by element-wise min/max of the
// block's pages (../shared/docs/ALGORITHMS.md §2.4.4: store at 16, derive 32/64).
//
// Pages are append-only, so a block whose pages are all full never changes: Update() derives
// those once and re-derives only the trailing, still-filling block. Scanning b-token bounds then
// reads 2 x head_dim floats per b tokens instead of per page.
//
// Thread-compatible (one request's head).
#ifndef FLUXION_DECODE_SPARSE_BLOCK_BOUNDS_H_
#define FLUXION_DECODE_SPARSE_BLOCK_BOUNDS_H_

#include <cstdint>
#include <vector>

#include "decode/paged_kv.h"

namespace fluxion::decode::sparse {

class BlockBounds {
 public:
  // `block_tokens`: a multiple of the page size.
  explicit BlockBounds(int64_t block_tokens) : block_tokens_(block_tokens) {}

  // Brings the bounds up to kv.length(layer) tokens.
  void Update(const PagedKv& kv, int layer, int kv_head);

  int64_t block_tokens() const { return block_tokens_; }
  int64_t num_blocks() const { return blocks_; }
  const float* key_min() const { return min_.data(); }  // [num_blocks][head_dim]
  const float* key_max() const { return max_.data(); }

 private:
  int64_t block_tokens_;
  int64_t blocks_ = 0;       // blocks with at least one token
  int64_t final_blocks_ = 0; // leading blocks whose pages were all full when derived
  std::vector<float> min_, max_;
};

}  // namespace fluxion::decode::sparse

#endif  // FLUXION_DECODE_SPARSE_BLOCK_BOUNDS_H_
