// The attention seam of a decode step (docs/EXECUTOR.md): one layer of paged decode attention for
// a whole batch, over the key rows a policy selected. The step executor builds one problem per
// layer; a backend (reference oracle, CPU, later CUDA) computes it. Backends compute, policies
// decide: a backend attends exactly the spans it is given, no more and no fewer.
//
// Problem layout (all pointers borrowed; shapes in [dims]):
//   q            [num_requests][num_qo_heads][head_dim]   fp32, post-RoPE, unscaled
//   kv           the arena every span's page lies in (kernels/paged_attention.h, bf16 pages)
//   span_indptr  [num_requests * num_kv_heads + 1]       CSR over pairs (request r, KV head h):
//   spans        [span_indptr[num_requests * num_kv_heads]]
//                pair p = r * num_kv_heads + h attends spans[span_indptr[p] .. span_indptr[p+1]),
//                rows of pages of that request's (layer, KV head h); an empty range is allowed.
//   out          [num_requests][num_qo_heads][head_dim]   fp32, softmax-normalised
//   lse          [num_requests][num_qo_heads]             fp32, NATURAL-base log-sum-exp of the
//                scaled scores sm_scale * q.k over the attended rows; -inf (and out = 0) for a
//                pair with no rows. (flashinfer returns base 2; a CUDA backend built on it
//                converts: lse_e = lse_2 * ln 2.) Two states over disjoint rows merge exactly
//                with MergeStates (kernels/{reference,cpu}/merge_state.h).
// GQA: query head j of a request reads KV head j / (num_qo_heads / num_kv_heads), so the group of
// KV head h is the contiguous query heads [h * group, (h + 1) * group).
//
// Memory: every pointer is in the memory the backend runs on: host memory for the reference and
// CPU backends; for a CUDA backend, device memory (kv.arena possibly mapped pinned host memory).
// So Supports() and WorkspaceBytes() look at shapes and num_spans only, never at the arrays. The
// spans being valid (page ids inside the arena, first_row + rows <= page_tokens, indptr monotone)
// is a REQUIRES of Run, which the reference backend checks (InvalidArgument) and the others
// assert only in debug builds.
//
// Thread-safety: a backend is thread-compatible (Run may use internal scratch); Supports and
// WorkspaceBytes are const and thread-safe.
#ifndef FLUXION_KERNELS_ATTENTION_BACKEND_H_
#define FLUXION_KERNELS_ATTENTION_BACKEND_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/paged_attention.h"

namespace fluxion::kernels {

struct PagedDecodeProblem {
  const float* q = nullptr;
  PagedKvView kv;
  const int64_t* span_indptr = nullptr;
  const PageSpan* spans = nullptr;
  int64_t num_spans = 0;  // == span_indptr[num_pairs()]: sizes without reading the arrays
  float* out = nullptr;
  float* lse = nullptr;
  int64_t num_requests = 0;
  int64_t num_qo_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  float sm_scale = 0.0f;

  int64_t group() const { return num_kv_heads > 0 ? num_qo_heads / num_kv_heads : 0; }
  int64_t num_pairs() const { return num_requests * num_kv_heads; }
};

// The shape checks every backend shares: InvalidArgument naming the first bad field (negative or
// zero counts, num_qo_heads not a multiple of num_kv_heads, head_dim != kv.head_dim, a missing
// pointer, a non-positive scale). A problem with no requests is valid (Run does nothing).
absl::Status ValidatePagedDecodeProblem(const PagedDecodeProblem& p);

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual absl::string_view name() const = 0;
  // OK, or InvalidArgument (ValidatePagedDecodeProblem) / Unimplemented naming the first
  // parameter this backend does not support (e.g. a head_dim its kernels lack).
  virtual absl::Status Supports(const PagedDecodeProblem& p) const = 0;
  // Scratch Run needs, in bytes, in the backend's memory. Depends on the shapes and num_spans
  // only: it bounds every span layout with those.
  virtual size_t WorkspaceBytes(const PagedDecodeProblem& p) const = 0;
  // Writes p.out and p.lse for every pair. REQUIRES: Supports(p).ok() and
  // workspace.size() >= WorkspaceBytes(p); the spans valid (see above).
  virtual absl::Status Run(const PagedDecodeProblem& p, absl::Span<std::byte> workspace) = 0;
};

}  // namespace fluxion::kernels

#endif  // FLUXION_KERNELS_ATTENTION_BACKEND_H_
