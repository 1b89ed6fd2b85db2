// AVX-512 versions of the selection kernels (selection.h), compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mfma and reached only through the dispatcher on CPUs that have them.
// Same results as the AVX2 kernels up to fp32 summation order. Everything except the entry
// points has internal linkage (bf16_avx512.h says why).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "kernels/cpu/bf16_avx512.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/paged_attention_impl.h"
#include "kernels/cpu/score_rows.h"

namespace fluxion::kernels::cpu {
namespace {

// Lanes of the 16-wide step starting at element j of a d-long row.
inline __mmask16 StepLanes(int64_t d, int64_t j) { return FirstLanes(d - j < 16 ? d - j : 16); }

}  // namespace

namespace internal {

void ScoreRowsAvx512(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                     const float* q, int64_t group, bool all_heads, float* scores) {
  const int64_t d = kv.head_dim;
  const int64_t padded = (group + 3) / 4 * 4;
  alignas(64) float qd[kMaxGroup * kMaxHeadDim];
  for (int64_t g = 0; g < padded; ++g) {
    // Padding heads repeat head 0 so they never raise the maximum.
    DeinterleaveQuery32(q + (g < group ? g : 0) * d, d, 1.0f, qd + g * d);
  }
  ScoreRowsWith(kv, spans, num_spans, qd, group, padded, all_heads,
                [d](const bf16* k, const float* q4) { return ScoreFourHeads512(k, q4, d); },
                scores);
}

void QuestBlockBoundsAvx512(const float* key_min, const float* key_max, int64_t d,
                            int64_t first_block, int64_t num_blocks, int64_t pages_per_block,
                            const float* q, int64_t group, float* out) {
  alignas(64) float lo[kMaxHeadDim], hi[kMaxHeadDim];
  // Head dims are walked 16 at a time with a masked last step, so any head_dim works; masked-off
  // lanes load as 0 and add max(0, 0) = 0 to the bound.
  const int64_t steps = (d + 15) / 16;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t p0 = (first_block + b) * pages_per_block;
    const float* mn = key_min + p0 * d;
    const float* mx = key_max + p0 * d;
    if (pages_per_block > 1) {
      // Merge the block's page bounds first: one pass per extra page.
      for (int64_t i = 0; i < steps; ++i) {
        const int64_t j = i * 16;
        const __mmask16 m = StepLanes(d, j);
        __m512 l = _mm512_maskz_loadu_ps(m, mn + j), h = _mm512_maskz_loadu_ps(m, mx + j);
        for (int64_t p = 1; p < pages_per_block; ++p) {
          l = _mm512_min_ps(l, _mm512_maskz_loadu_ps(m, mn + p * d + j));
          h = _mm512_max_ps(h, _mm512_maskz_loadu_ps(m, mx + p * d + j));
        }
        _mm512_store_ps(lo + j, l);
        _mm512_store_ps(hi + j, h);
      }
      mn = lo;
      mx = hi;
    }
    float best = -INFINITY;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < steps; ++i) {
        const int64_t j = i * 16;
        const __mmask16 m = StepLanes(d, j);
        const __m512 qv = _mm512_maskz_loadu_ps(m, qg + j);
        acc =
            _mm512_add_ps(acc, _mm512_max_ps(_mm512_mul_ps(qv, _mm512_maskz_loadu_ps(m, mn + j)),
                                             _mm512_mul_ps(qv, _mm512_maskz_loadu_ps(m, mx + j))));
      }
      const float bound = _mm512_reduce_add_ps(acc);
      if (bound > best) best = bound;
    }
    out[b] = best;
  }
}

}  // namespace internal
}  // namespace fluxion::kernels::cpu
