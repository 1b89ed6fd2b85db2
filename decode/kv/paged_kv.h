// One request's KV cache in the decode node's host arena: page tables per (layer, KV head), the
// token count per layer, and per-page selection metadata (Quest's element-wise key min/max).
//
// Logical page i of (layer, kv_head) holds tokens [i * page_tokens, (i + 1) * page_tokens).
// Pages are reserved from the arena all-or-nothing: for the prompt at creation, then one page per
// (layer, KV head) whenever a layer's token count crosses a page boundary. Every page is held in
// a decode::Reservation, so everything goes back to the arena (and the admission's waiters are
// woken) on destruction, whatever path ends the sequence.
//
// Thread-compatible: one request is driven by one thread at a time; different requests may run
// concurrently (the arena is thread-safe).
#ifndef FLUXION_DECODE_KV_PAGED_KV_H_
#define FLUXION_DECODE_KV_PAGED_KV_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/half.h"
#include "decode/kv/kv_admission.h"
#include "decode/kv/kv_arena.h"
#include "kernels/paged_attention.h"

namespace fluxion::decode {

struct KvShape {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t page_tokens = 16;

  size_t page_bytes() const { return 2 * page_tokens * head_dim * sizeof(bf16); }
};

// Per-page key bounds of a whole prompt, as the policies read them: entry
// layer * num_kv_heads + head holds [pages_per_head][head_dim] fp32 values (transfer/page_meta.h:
// the bounds of each page's valid rows of stored bf16 keys).
struct PageBounds {
  std::vector<std::vector<float>> min, max;
};

class PagedKv {
 public:
  // An empty sequence whose pages come from `arena`, which must outlive it and have pages of at
  // least shape.page_bytes(). `admission` (may be null) is woken whenever its pages come back.
  // InvalidArgument for a mismatched arena.
  static absl::StatusOr<std::unique_ptr<PagedKv>> Create(KvArena* arena, const KvShape& shape,
                                                         KvAdmission* admission = nullptr);
  // A sequence of `tokens` tokens per layer whose pages are already reserved and filled (the
  // prompt's KV written by a prefill node into pages the decode node reserved). `pages` lists
  // every page in PAGE_ORDER_LAYER_HEAD_PAGE: entry (layer * num_kv_heads + head) * P + i is
  // logical page i of (layer, head), P = ceil(tokens / page_tokens). `reservation` holds them;
  // the sequence owns it from now on (also when this call fails, when it dies with the call)
  // and grows from the same arena and admission. `bounds` is the pages' metadata, from the
  // prefill node (shipped and checked, decode/serving/generate_call_steps.h) or ComputeBounds;
  // Adopt reads no page. InvalidArgument for a page outside the arena or bounds of the wrong size.
  static absl::StatusOr<std::unique_ptr<PagedKv>> Adopt(Reservation reservation,
                                                        const KvShape& shape,
                                                        absl::Span<const int32_t> pages,
                                                        int64_t tokens, PageBounds bounds);
  // The bounds of pages already filled (listed as for Adopt), read from the arena: one read of
  // every page's keys. InvalidArgument for a page outside the arena or a wrong page count.
  static absl::StatusOr<PageBounds> ComputeBounds(const KvArena& arena, const KvShape& shape,
                                                  absl::Span<const int32_t> pages,
                                                  int64_t tokens);
  ~PagedKv() = default;
  PagedKv(const PagedKv&) = delete;
  PagedKv& operator=(const PagedKv&) = delete;

  // Appends `n` tokens of K/V for `layer` (rounded to bf16):
  //   k, v: [n][num_kv_heads][head_dim], row `row_stride` floats apart (>= num_kv_heads*head_dim).
  // ResourceExhausted (nothing appended) when the arena cannot supply the pages needed.
  absl::Status Append(int layer, int64_t n, const float* k, const float* v, int64_t row_stride);

  const KvShape& shape() const { return shape_; }
  int64_t length(int layer) const { return lengths_[layer]; }
  // Physical page ids of (layer, kv_head), in token order.
  const std::vector<int32_t>& pages(int layer, int kv_head) const {
    return pages_[Index(layer, kv_head)];
  }
  const KvArena& arena() const { return *arena_; }
  kernels::PagedKvView view() const {
    return {arena_->base(), arena_->page_bytes(), shape_.page_tokens, shape_.head_dim};
  }

  // Per-page metadata of (layer, kv_head), [pages][head_dim] fp32: element-wise min and max of
  // the page's keys (Quest's bound). Covers the valid tokens of partial pages. (No mean key: no
  // policy reads one; transfer/page_meta.h says what shipping one would take.)
  const float* key_min(int layer, int kv_head) const { return meta_[Index(layer, kv_head)].min.data(); }
  const float* key_max(int layer, int kv_head) const { return meta_[Index(layer, kv_head)].max.data(); }

  // Pages currently reserved by this sequence.
  int64_t reserved_pages() const;

 private:
  struct PageMeta {
    std::vector<float> min, max;  // [pages][head_dim]
  };
  PagedKv(KvArena* arena, const KvShape& shape, KvAdmission* admission);
  size_t Index(int layer, int kv_head) const {
    return static_cast<size_t>(layer) * shape_.num_kv_heads + kv_head;
  }

  KvArena* const arena_;
  KvAdmission* const admission_;  // woken when pages come back; may be null
  const KvShape shape_;
  std::vector<int64_t> lengths_;               // [layer]
  std::vector<std::vector<int32_t>> pages_;    // [layer * kv_heads + head] -> page ids
  std::vector<PageMeta> meta_;                 // same index
  std::vector<Reservation> reserved_;          // the prompt's pages, then each page group added
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_KV_PAGED_KV_H_
