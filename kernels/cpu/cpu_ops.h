// Fast CPU kernels for the model's dense math. Same contracts as kernels/reference (shapes there);
// matrix products go through OpenBLAS (docs/DEPENDENCIES.md says why), the rest is AVX2-vectorised
// loops parallelised with OpenMP.
//
// Threading: each call uses the OpenMP thread count in effect (SetNumThreads). Calls may be made
// from several threads at once; inside an OpenMP region OpenBLAS runs single-threaded.
#ifndef FLUXION_KERNELS_CPU_CPU_OPS_H_
#define FLUXION_KERNELS_CPU_CPU_OPS_H_

#include <cstdint>

#include "kernels/attention_params.h"

namespace fluxion::kernels::cpu {

// Sets the number of threads OpenMP regions and OpenBLAS use (<= 0: all cores).
void SetNumThreads(int threads);
int NumThreads();

// The kernel family OpenBLAS chose for this CPU at load time (e.g. "Cooperlake", "Haswell"). Its
// cpuid detection can pick a slow one inside VMs; OPENBLAS_CORETYPE overrides it
// (docs/DEPENDENCIES.md). Recorded in every result file.
const char* BlasCoreName();

// y[m][n] = x[m][k] . w[n][k]^T + bias[n] (+ y when accumulate). bias may be null.
void MatMul(const float* x, const float* w, const float* bias, float* y, int64_t m, int64_t n,
            int64_t k, bool accumulate);

// y[m][d] = x / sqrt(mean(x^2) + eps) * weight[d]. y may alias x.
void RmsNorm(const float* x, const float* weight, float eps, float* y, int64_t m, int64_t d);

// In-place rotate-half RoPE on x[n][heads][head_dim]; angle = positions[t] * inv_freq[i].
void ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
               int64_t heads, int64_t head_dim);

// out[n] = silu(gate[n]) * up[n]. out may alias gate or up.
void SiluMul(const float* gate, const float* up, float* out, int64_t n);

// out[n] += x[n].
void Add(const float* x, float* out, int64_t n);

// sums[d] += column sums of x[n][d]; outer[d][d] += x^T x (full matrix, both triangles). fp32
// products through OpenBLAS (syrk), accumulated into the caller's double sums: used to fold many
// keys at once into running mean/covariance estimates.
void AccumulateMoments(const float* x, int64_t n, int64_t d, double* sums, double* outer);

// Causal attention: q [n][num_heads][head_dim], k/v [pos0 + n][num_kv_heads][head_dim],
// out [n][num_heads][head_dim]. Query tiles of 64 rows go through two sgemm calls (scores, then
// probabilities x V), so long prefills run at matrix-product speed.
void CausalAttention(const float* q, const float* k, const float* v, float* out,
                     const AttentionParams& p);

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_CPU_OPS_H_
