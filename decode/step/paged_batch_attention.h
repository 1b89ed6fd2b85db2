// The attention of a batched decode step over the requests' host pages (docs/EXECUTOR.md): per
// layer, every request's policy decides which spans each of its KV heads attends
// (SparseAttention::BeginDecode), the whole batch's decisions become ONE PagedDecodeProblem that
// an attention backend computes (kernels/attention_backend.h: the CPU backend spreads it as
// (request, KV head, piece) tasks over the step's CpuPool), and each policy completes its step
// from the result (SparseAttention::FinishDecode). Policies decide, the backend executes: no
// policy calls a kernel to attend.
//
// The per-request phases run in parallel on the pool: the K/V appends across requests (the arena
// the pages come from is thread-safe), selection and completion across selection units (a KV
// head for policies whose heads are independent, else a whole request: a policy object is
// thread-compatible).
//
// Thread-compatible: one scheduler thread drives it.
#ifndef FLUXION_DECODE_STEP_PAGED_BATCH_ATTENTION_H_
#define FLUXION_DECODE_STEP_PAGED_BATCH_ATTENTION_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "decode/step/sparse_attention.h"
#include "kernels/attention_backend.h"
#include "kernels/cpu/cpu_pool.h"
#include "model/decode_step.h"
#include "model/model.h"

namespace fluxion::decode {

// Runs fn(i) for each request i of a step: on the pool when there is one and more than one
// request, else on the calling thread.
void ForEachRequest(const kernels::cpu::CpuPool* pool, int64_t n,
                    absl::FunctionRef<void(int64_t)> fn);
// The first error of a per-request phase, naming the request and layer; OK when none failed.
absl::Status FirstRequestError(absl::Span<const absl::Status> statuses, int layer);

// A step's selection units (request, unit): SparseAttention::units() of each request, so that
// selection and completion spread over the pool across requests and, for policies whose heads
// are independent, across one request's KV heads.
struct RequestUnit {
  int32_t request = 0;
  int32_t unit = 0;
};
void ListUnits(absl::Span<SparseAttention* const> attentions, std::vector<RequestUnit>* units);

// The batch's plans as one problem's CSR: for every (request i, KV head h) in order,
// append(i, h, plan, out) adds to `out` what pair (i, h) attends: its plan's spans, or a part of
// them. Sets p's kv, span_indptr, spans, num_spans and shape fields (not q, out or lse), pointing
// into `indptr` and `spans`. FailedPrecondition when the requests' pages lie in different arenas
// (one problem reads one arena).
using AppendPairSpans = absl::FunctionRef<void(
    int64_t request, int64_t kv_head, const std::vector<kernels::PageSpan>& plan,
    std::vector<kernels::PageSpan>* out)>;
// The pages view the batch's problem reads: every request's pages must lie in one arena (the
// first request's); FailedPrecondition naming the first that does not.
absl::StatusOr<kernels::PagedKvView> BatchArenaView(absl::Span<SparseAttention* const> attentions);

absl::Status BuildBatchProblem(absl::Span<SparseAttention* const> attentions,
                               const model::AttentionShape& shape, AppendPairSpans append,
                               std::vector<int64_t>* indptr, std::vector<kernels::PageSpan>* spans,
                               kernels::PagedDecodeProblem* p);

class PagedBatchAttention : public model::BatchAttention {
 public:
  // `backend` computes the problems (host memory: the reference or CPU backend); `pool` (may be
  // null: the calling thread) runs the per-request phases. Both must outlive this.
  PagedBatchAttention(kernels::AttentionBackend* backend, const kernels::cpu::CpuPool* pool,
                      const model::AttentionShape& shape)
      : backend_(backend), pool_(pool), shape_(shape) {}

  // The batch of the next step: row i is seqs[i], whose attention is attentions[i]. Both must
  // outlive the step. REQUIRES: equal sizes, attentions[i] == &seqs[i]->attention().
  void SetBatch(absl::Span<model::Sequence* const> seqs,
                absl::Span<SparseAttention* const> attentions) {
    seqs_ = seqs;
    attentions_ = attentions;
  }

  // Appends every row's K/V, selects, attends the batch as one problem, completes each policy's
  // step; after the last layer every sequence holds one more token. Errors name the request:
  // a request's own (BeginDecode's, e.g. ResourceExhausted for a page the arena lacks), or the
  // backend's; FailedPrecondition for rows outside host memory or requests whose pages lie in
  // different arenas. An error fails the step as a whole (the caches are then unspecified).
  absl::Status Attend(const model::LayerAttentionIo& io) override;

  // Rows the last problem attended, over every (request, KV head) pair.
  int64_t last_rows_attended() const { return last_rows_; }

 private:
  // The batch's plans as one problem over io's rows.
  absl::Status BuildProblem(const model::LayerAttentionIo& io, kernels::PagedDecodeProblem* p);

  kernels::AttentionBackend* const backend_;
  const kernels::cpu::CpuPool* const pool_;
  const model::AttentionShape shape_;
  absl::Span<model::Sequence* const> seqs_;
  absl::Span<SparseAttention* const> attentions_;
  int64_t last_rows_ = 0;
  // Scratch, grown to the largest step seen: no allocation once the batch's shape settles.
  std::vector<absl::Status> statuses_;
  std::vector<RequestUnit> units_;
  std::vector<int64_t> indptr_;
  std::vector<kernels::PageSpan> spans_;
  std::vector<float> lse_;
  std::vector<std::byte> workspace_;
};

}  // namespace fluxion::decode

#endif  // FLUXION_DECODE_STEP_PAGED_BATCH_ATTENTION_H_
