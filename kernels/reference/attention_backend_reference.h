// The scalar oracle of the attention seam (kernels/attention_backend.h): reference::PagedAttention
// (double accumulation) for every (request, KV head) pair in turn. Every other backend is held to
// it by kernels/attention_backend_test.cc. Deliberately slow; also checks the spans themselves
// (InvalidArgument naming the bad one), which the fast backends assert only in debug builds.
#ifndef FLUXION_KERNELS_REFERENCE_ATTENTION_BACKEND_REFERENCE_H_
#define FLUXION_KERNELS_REFERENCE_ATTENTION_BACKEND_REFERENCE_H_

#include <memory>

#include "kernels/attention_backend.h"

namespace fluxion::kernels {

std::unique_ptr<AttentionBackend> NewReferenceAttentionBackend();

// InvalidArgument naming the first inconsistent entry of p.span_indptr / p.spans (host memory):
// indptr not starting at 0, decreasing or not ending at num_spans; a span with a negative page or
// rows, or reaching past page_tokens. Shared by the reference backend and by tests.
absl::Status ValidateSpans(const PagedDecodeProblem& p);

}  // namespace fluxion::kernels

#endif  // FLUXION_KERNELS_REFERENCE_ATTENTION_BACKEND_REFERENCE_H_
