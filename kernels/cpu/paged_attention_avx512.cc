// AVX-512 paged decode attention: the AVX2 kernel's design (docs/KV_LAYOUT.md) at twice the
// width, with the same contract and the same natural-base LSE states.
//
// This file is compiled twice (kernels/cpu/CMakeLists.txt):
//   - with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma, it defines PagedAttentionAvx512:
//     fp32 scores on keys widened by shift/mask, as accurate as the AVX2 kernel;
//   - with those flags plus -mavx512bf16 and FLUXION_AVX512_BF16_SCORES, it defines
//     PagedAttentionAvx512Bf16: scores by vdpbf16ps on the query rounded to bf16.
// Two objects, not one with both, so that no code a CPU without AVX-512-BF16 may run was compiled
// with BF16 enabled. Everything except the entry point has internal linkage (bf16_avx512.h says
// why).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "kernels/cpu/bf16_avx512.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/paged_attention_impl.h"
#include "kernels/cpu/span_rows.h"

namespace fluxion::kernels::cpu {
namespace {

constexpr int64_t kHeadBlock = 4;  // query heads sharing one pass over a K/V row

// std::max would instantiate a template with external linkage in this object (see the file
// comment), so the two scalar helpers are spelled out.
inline float MaxF(float a, float b) { return a > b ? a : b; }

// exp(x) for 16 lanes: the AVX2 kernel's Exp8 (range reduction to r in [-ln2/2, ln2/2], degree-6
// polynomial, ~2e-7 relative error) with vscalefps for the 2^n. Inputs below -87 flush to ~0.
inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// v[i] = exp(v[i] - shift) for n values, returning their sum. The tail is masked, so lanes past n
// are neither read nor written.
inline float ExpShiftedInPlace16(float* v, int64_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(v + i), s));
    _mm512_storeu_ps(v + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __mmask16 m = FirstLanes(n - i);
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + i), s));
    _mm512_mask_storeu_ps(v + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

inline float MaxOf(const float* v, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(v + i));
  if (i < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, FirstLanes(n - i), v + i));
  return _mm512_reduce_max_ps(m);
}

#ifdef FLUXION_AVX512_BF16_SCORES

// The scaled query rounded to bf16 (round to nearest even), in natural order: element t of head g
// is bits[g * d + t], and each 32-bit lane holds the pair (2i, 2i + 1) that vdpbf16ps multiplies
// with the key pair in the same lane. Rounding q is the price of vdpbf16ps: each score moves by at
// most 2^-9 * scale * sum_t |q_t k_t| (docs/KV_LAYOUT.md); the keys are bf16 already.
struct PreparedQuery {
  alignas(64) uint16_t bits[kMaxGroup * kMaxHeadDim];
};

void PrepareQuery(const DecodeQuery& q, int64_t d, int64_t padded, PreparedQuery* out) {
  const __m512 scale = _mm512_set1_ps(q.scale);
  for (int64_t g = 0; g < padded; ++g) {
    for (int64_t c = 0; c < d; c += kChunk512) {
      __m512i pairs = _mm512_setzero_si512();  // padding heads: zero queries
      if (g < q.group) {
        const float* src = q.q + g * d + c;
        const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(src), scale);
        const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(src + 16), scale);
        // The second operand fills the low half of the result.
        pairs = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
      }
      _mm512_store_si512(out->bits + g * d + c, pairs);
    }
  }
}

inline __m512bh LoadBf16Pairs(const void* p) {
  return reinterpret_cast<__m512bh>(_mm512_load_si512(p));
}

