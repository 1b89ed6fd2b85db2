// AVX2 vector math shared by the kernels compiled with -mavx2 -mfma (the paged decode kernels,
// the selection kernels, the model's dense attention): exp, horizontal reductions, and the softmax
// pieces built on them. libm's expf is scalar and was 13% of a 4K prefill on its own (perf); the
// polynomial below is within a couple of ulps.
#ifndef FLUXION_KERNELS_CPU_MATH_AVX2_H_
#define FLUXION_KERNELS_CPU_MATH_AVX2_H_

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace fluxion::kernels::cpu {

// exp(x) for 8 lanes: range reduction to r in [-ln2/2, ln2/2], degree-6 polynomial, scale by 2^n.
// Relative error ~2e-7 (a couple of fp32 ulps); inputs below -87 flush to 0.
inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                        _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float HorizontalSum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float HorizontalMax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// v[i] = exp(v[i] - shift) for n values, returning their sum.
inline float ExpShiftedInPlace(float* v, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), s));
    _mm256_storeu_ps(v + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = HorizontalSum8(sum);
  if (i < n) {
    alignas(32) float tail[8] = {};
    for (int64_t j = i; j < n; ++j) tail[j - i] = v[j] - shift;
    for (int64_t j = n - i; j < 8; ++j) tail[j] = -INFINITY;
    _mm256_store_ps(tail, Exp8(_mm256_load_ps(tail)));
    for (int64_t j = i; j < n; ++j) {
      v[j] = tail[j - i];
      total += v[j];
    }
  }
  return total;
}

// max(v[0..n)), -inf for n == 0.
inline float MaxOf(const float* v, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(v + i));
  float best = HorizontalMax8(m);
  for (; i < n; ++i) best = best > v[i] ? best : v[i];
  return best;
}

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_MATH_AVX2_H_
