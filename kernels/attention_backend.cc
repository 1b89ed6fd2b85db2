#include "kernels/attention_backend.h"

#include "absl/strings/str_cat.h"

namespace fluxion::kernels {

absl::Status ValidatePagedDecodeProblem(const PagedDecodeProblem& p) {
  auto bad = [](auto... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (p.num_requests < 0) return bad("num_requests ", p.num_requests, " is negative");
  if (p.num_qo_heads <= 0) return bad("num_qo_heads ", p.num_qo_heads, " is not positive");
  if (p.num_kv_heads <= 0) return bad("num_kv_heads ", p.num_kv_heads, " is not positive");
  if (p.num_qo_heads % p.num_kv_heads != 0) {
    return bad("num_qo_heads ", p.num_qo_heads, " is not a multiple of num_kv_heads ",
               p.num_kv_heads);
  }
  if (p.head_dim <= 0) return bad("head_dim ", p.head_dim, " is not positive");
  if (p.kv.head_dim != p.head_dim) {
    return bad("kv.head_dim ", p.kv.head_dim, " differs from head_dim ", p.head_dim);
  }
  if (!(p.sm_scale > 0.0f)) return bad("sm_scale ", p.sm_scale, " is not positive");
  if (p.num_spans < 0) return bad("num_spans ", p.num_spans, " is negative");
  if (p.num_requests == 0) return absl::OkStatus();
  if (p.q == nullptr || p.out == nullptr || p.lse == nullptr || p.span_indptr == nullptr) {
    return bad("q, out, lse and span_indptr must all be set");
  }
  if (p.num_spans > 0) {
    if (p.spans == nullptr) return bad("spans is null but num_spans is ", p.num_spans);
    if (p.kv.arena == nullptr) return bad("kv.arena is null but num_spans is ", p.num_spans);
    if (p.kv.page_tokens <= 0) return bad("kv.page_tokens ", p.kv.page_tokens, " is not positive");
    const size_t page_min = 2 * static_cast<size_t>(p.kv.page_tokens) * p.head_dim * sizeof(bf16);
    if (p.kv.page_bytes < page_min) {
      return bad("kv.page_bytes ", p.kv.page_bytes, " is below the ", page_min,
                 " that K and V of ", p.kv.page_tokens, " tokens need");
    }
  }
  return absl::OkStatus();
}

}  // namespace fluxion::kernels
