#include "decode/step/paged_batch_attention.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace fluxion::decode {
void ForEachRequest(const kernels::cpu::CpuPool* pool, int64_t n,
                    absl::FunctionRef<void(int64_t)> fn) {
  if (pool == nullptr || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
  } else {
    pool->ParallelFor(n, fn);
  }
}

void ListUnits(absl::Span<SparseAttention* const> attentions, std::vector<RequestUnit>* units) {
  units->clear();
  for (size_t i = 0; i < attentions.size(); ++i) {
    for (int u = 0; u < attentions[i]->units(); ++u) {
      units->push_back({static_cast<int32_t>(i), u});
    }
  }
}

absl::Status FirstRequestError(absl::Span<const absl::Status> statuses, int layer) {
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (!statuses[i].ok()) {
      return absl::Status(statuses[i].code(), absl::StrCat("request ", i, ", layer ", layer, ": ",
                                                           statuses[i].message()));
    }
  }
  return absl::OkStatus();
}

absl::Status PagedBatchAttention::Attend(const model::LayerAttentionIo& io) {
  if (!io.host_memory) {
    return absl::FailedPreconditionError(
        "the host-page batch attention reads q/k/v in host memory; a device DenseOps needs the "
        "hybrid executor");
  }
  if (io.rows != static_cast<int64_t>(attentions_.size()) || seqs_.size() != attentions_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("attention for ", io.rows, " rows but ",
                                                   attentions_.size(), " requests"));
  }
  const int64_t d = shape_.head_dim, hq = shape_.num_heads, hkv = shape_.num_kv_heads;
  const int64_t q_row = hq * d, kv_row = hkv * d;

  // 1. The step's K/V land in the pages, then every policy decides.
  statuses_.assign(io.rows, absl::OkStatus());
  ForEachRequest(pool_, io.rows, [&](int64_t i) {
    statuses_[i] = attentions_[i]->AppendToken(io.layer, io.positions[i], io.k + i * kv_row,
                                               io.v + i * kv_row);
  });
  FLUXION_RETURN_IF_ERROR(FirstRequestError(statuses_, io.layer));
  ListUnits(attentions_, &units_);
  ForEachRequest(pool_, static_cast<int64_t>(units_.size()), [&](int64_t j) {
    const RequestUnit& u = units_[j];
    attentions_[u.request]->SelectUnit(u.unit, io.q + u.request * q_row);
  });

  // 2. One problem for the batch, computed by the backend.
  kernels::PagedDecodeProblem p;
  p.q = io.q;
  p.out = io.out;
  FLUXION_RETURN_IF_ERROR(BuildProblem(io, &p));
  FLUXION_RETURN_IF_ERROR(backend_->Supports(p));
  const size_t workspace = backend_->WorkspaceBytes(p);
  if (workspace_.size() < workspace) workspace_.resize(workspace);
  FLUXION_RETURN_IF_ERROR(backend_->Run(p, absl::MakeSpan(workspace_)));

  // 3. Every policy completes its step from the result.
  ForEachRequest(pool_, static_cast<int64_t>(units_.size()), [&](int64_t j) {
    const RequestUnit& u = units_[j];
    attentions_[u.request]->FinishUnit(u.unit, io.q + u.request * q_row,
                                       io.out + u.request * q_row, lse_.data() + u.request * hq);
  });
  // 4. The error guard's exact checks of this layer, on the final outputs (sparse_attention.h).
  ForEachRequest(pool_, io.rows, [&](int64_t i) {
    attentions_[i]->CheckLayer(io.q + i * q_row, io.out + i * q_row);
  });
  if (io.layer == shape_.num_layers - 1) {
    for (model::Sequence* seq : seqs_) seq->AdvanceLength(1);
  }
  return absl::OkStatus();
}

absl::StatusOr<kernels::PagedKvView> BatchArenaView(
    absl::Span<SparseAttention* const> attentions) {
  const kernels::PagedKvView view = attentions[0]->kv().view();
  for (size_t i = 1; i < attentions.size(); ++i) {
    const kernels::PagedKvView other = attentions[i]->kv().view();
    if (other.arena != view.arena || other.page_bytes != view.page_bytes ||
        other.page_tokens != view.page_tokens) {
      return absl::FailedPreconditionError(absl::StrCat(
          "request ", i, "'s pages lie in another arena than request 0's: one batch attends "
          "pages of one arena"));
    }
  }
  return view;
}

absl::Status BuildBatchProblem(absl::Span<SparseAttention* const> attentions,
                               const model::AttentionShape& shape, AppendPairSpans append,
                               std::vector<int64_t>* indptr, std::vector<kernels::PageSpan>* spans,
                               kernels::PagedDecodeProblem* p) {
  FLUXION_ASSIGN_OR_RETURN(const kernels::PagedKvView view, BatchArenaView(attentions));
  indptr->assign(1, 0);
  spans->clear();
  for (size_t i = 0; i < attentions.size(); ++i) {
    for (int64_t h = 0; h < shape.num_kv_heads; ++h) {
      append(static_cast<int64_t>(i), h, attentions[i]->head_spans(h), spans);
      indptr->push_back(static_cast<int64_t>(spans->size()));
    }
  }
  p->kv = view;
  p->span_indptr = indptr->data();
  p->spans = spans->data();
  p->num_spans = static_cast<int64_t>(spans->size());
  p->num_requests = static_cast<int64_t>(attentions.size());
  p->num_qo_heads = shape.num_heads;
  p->num_kv_heads = shape.num_kv_heads;
  p->head_dim = shape.head_dim;
  p->sm_scale = shape.scale;
  return absl::OkStatus();
}

absl::Status PagedBatchAttention::BuildProblem(const model::LayerAttentionIo& io,
                                               kernels::PagedDecodeProblem* p) {
  FLUXION_RETURN_IF_ERROR(BuildBatchProblem(
      attentions_, shape_,
      [](int64_t, int64_t, const std::vector<kernels::PageSpan>& plan,
         std::vector<kernels::PageSpan>* out) { out->insert(out->end(), plan.begin(), plan.end()); },
      &indptr_, &spans_, p));
  last_rows_ = 0;
  for (const kernels::PageSpan& s : spans_) last_rows_ += s.rows;
  lse_.resize(io.rows * shape_.num_heads);
  p->lse = lse_.data();
  return absl::OkStatus();
}

}  // namespace fluxion::decode
