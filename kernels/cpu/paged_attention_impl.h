// Internal to kernels/cpu and its tests: the per-ISA entry points behind the public functions of
// paged_attention_cpu.h and selection.h, and the table the dispatcher picks from. Each entry has
// exactly the contract of the public function it backs, plus `head_dim_multiple`.
//
// Callers outside kernels/cpu use the public headers, which dispatch once per process
// (cpu_features.h). Calling an AVX-512 entry directly on a CPU without AVX-512 is undefined
// behaviour (SIGILL); RunnableKernels is the safe way to get one.
//
// Thread-safe: pure functions and immutable tables.
#ifndef FLUXION_KERNELS_CPU_PAGED_ATTENTION_IMPL_H_
#define FLUXION_KERNELS_CPU_PAGED_ATTENTION_IMPL_H_

#include <cstdint>
#include <string>

#include "kernels/cpu/cpu_features.h"
#include "kernels/paged_attention.h"

namespace fluxion::kernels::cpu::internal {

using PagedAttentionFn = void (*)(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                                  const DecodeQuery& q, const AttentionState& state);
// MaxGroupScores (all_heads false: scores[row]) and GroupScores (true: scores[row][group]).
using ScoreRowsFn = void (*)(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                             const float* q, int64_t group, bool all_heads, float* scores);
using QuestBlockBoundsFn = void (*)(const float* key_min, const float* key_max, int64_t head_dim,
                                    int64_t first_block, int64_t num_blocks,
                                    int64_t pages_per_block, const float* q, int64_t group,
                                    float* out);

// One ISA's kernels. paged_attention and score_rows require head_dim to be a multiple of
// head_dim_multiple (16 for AVX2, 32 for AVX-512); the public functions send other head dims to
// the AVX2 kernels. quest_block_bounds takes any head_dim that is a multiple of 8.
struct CpuKernels {
  CpuIsa isa;
  int64_t head_dim_multiple;
  // True when paged_attention rounds q * scale to bf16 before the scores (the avx512bf16
  // variant): its results equal the fp32 kernels' on that rounded query, not on q itself.
  bool rounds_query_to_bf16;
  PagedAttentionFn paged_attention;
  ScoreRowsFn score_rows;
  QuestBlockBoundsFn quest_block_bounds;
};

// The kernels of `isa` when this build compiled them and this CPU can run them. Otherwise nullptr,
// and *why_not (if non-null) starts with "no AVX-512" or "no AVX-512-BF16" (CPU) or says the build
// left them out.
const CpuKernels* RunnableKernels(CpuIsa isa, std::string* why_not);

// The kernels the public functions use: RunnableKernels(ActiveCpuIsa()), resolved on first use.
const CpuKernels& ActiveKernels();

// PagedAttentionSplit (paged_attention_cpu.h) over a given single-thread kernel.
void PagedAttentionSplitWith(PagedAttentionFn attend, const PagedKvView& kv, const PageSpan* spans,
                             int64_t num_spans, const DecodeQuery& q, const AttentionState& state,
                             int threads);

// AVX2 + FMA (paged_attention_cpu.cc, selection.cc).
void PagedAttentionAvx2(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                        const DecodeQuery& q, const AttentionState& state);
void ScoreRowsAvx2(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                   const float* q, int64_t group, bool all_heads, float* scores);
void QuestBlockBoundsAvx2(const float* key_min, const float* key_max, int64_t head_dim,
                          int64_t first_block, int64_t num_blocks, int64_t pages_per_block,
                          const float* q, int64_t group, float* out);

// AVX-512 F/BW/VL/DQ + FMA (paged_attention_avx512.cc, selection_avx512.cc); defined only when
// the build compiled them (Avx512KernelsCompiled()). REQUIRES: head_dim % 32 == 0 for the first
// two.
void PagedAttentionAvx512(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                          const DecodeQuery& q, const AttentionState& state);
void ScoreRowsAvx512(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                     const float* q, int64_t group, bool all_heads, float* scores);
void QuestBlockBoundsAvx512(const float* key_min, const float* key_max, int64_t head_dim,
                            int64_t first_block, int64_t num_blocks, int64_t pages_per_block,
                            const float* q, int64_t group, float* out);

// As PagedAttentionAvx512 with scores by vdpbf16ps on bf16(q * scale); also needs AVX-512-BF16
// (paged_attention_avx512.cc compiled a second time with -mavx512bf16).
void PagedAttentionAvx512Bf16(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                              const DecodeQuery& q, const AttentionState& state);

}  // namespace fluxion::kernels::cpu::internal

#endif  // FLUXION_KERNELS_CPU_PAGED_ATTENTION_IMPL_H_
