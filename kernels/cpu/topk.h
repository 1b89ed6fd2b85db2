// Top-k selection over scores: which k of n entries have the largest scores, unordered.
// Sparse policies call this once per (request, layer, KV head) per decode step, over token or
// block scores, so it sits on the decode critical path.
//
// Thread-safe: no shared state (TopKIndices keeps its scratch per thread).
#ifndef FLUXION_KERNELS_CPU_TOPK_H_
#define FLUXION_KERNELS_CPU_TOPK_H_

#include <cstdint>
#include <vector>

namespace fluxion::kernels::cpu {

// Radix select on the order-preserving integer image of the fp32 scores: each pass histograms
// the candidates by 11-bit digits of (key - smallest candidate key), so it narrows the range
// 2048-fold wherever the scores sit (a head's Quest scores often differ in low mantissa bits
// only), collecting the indices above the threshold bucket; at most three passes. Writes exactly
// min(k, n) indices into `out` (unordered). Ties at the threshold are broken toward lower
// indices. NaN scores sort lowest. Scratch is per thread, reused across calls.
void TopKIndices(const float* scores, int64_t n, int64_t k, std::vector<int32_t>* out);

// The same result (the same vector, order included) with the first pass, the O(n) part, in
// OpenMP tasks over chunks of `chunk` entries (RunAsTasks, cpu_pool.h): for a (request, KV head)
// task of a decode step that selects from tens of thousands of scores while other threads of
// the team are idle (LFPS's rescored candidates: its top-k was the largest serial part of the
// head-step after the rescoring itself, by perf on the H200 host). Outside a parallel region,
// or below two chunks, it is TopKIndices.
inline constexpr int64_t kTopKEntriesPerTask = 8192;
void TopKIndicesInTasks(const float* scores, int64_t n, int64_t k, std::vector<int32_t>* out,
                        int64_t chunk = kTopKEntriesPerTask);

// The same contract with std::nth_element, the baseline the radix select is measured against.
void TopKIndicesNthElement(const float* scores, int64_t n, int64_t k, std::vector<int32_t>* out);

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_TOPK_H_
