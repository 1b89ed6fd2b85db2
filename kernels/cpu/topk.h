// Top-k selection over scores: which k of n entries have the largest scores, unordered.
// Sparse policies call this once per (request, layer, KV head) per decode step, over token or
// block scores, so it sits on the decode critical path.
//
// Thread-safe: pure functions; scratch is the caller's.
#ifndef FLUXION_KERNELS_CPU_TOPK_H_
#define FLUXION_KERNELS_CPU_TOPK_H_

#include <cstdint>
#include <vector>

namespace fluxion::kernels::cpu {

// Radix select on the order-preserving integer image of the fp32 scores (11/11/10-bit digits):
// up to three histogram passes narrow down the k-th largest key, then one pass collects every
// index above it and as many ties as needed. Writes exactly min(k, n) indices into `out`
// (unordered). Ties at the threshold are broken toward lower indices. NaN scores sort lowest.
void TopKIndices(const float* scores, int64_t n, int64_t k, std::vector<int32_t>* out);

// The same contract with std::nth_element, the baseline the radix select is measured against.
void TopKIndicesNthElement(const float* scores, int64_t n, int64_t k, std::vector<int32_t>* out);

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_TOPK_H_
