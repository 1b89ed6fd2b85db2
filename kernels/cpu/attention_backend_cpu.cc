#include "kernels/cpu/attention_backend_cpu.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/merge_state.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/paged_attention_impl.h"

namespace fluxion::kernels::cpu {
namespace {

// One kernel call: spans [span_begin, span_end) of `pair`, into the output (slot < 0) or into
// partial state `slot` of the workspace.
struct Task {
  int64_t pair, span_begin, span_end, slot;
};
// A pair cut into `count` pieces, whose partial states are slots [first_slot, first_slot + count).
struct Merge {
  int64_t pair, first_slot, count;
};

constexpr size_t kAlign = 64;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Pieces of all pairs together: at most one per pair plus one per kPieceRows rows, and the rows
// are at most num_spans * page_tokens.
int64_t MaxTasks(const PagedDecodeProblem& p) {
  const int64_t max_rows = p.num_spans * std::max<int64_t>(p.kv.page_tokens, 0);
  return p.num_pairs() + max_rows / kPieceRows;
}

struct Layout {
  size_t tasks, merges, outs, lses, total;
};

Layout WorkspaceLayout(const PagedDecodeProblem& p) {
  const int64_t max_tasks = MaxTasks(p);
  Layout l;
  l.tasks = 0;
  l.merges = AlignUp(l.tasks + max_tasks * sizeof(Task));
  l.outs = AlignUp(l.merges + p.num_pairs() * sizeof(Merge));
  l.lses = AlignUp(l.outs + max_tasks * p.group() * p.head_dim * sizeof(float));
  l.total = AlignUp(l.lses + max_tasks * p.group() * sizeof(float)) + kAlign;
  return l;
}

class CpuAttentionBackend : public AttentionBackend {
 public:
  CpuAttentionBackend(const CpuPool* pool, internal::PagedAttentionFn attend,
                      int64_t head_dim_multiple, std::string name)
      : pool_(pool),
        attend_(attend),
        head_dim_multiple_(head_dim_multiple),
        name_(std::move(name)) {}

  absl::string_view name() const override { return name_; }

  absl::Status Supports(const PagedDecodeProblem& p) const override {
    FLUXION_RETURN_IF_ERROR(ValidatePagedDecodeProblem(p));
    if (p.head_dim % kChunkDims != 0 || p.head_dim > kMaxHeadDim) {
      return absl::UnimplementedError(absl::StrCat("the CPU paged kernel needs head_dim a multiple"
                                                   " of ", kChunkDims, " up to ", kMaxHeadDim,
                                                   ", not ", p.head_dim));
    }
    if (p.group() > kMaxGroup) {
      return absl::UnimplementedError(absl::StrCat("the CPU paged kernel takes GQA groups up to ",
                                                   kMaxGroup, ", not ", p.group()));
    }
    if (p.num_spans > 0 && p.kv.page_tokens > kMaxSpanRows) {
      return absl::UnimplementedError(absl::StrCat("the CPU paged kernel takes pages of up to ",
                                                   kMaxSpanRows, " tokens, not ",
                                                   p.kv.page_tokens));
    }
    return absl::OkStatus();
  }

  size_t WorkspaceBytes(const PagedDecodeProblem& p) const override {
    return WorkspaceLayout(p).total;
  }

