// AVX-512 helpers shared by the CPU kernels that read bf16 K/V rows: the 512-bit twin of
// bf16_avx2.h. Internal to kernels/cpu, and only for files compiled with the AVX-512 flags
// (kernels/cpu/CMakeLists.txt); the dispatcher reaches that code only on CPUs that have them.
//
// Everything here has internal linkage on purpose. An inline function with external linkage is
// emitted by every object that uses it and the linker keeps one copy; objects built with
// different -m flags (AVX2, AVX-512, AVX-512-BF16) must each keep their own.
#ifndef FLUXION_KERNELS_CPU_BF16_AVX512_H_
#define FLUXION_KERNELS_CPU_BF16_AVX512_H_

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512DQ__) || !defined(__FMA__)
#error "bf16_avx512.h is for files compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma"
#endif

#include <immintrin.h>

#include <cstdint>

#include "common/half.h"

namespace fluxion::kernels::cpu {
namespace {  // NOLINT: internal linkage on purpose, see the file comment

// Head dimensions are processed 32 at a time: one 512-bit load holds 32 bf16 values (one cache
// line of an aligned row), which split into 16 even-indexed fp32 values (shift left by 16) and 16
// odd-indexed ones (mask off the low half). Queries and output accumulators are stored
// deinterleaved per 32-wide chunk to match, exactly as in bf16_avx2.h with twice the width.
constexpr int64_t kChunk512 = 32;

struct Bf16Pair512 {
  __m512 even, odd;
};

inline Bf16Pair512 LoadBf16x32(const bf16* p) {
  const __m512i x = _mm512_loadu_si512(p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xffff0000)))};
}

// Lane mask of the first n lanes, 0 <= n <= 16.
inline __mmask16 FirstLanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// Horizontal sums of four vectors, returned as the four lanes of one vector. (Both halves are
// taken with vextractf32x8: GCC 12's _mm512_castps512_ps256 trips -Wmaybe-uninitialized.)
inline __m128 HorizontalSum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 a8 = _mm256_add_ps(_mm512_extractf32x8_ps(a, 0), _mm512_extractf32x8_ps(a, 1));
  const __m256 b8 = _mm256_add_ps(_mm512_extractf32x8_ps(b, 0), _mm512_extractf32x8_ps(b, 1));
  const __m256 c8 = _mm256_add_ps(_mm512_extractf32x8_ps(c, 0), _mm512_extractf32x8_ps(c, 1));
  const __m256 d8 = _mm256_add_ps(_mm512_extractf32x8_ps(d, 0), _mm512_extractf32x8_ps(d, 1));
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Dot products of one bf16 key row k[d] with four deinterleaved queries q0[4][d] (rows d floats
// apart, 64-byte aligned), as the four lanes of the result. Even and odd halves accumulate
// separately: eight independent FMA chains keep both FMA ports busy through the 4-cycle latency.
inline __m128 ScoreFourHeads512(const bf16* k, const float* q0, int64_t d) {
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0;
  __m512 o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  for (int64_t c = 0; c < d; c += kChunk512) {
    const Bf16Pair512 kk = LoadBf16x32(k + c);
    const float* qc = q0 + c;
    e0 = _mm512_fmadd_ps(_mm512_load_ps(qc), kk.even, e0);
    o0 = _mm512_fmadd_ps(_mm512_load_ps(qc + 16), kk.odd, o0);
    e1 = _mm512_fmadd_ps(_mm512_load_ps(qc + d), kk.even, e1);
    o1 = _mm512_fmadd_ps(_mm512_load_ps(qc + d + 16), kk.odd, o1);
    e2 = _mm512_fmadd_ps(_mm512_load_ps(qc + 2 * d), kk.even, e2);
    o2 = _mm512_fmadd_ps(_mm512_load_ps(qc + 2 * d + 16), kk.odd, o2);
    e3 = _mm512_fmadd_ps(_mm512_load_ps(qc + 3 * d), kk.even, e3);
    o3 = _mm512_fmadd_ps(_mm512_load_ps(qc + 3 * d + 16), kk.odd, o3);
  }
  return HorizontalSum4x16(_mm512_add_ps(e0, o0), _mm512_add_ps(e1, o1), _mm512_add_ps(e2, o2),
                           _mm512_add_ps(e3, o3));
}

// Writes q[d] (times `scale`) deinterleaved per 32-wide chunk: 16 even-indexed then 16
// odd-indexed values, the order LoadBf16x32 produces keys in. REQUIRES: d % 32 == 0.
inline void DeinterleaveQuery32(const float* q, int64_t d, float scale, float* out) {
  for (int64_t c = 0; c < d; c += kChunk512) {
    for (int64_t i = 0; i < 16; ++i) {
      out[c + i] = q[c + 2 * i] * scale;
      out[c + 16 + i] = q[c + 2 * i + 1] * scale;
    }
  }
}

}  // namespace
}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_BF16_AVX512_H_
