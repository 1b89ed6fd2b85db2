// AVX2 helpers shared by the CPU kernels that read bf16 K/V rows. Internal to kernels/cpu: the
// including .cc files are compiled with -mavx2 -mfma.
#ifndef FLUXION_KERNELS_CPU_BF16_AVX2_H_
#define FLUXION_KERNELS_CPU_BF16_AVX2_H_

#include <immintrin.h>

#include <cstdint>

#include "common/half.h"

namespace fluxion::kernels::cpu {

// Head dimensions are processed 16 at a time: one 256-bit load holds 16 bf16 values, which split
// into two fp32 vectors with one instruction each: the even-indexed elements (shift left by 16)
// and the odd-indexed ones (mask off the low half). Dot products do not care about the order of
// their terms, so the query is stored deinterleaved the same way and no shuffle is ever needed;
// the output accumulators are kept deinterleaved too and re-interleaved once at the end.
inline constexpr int64_t kChunk = 16;

struct Bf16Pair {
  __m256 even, odd;
};

inline Bf16Pair LoadBf16x16(const bf16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(0xffff0000)))};
}

// Horizontal sums of four vectors, returned as the four lanes of one vector.
inline __m128 HorizontalSum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Dot products of one bf16 key row k[d] with four deinterleaved queries q0[4][d] (rows d floats
// apart), as the four lanes of the result. The key row is loaded and widened once for all four.
inline __m128 ScoreFourHeads(const bf16* k, const float* q0, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t c = 0; c < d; c += kChunk) {
    const Bf16Pair kk = LoadBf16x16(k + c);
    const float* qc = q0 + c;
    a0 = _mm256_fmadd_ps(_mm256_load_ps(qc), kk.even, a0);
    a0 = _mm256_fmadd_ps(_mm256_load_ps(qc + 8), kk.odd, a0);
    a1 = _mm256_fmadd_ps(_mm256_load_ps(qc + d), kk.even, a1);
    a1 = _mm256_fmadd_ps(_mm256_load_ps(qc + d + 8), kk.odd, a1);
    a2 = _mm256_fmadd_ps(_mm256_load_ps(qc + 2 * d), kk.even, a2);
    a2 = _mm256_fmadd_ps(_mm256_load_ps(qc + 2 * d + 8), kk.odd, a2);
    a3 = _mm256_fmadd_ps(_mm256_load_ps(qc + 3 * d), kk.even, a3);
    a3 = _mm256_fmadd_ps(_mm256_load_ps(qc + 3 * d + 8), kk.odd, a3);
  }
  return HorizontalSum4(a0, a1, a2, a3);
}

// Writes q[d] (times `scale`) deinterleaved per 16-wide chunk: 8 even-indexed then 8 odd-indexed
// values, the order LoadBf16x16 produces keys in.
inline void DeinterleaveQuery(const float* q, int64_t d, float scale, float* out) {
  for (int64_t c = 0; c < d; c += kChunk) {
    for (int64_t i = 0; i < 8; ++i) {
      out[c + i] = q[c + 2 * i] * scale;
      out[c + 8 + i] = q[c + 2 * i + 1] * scale;
    }
  }
}

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_BF16_AVX2_H_
