#include "kernels/reference/attention_backend_reference.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/reference/reference_ops.h"

namespace fluxion::kernels {
namespace {

class ReferenceAttentionBackend : public AttentionBackend {
 public:
  absl::string_view name() const override { return "reference"; }

  absl::Status Supports(const PagedDecodeProblem& p) const override {
    return ValidatePagedDecodeProblem(p);
  }

  size_t WorkspaceBytes(const PagedDecodeProblem& p) const override { return 0; }

  absl::Status Run(const PagedDecodeProblem& p, absl::Span<std::byte> workspace) override {
    FLUXION_RETURN_IF_ERROR(Supports(p));
    FLUXION_RETURN_IF_ERROR(ValidateSpans(p));
    const int64_t group = p.group(), d = p.head_dim;
    for (int64_t r = 0; r < p.num_requests; ++r) {
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        const int64_t pair = r * p.num_kv_heads + h;
        const int64_t head0 = r * p.num_qo_heads + h * group;
        const int64_t begin = p.span_indptr[pair], end = p.span_indptr[pair + 1];
        reference::PagedAttention(p.kv, p.spans + begin, end - begin,
                                  {p.q + head0 * d, group, p.sm_scale},
                                  {p.out + head0 * d, p.lse + head0});
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<AttentionBackend> NewReferenceAttentionBackend() {
  return std::make_unique<ReferenceAttentionBackend>();
}

absl::Status ValidateSpans(const PagedDecodeProblem& p) {
  if (p.num_requests == 0) return absl::OkStatus();
  const int64_t pairs = p.num_pairs();
  if (p.span_indptr[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("span_indptr[0] is ", p.span_indptr[0], ", not 0"));
  }
  for (int64_t i = 0; i < pairs; ++i) {
    if (p.span_indptr[i + 1] < p.span_indptr[i]) {
      return absl::InvalidArgumentError(absl::StrCat("span_indptr decreases at pair ", i));
    }
  }
  if (p.span_indptr[pairs] != p.num_spans) {
    return absl::InvalidArgumentError(absl::StrCat("span_indptr ends at ", p.span_indptr[pairs],
                                                   " but num_spans is ", p.num_spans));
  }
  for (int64_t s = 0; s < p.num_spans; ++s) {
    const PageSpan& span = p.spans[s];
    if (span.page < 0 || span.first_row < 0 || span.rows < 0 ||
        int64_t{span.first_row} + span.rows > p.kv.page_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("span ", s, " (page ", span.page, ", rows [", span.first_row, ", ",
                       int64_t{span.first_row} + span.rows, ")) is outside a page of ",
                       p.kv.page_tokens, " tokens"));
    }
  }
  return absl::OkStatus();
}

}  // namespace fluxion::kernels