  absl::Status Run(const PagedDecodeProblem& p, absl::Span<std::byte> workspace) override {
    if (p.num_requests == 0) return absl::OkStatus();
    const Layout layout = WorkspaceLayout(p);
    assert(workspace.size() >= layout.total);
    // The caller's buffer may start anywhere: align its start once.
    std::byte* base = workspace.data();
    base += (kAlign - reinterpret_cast<uintptr_t>(base) % kAlign) % kAlign;
    Task* tasks = reinterpret_cast<Task*>(base + layout.tasks);
    Merge* merges = reinterpret_cast<Merge*>(base + layout.merges);
    float* outs = reinterpret_cast<float*>(base + layout.outs);
    float* lses = reinterpret_cast<float*>(base + layout.lses);

    int64_t num_tasks = 0, num_merges = 0, slots = 0;
    for (int64_t pair = 0; pair < p.num_pairs(); ++pair) {
      const int64_t begin = p.span_indptr[pair], end = p.span_indptr[pair + 1];
      assert(begin <= end && end <= p.num_spans);
      const int64_t first_task = num_tasks;
      int64_t piece_begin = begin, rows = 0;
      for (int64_t s = begin; s < end; ++s) {
        rows += p.spans[s].rows;
        if (rows >= kPieceRows && s + 1 < end) {
          tasks[num_tasks++] = {pair, piece_begin, s + 1, -1};
          piece_begin = s + 1;
          rows = 0;
        }
      }
      tasks[num_tasks++] = {pair, piece_begin, end, -1};
      const int64_t count = num_tasks - first_task;
      if (count > 1) {
        for (int64_t t = first_task; t < num_tasks; ++t) tasks[t].slot = slots++;
        merges[num_merges++] = {pair, tasks[first_task].slot, count};
      }
    }
    assert(num_tasks <= MaxTasks(p));

    const int64_t group = p.group(), d = p.head_dim, gd = group * d;
    const internal::PagedAttentionFn attend =
        d % head_dim_multiple_ == 0 ? attend_ : internal::PagedAttentionAvx2;
    auto head0 = [&](int64_t pair) {
      const int64_t r = pair / p.num_kv_heads, h = pair % p.num_kv_heads;
      return r * p.num_qo_heads + h * group;
    };
    auto run_task = [&](int64_t i) {
      const Task& t = tasks[i];
      const int64_t h0 = head0(t.pair);
      const AttentionState state =
          t.slot < 0 ? AttentionState{p.out + h0 * d, p.lse + h0}
                     : AttentionState{outs + t.slot * gd, lses + t.slot * group};
      attend(p.kv, p.spans + t.span_begin, t.span_end - t.span_begin,
             {p.q + h0 * d, group, p.sm_scale}, state);
    };
    auto run_merge = [&](int64_t i) {
      const Merge& m = merges[i];
      const int64_t h0 = head0(m.pair);
      float* out = p.out + h0 * d;
      float* lse = p.lse + h0;
      std::memcpy(out, outs + m.first_slot * gd, gd * sizeof(float));
      std::memcpy(lse, lses + m.first_slot * group, group * sizeof(float));
      for (int64_t s = m.first_slot + 1; s < m.first_slot + m.count; ++s) {
        MergeStates(out, lse, outs + s * gd, lses + s * group, group, d);
      }
    };
    if (pool_ == nullptr) {
      for (int64_t i = 0; i < num_tasks; ++i) run_task(i);
      for (int64_t i = 0; i < num_merges; ++i) run_merge(i);
    } else {
      pool_->ParallelFor(num_tasks, run_task);
      pool_->ParallelFor(num_merges, run_merge);
    }
    return absl::OkStatus();
  }

 private:
  // The AVX2 kernel's granularity, which every head_dim falls back to.
  static constexpr int64_t kChunkDims = 16;

  const CpuPool* pool_;
  internal::PagedAttentionFn attend_;
  int64_t head_dim_multiple_;
  std::string name_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionBackend>> NewCpuAttentionBackend(
    const CpuAttentionBackendOptions& options) {
  if (!options.isa.has_value()) {
    // The public entry dispatches per call on head_dim itself.
    return std::make_unique<CpuAttentionBackend>(
        options.pool, PagedAttention, 1, absl::StrCat("cpu-", CpuIsaName(ActiveCpuIsa())));
  }
  std::string why_not;
  const internal::CpuKernels* k = internal::RunnableKernels(*options.isa, &why_not);
  if (k == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("CPU attention backend ", CpuIsaName(*options.isa), ": ", why_not));
  }
  return std::make_unique<CpuAttentionBackend>(options.pool, k->paged_attention,
                                               k->head_dim_multiple,
                                               absl::StrCat("cpu-", CpuIsaName(*options.isa)));
}

}  // namespace fluxion::kernels::cpu
