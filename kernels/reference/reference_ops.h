// Scalar, obviously-correct versions of the CPU kernels: the oracles that kernels/cpu (and later
// kernels/cuda) are tested against. They accumulate in double and are deliberately slow.
// Shapes are written [dims] beside each pointer; all tensors are dense row-major fp32.
//
// Thread-safe: pure functions.
#ifndef FLUXION_KERNELS_REFERENCE_REFERENCE_OPS_H_
#define FLUXION_KERNELS_REFERENCE_REFERENCE_OPS_H_

#include <cstdint>

#include "kernels/attention_params.h"
#include "kernels/paged_attention.h"

namespace fluxion::kernels::reference {

// y[m][n] = x[m][k] . w[n][k]^T + bias[n] (+ y when accumulate). bias may be null.
void MatMul(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
            int64_t k, bool accumulate);

// y[m][d] = x / sqrt(mean(x^2) + eps) * weight[d]. y may alias x.
void RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m, int64_t d);

// Rotates x[n][heads][head_dim] in place by RoPE in the "rotate half" convention (Llama/Qwen2 in
// HF): pairs (i, i + head_dim/2) rotate by angle positions[t] * inv_freq[i].
void ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
               int64_t heads, int64_t head_dim);

// out[n] = silu(gate[n]) * up[n]. out may alias gate or up.
void SiluMul(const float* gate, const float* up, float* out, int64_t n);

// Causal attention for queries at positions [pos0, pos0 + n) over keys/values [0, pos0 + n):
//   q:   [n][num_heads][head_dim]
//   k,v: [pos0 + n][num_kv_heads][head_dim]
//   out: [n][num_heads][head_dim]
void CausalAttention(const float* q, const float* k, const float* v, float* out,
                     const AttentionParams& p);

// Attention of q.group heads over the rows listed in `spans` of `kv` (double accumulation).
// Writes state.out [group][head_dim] and state.lse [group] (-inf and zeros for no rows).
void PagedAttention(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                    const DecodeQuery& q, const AttentionState& state);

// Merges partial state b into a (disjoint row sets): MergeStates (merge_state.h, which spells out
// the empty-state rules) over the group's heads.
//   out_a, out_b: [group][head_dim]; lse_a, lse_b: [group] natural base.
void MergeAttentionStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                          int64_t group, int64_t head_dim);

}  // namespace fluxion::kernels::reference

#endif  // FLUXION_KERNELS_REFERENCE_REFERENCE_OPS_H_
