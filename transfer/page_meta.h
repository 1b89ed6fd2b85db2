// Per-page selection metadata on the wire (docs/PROTOCOL.md "Page metadata", docs/KV_LAYOUT.md):
// what the decode node's policies read about each KV page (Quest's element-wise key bounds),
// computed by the prefill node from the pages it sends and written next to them, so that the
// decode node does not re-read the whole context to rebuild it when a request lands.
//
// Format version 1 (kPageMetaVersion). The stream holds num_layers blocks, layer l's block at
// offset l * PageMetaLayerBytes(); inside a block, one record per (KV head h, page i) at offset
// (h * pages_per_head + i) * PageMetaRecordBytes(): key_min[head_dim] then key_max[head_dim],
// bf16 little-endian. key_min[t] / key_max[t] are the smallest / largest key element t over the
// page's valid rows (tokens [i * page_tokens, min((i + 1) * page_tokens, tokens))) of the stored
// bf16 keys: min and max of bf16 values are bf16 values, so the record is exact. Signed zeros
// compare equal, so either sign may stand for a zero bound (the same bound for Quest's score).
// The checksum of a block is CRC-32C over its bytes (PrefillResponse.page_meta.layer_checksums).
//
// No mean key: the mean of bf16 values is not a bf16 value (it would need fp32 and one fixed
// summation order that the GPU path reproduces bit for bit) and no policy reads it.
//
// Thread-safe: pure functions. The GPU prefill fills the same blocks (same bytes) from its
// device copy of the pages.
#ifndef FLUXION_TRANSFER_PAGE_META_H_
#define FLUXION_TRANSFER_PAGE_META_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/half.h"
#include "transfer/kv_pages.h"

namespace fluxion::transfer {

inline constexpr uint32_t kPageMetaVersion = 1;

// Bytes of one page's record: key_min and key_max, head_dim bf16 each.
inline uint64_t PageMetaRecordBytes(const KvPageGeometry& g) {
  return 4 * static_cast<uint64_t>(g.head_dim);
}
inline uint64_t PageMetaLayerBytes(const KvPageGeometry& g, int64_t tokens) {
  return static_cast<uint64_t>(g.pages_per_layer(tokens)) * PageMetaRecordBytes(g);
}
inline uint64_t PageMetaBytes(const KvPageGeometry& g, int64_t tokens) {
  return static_cast<uint64_t>(g.num_layers) * PageMetaLayerBytes(g, tokens);
}

// Element-wise bounds of `rows` keys ([rows][head_dim] bf16 at `keys`), as fp32 (exact):
// min[t] = smallest keys[r][t], max[t] = largest, folded in row order from +inf / -inf with
// std::min / std::max (what decode::PagedKv::Append does token by token). REQUIRES rows >= 1.
void PageKeyBounds(int64_t head_dim, int64_t rows, const bf16* keys, float* min, float* max);

// Layer block of a `tokens`-token prompt from that layer's packed pages (`layer_pages`: the
// PackLayerPages layout, pages_per_layer(tokens) pages of content_bytes() each) into `dst`
// (PageMetaLayerBytes(g, tokens) bytes).
void EncodeLayerPageMeta(const KvPageGeometry& g, int64_t tokens, const uint8_t* layer_pages,
                         uint8_t* dst);
// The records of pages [first_page, end_page) of every KV head only (the rest of `dst` is left as
// it is): a layer encoded range by range, as its pages complete, equals EncodeLayerPageMeta.
void EncodePageMetaRange(const KvPageGeometry& g, int64_t tokens, const uint8_t* layer_pages,
                         int64_t first_page, int64_t end_page, uint8_t* dst);
// The same records from pages packed as PackPageRange packs them (`pages`: [head][end_page -
// first_page] pages), written at their places in the layer block `dst`.
void EncodePackedPageMeta(const KvPageGeometry& g, int64_t tokens, const uint8_t* pages,
                          int64_t first_page, int64_t end_page, uint8_t* dst);

// Decodes a layer block (`block`, PageMetaLayerBytes(g, tokens) bytes: the caller checked the
// size) into fp32 bounds: min[h] and max[h] each point at [pages_per_head][head_dim] floats for
// KV head h (min.size() == max.size() == num_kv_heads). InvalidArgument naming head, page and
// element for a value that is not finite or a min above its max: a peer's bug or a hostile
// peer, never data this function may hand on.
absl::Status DecodeLayerPageMeta(const KvPageGeometry& g, int64_t tokens, const uint8_t* block,
                                 absl::Span<float* const> min, absl::Span<float* const> max);

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_PAGE_META_H_
