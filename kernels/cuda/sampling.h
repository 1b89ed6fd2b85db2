// Sampling's device half (docs/GPU.md "Candidate kernel"): per row of a logits matrix, the row's
// best tokens in model::Sampler's order, so that a decode step copies a few KB per row to the host
// instead of the whole row (512 KB at Llama-3's 128K vocabulary) and the host sampler draws from
// them (model/sampler.h SampleCandidates).
//
// Method: an exact radix select on the fp32 bit pattern, then a sort of the few keys it leaves.
// The floats map to order-preserving 32-bit keys (-0 folded onto +0, as the sampler's comparisons
// treat them equal). One thread block per row:
//   fast path  pass 1 histograms the keys' top 12 bits (sign, exponent, 3 mantissa bits: 4096
//              bins of an eighth of an octave) and finds the max; a block scan picks the bin that
//              holds the k-th largest key. When every key in or above that bin fits in shared
//              memory (<= 4096 of them: the case for an LM head's logits, whose top is sparse),
//              pass 2 gathers them (and sums the normaliser) and a bitonic sort of (key, id) as
//              one 64-bit number orders them: two reads of the row.
//   general    otherwise (a crowded bin: many equal or near-equal logits) four passes, one per
//              8-bit digit from the top, pin the k-th largest key exactly; a fifth gathers every
//              key above it plus the lowest-id ties at it (a block scan ranks ties in id order)
//              and sums the normaliser; a bitonic sort of the <= 1024 winners orders them.
// No sort of the vocabulary either way; every pass is a coalesced read with 8 loads in flight per
// thread, the later ones mostly from L2 (16 rows of 128K are 8 MB).
//
// NaN logits are out of contract (a model that makes them is broken): they sort above +inf
// (positive NaN) or below -inf (negative), where the host's comparisons are unordered.
//
// Thread-safe: launches on the caller's stream; returns cudaError_t, never aborts.
#ifndef FLUXION_KERNELS_CUDA_SAMPLING_H_
#define FLUXION_KERNELS_CUDA_SAMPLING_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace fluxion::kernels::cuda {

// The most candidates one row may ask for (the sort's shared-memory tile).
inline constexpr int64_t kMaxTopCandidates = 1024;

// For each row r < rows of logits [rows][vocab] (device memory), with n = min(k, vocab):
//   ids[r][0..n), values[r][0..n)  the row's n largest logits, descending, ties by lower id
//   normalisers[r]                 sum over the WHOLE row of exp((x - max) / temperatures[r]) in
//                                  double, max = values[r][0]; 0 where temperatures[r] <= 0
// ids and values are [rows][n]; temperatures and normalisers [rows] (both may be null: no sum).
// All device memory. cudaErrorInvalidValue (nothing launched) unless rows >= 0, 1 <= k <=
// kMaxTopCandidates and 1 <= vocab < 2^31.
cudaError_t TopCandidates(const float* logits, int64_t rows, int64_t vocab, int64_t k,
                          const double* temperatures, int32_t* ids, float* values,
                          double* normalisers, cudaStream_t stream);

}  // namespace fluxion::kernels::cuda

#endif  // FLUXION_KERNELS_CUDA_SAMPLING_H_
