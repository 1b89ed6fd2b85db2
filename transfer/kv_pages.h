// The KV page layout on the wire (docs/PROTOCOL.md "KV page layout", docs/KV_LAYOUT.md), shared
// by the node that writes pages (prefill) and the node that owns them (decode):
//
//   - a page holds `page_tokens` tokens of one layer and one KV head: K then V, each
//     [page_tokens][head_dim] bf16; rows past the prompt's end are zero;
//   - a request's pages are listed as extents of page ids; their concatenation, in
//     PAGE_ORDER_LAYER_HEAD_PAGE, maps entry (layer * num_kv_heads + head) * pages_per_head + i
//     onto logical page i of (layer, head);
//   - the checksum of a layer is CRC-32C over the content bytes of its pages in that order.
//
// Thread-safe: pure functions and value types.
#ifndef FLUXION_TRANSFER_KV_PAGES_H_
#define FLUXION_TRANSFER_KV_PAGES_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace fluxion::transfer {

struct KvPageGeometry {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t page_tokens = 16;

  // K then V of one page, bf16.
  size_t content_bytes() const { return 2 * static_cast<size_t>(page_tokens * head_dim) * 2; }
  int64_t pages_per_head(int64_t tokens) const { return (tokens + page_tokens - 1) / page_tokens; }
  int64_t pages_per_layer(int64_t tokens) const { return num_kv_heads * pages_per_head(tokens); }
  int64_t total_pages(int64_t tokens) const { return num_layers * pages_per_layer(tokens); }
};

// A run of page ids (fluxion.v1.PageExtent).
struct PageIdRun {
  uint64_t first = 0;
  uint64_t count = 0;
};

// The page ids of `runs`, concatenated. InvalidArgument when a run is empty, when the total is
// not `expected` pages, or when a page id reaches `arena_pages` (a page the arena does not have).
absl::StatusOr<std::vector<uint64_t>> ExpandPageRuns(absl::Span<const PageIdRun> runs,
                                                     uint64_t expected, uint64_t arena_pages);

// Packs `tokens` rows of one layer's K and V (fp32, [tokens][num_kv_heads][head_dim], rows
// `row_stride` floats apart) into the layer's pages, rounded to bf16, head-major then page:
// dst holds pages_per_layer(tokens) pages of content_bytes() each, back to back. Unused rows of
// each head's last page are zero.
void PackLayerPages(const KvPageGeometry& g, int64_t tokens, const float* k, const float* v,
                    int64_t row_stride, uint8_t* dst);

// Packs rows [first, end) of one layer (k, v point at row `first`) into the layer's pages laid
// out as PackLayerPages does for a `tokens`-token prompt. Bytes of other rows are left as they
// are, so packing a prompt chunk by chunk into a zeroed buffer gives PackLayerPages' result.
void PackLayerRows(const KvPageGeometry& g, int64_t tokens, int64_t first, int64_t end,
                   const float* k, const float* v, int64_t row_stride, uint8_t* dst);

// Packs pages [first_page, end_page) of every KV head of one layer of a `tokens`-token prompt
// (k, v point at row 0) into `dst` as [head][end_page - first_page] pages: what a staging slot
// holds (prefill/staging_ring.h). Rows past the prompt's end are zeroed, so the slot needs no
// clearing. REQUIRES first_page < end_page <= pages_per_head(tokens).
void PackPageRange(const KvPageGeometry& g, int64_t tokens, int64_t first_page, int64_t end_page,
                   const float* k, const float* v, int64_t row_stride, uint8_t* dst);

}  // namespace fluxion::transfer

#endif  // FLUXION_TRANSFER_KV_PAGES_H_
