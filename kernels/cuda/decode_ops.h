// CUDA kernels of the decode step's dense half (the GPU side of the hybrid executor): embedding,
// RoPE, residual adds, bf16 casts, greedy argmax, attention over a GPU-resident window of K/V rows
// with its log-sum-exp, and the merge of partial attention states. flashinfer-style: plain
// functions on raw device pointers plus sizes and a stream, returning cudaError_t; shapes are
// written [dims] beside each pointer; the same contracts as kernels/reference, which the tests
// compare against.
//
// Thread-safe: launches on the caller's stream; nothing is allocated.
#ifndef FLUXION_KERNELS_CUDA_DECODE_OPS_H_
#define FLUXION_KERNELS_CUDA_DECODE_OPS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/half.h"

namespace fluxion::kernels::cuda {

// out[m][d] = float(table[ids[m]][d]); ids [m] int32 on the device, table [vocab][d] bf16.
// REQUIRES: 0 <= ids[i] < vocab (the caller validated the token ids).
cudaError_t EmbedRows(const bf16* table, const int32_t* ids, float* out, int64_t m, int64_t d,
                      cudaStream_t stream);

// Rotates x[n][heads][head_dim] in place by RoPE, "rotate half" convention (HF Llama/Qwen2):
// pairs (i, i + head_dim/2) rotate by positions[t] * inv_freq[i]. positions [n] int64 and
// inv_freq [head_dim/2] fp32 (already scaled, model::ComputeInvFreq) on the device. The angle and
// its sine/cosine are computed in double: at position 131072 an fp32 angle is off by ~0.01 rad.
cudaError_t ApplyRope(float* x, const int64_t* positions, const float* inv_freq, int64_t n,
                      int64_t heads, int64_t head_dim, cudaStream_t stream);

// The epilogue of the stacked q/k/v product: row t of qkv [m][(heads + 2 kv_heads) * head_dim]
// (q heads, then k heads, then v heads), plus bias [(heads + 2 kv_heads) * head_dim] when not
// null, goes to q [m][heads][head_dim], k and v [m][kv_heads][head_dim], q and k rotated as
// ApplyRope does (the same double-precision angle, so the result equals AddBiasRows + ApplyRope
// on the separate products bit for bit). One launch instead of a bias add per projection and a
// RoPE per q/k. The outputs must not alias qkv.
cudaError_t SplitQkvRope(const float* qkv, const float* bias, const int64_t* positions,
                         const float* inv_freq, float* q, float* k, float* v, int64_t m,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream);

// y[i] += x[i] for i < n.
cudaError_t AddInPlace(float* y, const float* x, int64_t n, cudaStream_t stream);

// y[i][j] += bias[j] for i < m, j < n: the bias of a linear layer after its GEMM.
cudaError_t AddBiasRows(float* y, const float* bias, int64_t m, int64_t n, cudaStream_t stream);

// w[i] = bf16(mean + std_dev * u_i) for i < n, u_i uniform on [-sqrt(3), sqrt(3)) (unit variance)
// from a counter-based hash of (seed, i): the same values for the same seed on any launch shape.
// Random weights made in device memory for benchmarks at shapes whose host copy would not fit.
cudaError_t FillRandomBf16(bf16* w, int64_t n, uint64_t seed, float mean, float std_dev,
                           cudaStream_t stream);

// y[i] = bf16(x[i]) (round to nearest even), the activations fed to the bf16 GEMMs.
cudaError_t CastToBf16(const float* x, bf16* y, int64_t n, cudaStream_t stream);

// out[r] = argmax over v of logits[r][v] (the lowest index among equal maxima, as the CPU
// sampler's greedy path), logits [rows][vocab] fp32.
cudaError_t ArgmaxRows(const float* logits, int64_t rows, int64_t vocab, int32_t* out,
                       cudaStream_t stream);

// One attention problem: the `group` query heads of one (request, layer, KV head) over `rows` K/V
// rows resident on the device (the sink tokens and the ring of recent tokens; their order does not
// matter to attention). k, v: [rows][head_dim] bf16 with row stride `row_stride` elements.
// q: [group][head_dim] fp32 post-RoPE, unscaled. out: [group][head_dim]; lse: [group], natural
// base, of the scaled scores; rows == 0 gives out = 0 and lse = -inf (an empty state).
struct WindowProblem {
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  int64_t row_stride = 0;
  int32_t rows = 0;
  const float* q = nullptr;
  float* out = nullptr;
  float* lse = nullptr;
};

// Runs `num_problems` problems (an array in device memory), all with the same group, head_dim and
// softmax scale. head_dim: 64 or 128 (cudaErrorInvalidValue otherwise).
cudaError_t WindowAttention(const WindowProblem* problems, int64_t num_problems, int64_t group,
                            int64_t head_dim, float scale, cudaStream_t stream);

// Merges partial state b into a over disjoint row sets, for `states` states of head_dim each:
//   out_a, out_b [states][head_dim]; lse_a, lse_b [states], natural base.
// a := (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b), lse_a := log(e^lse_a + e^lse_b);
// an empty side (lse = -inf) leaves the other unchanged; both empty stay empty (out 0, -inf).
cudaError_t MergeStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                        int64_t states, int64_t head_dim, cudaStream_t stream);

// Merges the partial states of items split into chunks (flash-decoding's second pass). Item i has
// chunks [chunk_begin[i], chunk_begin[i + 1]), each holding `group` states:
//   chunk_out [chunks][group][head_dim], chunk_lse [chunks][group], chunk_begin [items + 1]
//   out [items][group][head_dim], lse [items][group]
// An item with no chunks, or whose chunks are all empty, gets out 0 and lse -inf.
cudaError_t MergeChunks(const float* chunk_out, const float* chunk_lse,
                        const int32_t* chunk_begin, int64_t items, int64_t group,
                        int64_t head_dim, float* out, float* lse, cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_DECODE_OPS_H_