// Scores of one key row for heads [hb, hb + 4). Two accumulators per head (alternate chunks) give
// eight independent vdpbf16ps chains.
inline __m128 ScoreFour(const bf16* k, const PreparedQuery& pq, int64_t hb, int64_t d) {
  const uint16_t* q0 = pq.bits + hb * d;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t c = 0;
  for (; c + 2 * kChunk512 <= d; c += 2 * kChunk512) {
    const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + c));
    const __m512bh k1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + c + kChunk512));
    a0 = _mm512_dpbf16_ps(a0, LoadBf16Pairs(q0 + c), k0);
    b0 = _mm512_dpbf16_ps(b0, LoadBf16Pairs(q0 + c + kChunk512), k1);
    a1 = _mm512_dpbf16_ps(a1, LoadBf16Pairs(q0 + d + c), k0);
    b1 = _mm512_dpbf16_ps(b1, LoadBf16Pairs(q0 + d + c + kChunk512), k1);
    a2 = _mm512_dpbf16_ps(a2, LoadBf16Pairs(q0 + 2 * d + c), k0);
    b2 = _mm512_dpbf16_ps(b2, LoadBf16Pairs(q0 + 2 * d + c + kChunk512), k1);
    a3 = _mm512_dpbf16_ps(a3, LoadBf16Pairs(q0 + 3 * d + c), k0);
    b3 = _mm512_dpbf16_ps(b3, LoadBf16Pairs(q0 + 3 * d + c + kChunk512), k1);
  }
  if (c < d) {
    const __m512bh k0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + c));
    a0 = _mm512_dpbf16_ps(a0, LoadBf16Pairs(q0 + c), k0);
    a1 = _mm512_dpbf16_ps(a1, LoadBf16Pairs(q0 + d + c), k0);
    a2 = _mm512_dpbf16_ps(a2, LoadBf16Pairs(q0 + 2 * d + c), k0);
    a3 = _mm512_dpbf16_ps(a3, LoadBf16Pairs(q0 + 3 * d + c), k0);
  }
  return HorizontalSum4x16(_mm512_add_ps(a0, b0), _mm512_add_ps(a1, b1), _mm512_add_ps(a2, b2),
                           _mm512_add_ps(a3, b3));
}

#else  // fp32 scores

// The scaled query in fp32, deinterleaved per 32-wide chunk (bf16_avx512.h).
struct PreparedQuery {
  alignas(64) float deinterleaved[kMaxGroup * kMaxHeadDim];
};

void PrepareQuery(const DecodeQuery& q, int64_t d, int64_t padded, PreparedQuery* out) {
  for (int64_t g = 0; g < q.group; ++g) {
    DeinterleaveQuery32(q.q + g * d, d, q.scale, out->deinterleaved + g * d);
  }
  for (int64_t i = q.group * d; i < padded * d; ++i) out->deinterleaved[i] = 0.0f;
}

inline __m128 ScoreFour(const bf16* k, const PreparedQuery& pq, int64_t hb, int64_t d) {
  return ScoreFourHeads512(k, pq.deinterleaved + hb * d, d);
}

#endif  // FLUXION_AVX512_BF16_SCORES

