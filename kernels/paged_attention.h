// Decode attention over host KV pages: the kernel every sparse policy runs on.
//
// Page layout (docs/KV_LAYOUT.md): page `id` of an arena starts at arena + id * page_bytes and
// holds K then V of `page_tokens` tokens of one layer and one KV head, each bf16
// [page_tokens][head_dim]. A call covers one (request, layer, KV head) and all `group` query heads
// that share it (GQA), so each K/V row is read from memory once for the whole group.
//
// Outputs are partial attention states: the softmax-normalised output over the rows attended and
// the log-sum-exp (natural base) of their scaled scores. Two states over disjoint row sets merge
// exactly with MergeAttentionStates; a state over no rows has lse = -inf and output 0.
#ifndef FLUXION_KERNELS_PAGED_ATTENTION_H_
#define FLUXION_KERNELS_PAGED_ATTENTION_H_

#include <cstddef>
#include <cstdint>

#include "common/half.h"

namespace fluxion::kernels {

struct PagedKvView {
  const uint8_t* arena = nullptr;
  size_t page_bytes = 0;     // >= 2 * page_tokens * head_dim * sizeof(bf16)
  int64_t page_tokens = 16;
  int64_t head_dim = 0;

  const bf16* keys(int32_t page) const {
    return reinterpret_cast<const bf16*>(arena + static_cast<size_t>(page) * page_bytes);
  }
  const bf16* values(int32_t page) const { return keys(page) + page_tokens * head_dim; }
};

struct DecodeQuery {
  const float* q = nullptr;  // [group][head_dim], post-RoPE, unscaled
  int64_t group = 1;         // query heads sharing this KV head
  float scale = 0.0f;        // softmax scale (1/sqrt(head_dim))
};

struct AttentionState {
  float* out = nullptr;  // [group][head_dim]
  float* lse = nullptr;  // [group], natural-base log-sum-exp of scaled scores; -inf if empty
};

// A run of consecutive tokens inside one page: rows [first_row, first_row + rows).
struct PageSpan {
  int32_t page = 0;
  int32_t first_row = 0;
  int32_t rows = 0;
};

}  // namespace fluxion::kernels

#endif  // FLUXION_KERNELS_PAGED_ATTENTION_H_
