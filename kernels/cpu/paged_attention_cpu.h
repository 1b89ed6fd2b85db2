// CPU decode attention over host KV pages (contract in kernels/paged_attention.h). The public
// functions dispatch once per process (cpu_features.h) to the AVX-512 kernel where the CPU has it
// and to the AVX2 + FMA baseline otherwise; FLUXION_CPU_ISA=avx2|avx512|avx512bf16 forces one.
//
// Thread-safe: pure function of its inputs; callers parallelise over (request, layer, KV head).
#ifndef FLUXION_KERNELS_CPU_PAGED_ATTENTION_CPU_H_
#define FLUXION_KERNELS_CPU_PAGED_ATTENTION_CPU_H_

#include <cstdint>

#include "kernels/paged_attention.h"

namespace fluxion::kernels::cpu {

// Largest group and rows per span the kernel's stack scratch holds.
inline constexpr int64_t kMaxGroup = 16;
inline constexpr int64_t kMaxSpanRows = 64;
inline constexpr int64_t kMaxHeadDim = 256;

// True when PagedAttention supports this shape: head_dim a multiple of 16 and <= kMaxHeadDim,
// group <= kMaxGroup, page_tokens <= kMaxSpanRows.
bool PagedAttentionSupported(int64_t head_dim, int64_t group, int64_t page_tokens);

// Attends q.group heads over the rows in `spans`; each K and V row is read once, converted from
// bf16 to fp32, used for every head of the group. fp32 accumulation, online softmax.
// REQUIRES: PagedAttentionSupported(kv.head_dim, q.group, kv.page_tokens).
void PagedAttention(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                    const DecodeQuery& q, const AttentionState& state);

// Split-KV version for long row sets (flash-decoding): the spans are cut into `threads` slices of
// about equal rows, each slice is attended by one OpenMP thread into a partial state, and the
// partial states are merged by log-sum-exp. threads <= 0 uses the OpenMP default.
void PagedAttentionSplit(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                         const DecodeQuery& q, const AttentionState& state, int threads);

// One (request, layer, KV head) attention of a decode step: the unit of CPU parallelism.
struct PagedAttentionTask {
  PagedKvView kv;
  const PageSpan* spans = nullptr;
  int64_t num_spans = 0;
  DecodeQuery q;
  AttentionState state;
};

// Runs every task (PagedAttention each) on `threads` OpenMP threads (<= 0: the OpenMP default),
// dynamically scheduled since selected row counts differ between heads. Placement follows
// OMP_PLACES / OMP_PROC_BIND (e.g. OMP_PROC_BIND=close OMP_PLACES=cores keeps threads on the
// cores of the NUMA node that holds the arena).
void PagedAttentionBatch(const PagedAttentionTask* tasks, int64_t num_tasks, int threads);

// a := merge(a, b) by log-sum-exp (disjoint row sets): MergeStates (merge_state.h) over the
// group's heads, kept under this name for its callers.
void MergeAttentionStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                          int64_t group, int64_t head_dim);

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_PAGED_ATTENTION_CPU_H_