void Attend(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans, const DecodeQuery& q,
            const AttentionState& state) {
  const int64_t d = kv.head_dim, group = q.group, chunks = d / kChunk512;
  // Heads are padded to a multiple of kHeadBlock with zero queries so the inner loops have a
  // fixed width; padded heads' results are never read.
  const int64_t padded = (group + kHeadBlock - 1) / kHeadBlock * kHeadBlock;
  PreparedQuery pq;
  alignas(64) float acc[kMaxGroup * kMaxHeadDim];  // deinterleaved output accumulators
  alignas(64) float scores[kMaxGroup][kMaxSpanRows];
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  PrepareQuery(q, d, padded, &pq);
  for (int64_t i = 0; i < padded * d; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
  for (int64_t g = 0; g < padded; ++g) {
    running_max[g] = -INFINITY;
    running_sum[g] = 0.0f;
  }

  internal::SpanRows span_rows(kv, spans, num_spans);
  internal::RowBatch batch;
  while (span_rows.Next(&batch)) {
    const int64_t rows = batch.rows;

    // Scores: each K row is loaded once per block of four heads.
    for (int64_t hb = 0; hb < padded; hb += kHeadBlock) {
      for (int64_t r = 0; r < rows; ++r) {
        alignas(16) float four[4];
        _mm_store_ps(four, ScoreFour(batch.k[r], pq, hb, d));
        for (int64_t j = 0; j < kHeadBlock; ++j) scores[hb + j][r] = four[j];
      }
    }

    // Online softmax: new running maximum, rescale factor for what was accumulated, weights.
    float correction[kMaxGroup];
    for (int64_t g = 0; g < padded; ++g) {
      const float new_max = MaxF(running_max[g], MaxOf(scores[g], rows));
      correction[g] = expf(running_max[g] - new_max);  // 0 on the first span: exp(-inf)
      running_sum[g] =
          running_sum[g] * correction[g] + ExpShiftedInPlace16(scores[g], rows, new_max);
      running_max[g] = new_max;
    }

    // Weighted V rows: four heads' accumulators for one 32-wide chunk (eight registers) stay in
    // registers across all rows of the span; each V chunk is loaded and widened once per block.
    for (int64_t hb = 0; hb < padded; hb += kHeadBlock) {
      const __m512 c0 = _mm512_set1_ps(correction[hb]), c1 = _mm512_set1_ps(correction[hb + 1]),
                   c2 = _mm512_set1_ps(correction[hb + 2]), c3 = _mm512_set1_ps(correction[hb + 3]);
      for (int64_t c = 0; c < chunks; ++c) {
        float* a = acc + hb * d + c * kChunk512;
        __m512 e0 = _mm512_mul_ps(_mm512_load_ps(a), c0);
        __m512 o0 = _mm512_mul_ps(_mm512_load_ps(a + 16), c0);
        __m512 e1 = _mm512_mul_ps(_mm512_load_ps(a + d), c1);
        __m512 o1 = _mm512_mul_ps(_mm512_load_ps(a + d + 16), c1);
        __m512 e2 = _mm512_mul_ps(_mm512_load_ps(a + 2 * d), c2);
        __m512 o2 = _mm512_mul_ps(_mm512_load_ps(a + 2 * d + 16), c2);
        __m512 e3 = _mm512_mul_ps(_mm512_load_ps(a + 3 * d), c3);
        __m512 o3 = _mm512_mul_ps(_mm512_load_ps(a + 3 * d + 16), c3);
        for (int64_t r = 0; r < rows; ++r) {
          const Bf16Pair512 vv = LoadBf16x32(batch.v[r] + c * kChunk512);
          __m512 p = _mm512_set1_ps(scores[hb][r]);
          e0 = _mm512_fmadd_ps(p, vv.even, e0);
          o0 = _mm512_fmadd_ps(p, vv.odd, o0);
          p = _mm512_set1_ps(scores[hb + 1][r]);
          e1 = _mm512_fmadd_ps(p, vv.even, e1);
          o1 = _mm512_fmadd_ps(p, vv.odd, o1);
          p = _mm512_set1_ps(scores[hb + 2][r]);
          e2 = _mm512_fmadd_ps(p, vv.even, e2);
          o2 = _mm512_fmadd_ps(p, vv.odd, o2);
          p = _mm512_set1_ps(scores[hb + 3][r]);
          e3 = _mm512_fmadd_ps(p, vv.even, e3);
          o3 = _mm512_fmadd_ps(p, vv.odd, o3);
        }
        _mm512_store_ps(a, e0);
        _mm512_store_ps(a + 16, o0);
        _mm512_store_ps(a + d, e1);
        _mm512_store_ps(a + d + 16, o1);
        _mm512_store_ps(a + 2 * d, e2);
        _mm512_store_ps(a + 2 * d + 16, o2);
        _mm512_store_ps(a + 3 * d, e3);
        _mm512_store_ps(a + 3 * d + 16, o3);
      }
    }
  }

  // Re-interleave once: output element 2i is even[i], 2i + 1 is odd[i].
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t g = 0; g < group; ++g) {
    float* out = state.out + g * d;
    if (running_sum[g] == 0.0f) {
      for (int64_t t = 0; t < d; ++t) out[t] = 0.0f;  // no rows: empty state
      state.lse[g] = -INFINITY;
      continue;
    }
    const __m512 inv = _mm512_set1_ps(1.0f / running_sum[g]);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* a = acc + g * d + c * kChunk512;
      const __m512 e = _mm512_mul_ps(_mm512_load_ps(a), inv);
      const __m512 o = _mm512_mul_ps(_mm512_load_ps(a + 16), inv);
      _mm512_storeu_ps(out + c * kChunk512, _mm512_permutex2var_ps(e, first, o));
      _mm512_storeu_ps(out + c * kChunk512 + 16, _mm512_permutex2var_ps(e, second, o));
    }
    state.lse[g] = running_max[g] + logf(running_sum[g]);
  }
}

}  // namespace

namespace internal {

#ifdef FLUXION_AVX512_BF16_SCORES
void PagedAttentionAvx512Bf16(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                              const DecodeQuery& q, const AttentionState& state) {
  Attend(kv, spans, num_spans, q, state);
}
#else
void PagedAttentionAvx512(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                          const DecodeQuery& q, const AttentionState& state) {
  Attend(kv, spans, num_spans, q, state);
}
#endif

}  // namespace internal
}  // namespace fluxion::kernels::cpu
