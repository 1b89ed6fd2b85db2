// Merging partial attention states by log-sum-exp: the scalar oracle (double arithmetic).
//
// A state over a set of key rows is (out, lse): out is the softmax-normalised weighted sum of the
// rows' values, lse the natural-base log-sum-exp of their scaled scores. Two states over disjoint
// row sets merge exactly into the state over their union:
//   m = max(lse_a, lse_b), w_a = exp(lse_a - m), w_b = exp(lse_b - m)
//   out = (w_a * out_a + w_b * out_b) / (w_a + w_b),  lse = m + log(w_a + w_b)
// The empty state (no rows) has lse = -inf and, by contract, out = 0. It is the identity:
//   b empty            -> a unchanged (also when a is empty too: the result is empty);
//   a empty, b not     -> a := b (out copied, lse copied), with no exp(-inf - -inf) = NaN.
// lse = +inf or NaN is not a state and is not handled (the kernels never produce them).
#ifndef FLUXION_KERNELS_REFERENCE_MERGE_STATE_H_
#define FLUXION_KERNELS_REFERENCE_MERGE_STATE_H_

#include <cstdint>

namespace fluxion::kernels::reference {

// a := merge(a, b) for `rows` independent states (e.g. every query head of a batch).
//   out_a, out_b: [rows][head_dim]; lse_a, lse_b: [rows], natural base.
void MergeStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b, int64_t rows,
                 int64_t head_dim);

}  // namespace fluxion::kernels::reference

#endif  // FLUXION_KERNELS_REFERENCE_MERGE_STATE_H_
