// Merging partial attention states by log-sum-exp on the CPU: fp32, same contract (and the same
// empty-state rules) as kernels/reference/merge_state.h, which states them.
//
// Thread-safe: pure function.
#ifndef FLUXION_KERNELS_CPU_MERGE_STATE_H_
#define FLUXION_KERNELS_CPU_MERGE_STATE_H_

#include <cstdint>

namespace fluxion::kernels::cpu {

// a := merge(a, b) for `rows` independent states.
//   out_a, out_b: [rows][head_dim]; lse_a, lse_b: [rows], natural base; -inf marks an empty state.
void MergeStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b, int64_t rows,
                 int64_t head_dim);

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_MERGE_STATE_H_
