#include "kernels/cpu/paged_attention_cpu.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace fluxion::kernels::cpu {
namespace {

// bf16 -> fp32 is a 16-bit left shift of the bit pattern.
inline __m256 LoadBf16x8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Converts `rows` consecutive bf16 rows of length d into fp32 scratch [rows][d].
inline void ConvertRows(const bf16* src, int64_t rows, int64_t d, float* dst) {
  for (int64_t i = 0; i < rows * d; i += 8) _mm256_storeu_ps(dst + i, LoadBf16x8(src + i));
}

}  // namespace

bool PagedAttentionSupported(int64_t head_dim, int64_t group, int64_t page_tokens) {
  return head_dim > 0 && head_dim % 8 == 0 && head_dim <= kMaxHeadDim && group >= 1 &&
         group <= kMaxGroup && page_tokens >= 1 && page_tokens <= kMaxSpanRows;
}

void PagedAttention(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                    const DecodeQuery& q, const AttentionState& state) {
  const int64_t d = kv.head_dim, group = q.group;
  // Scratch: the span's K and V rows in fp32, scores, and the group's scaled queries. Converting
  // a span once and then sweeping it per head keeps the accumulators in registers for a whole
  // span instead of reloading them for every row.
  alignas(32) float k_rows[kMaxSpanRows * kMaxHeadDim];
  alignas(32) float v_rows[kMaxSpanRows * kMaxHeadDim];
  alignas(32) float qs[kMaxGroup * kMaxHeadDim];
  float scores[kMaxGroup][kMaxSpanRows];
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  for (int64_t i = 0; i < group * d; ++i) qs[i] = q.q[i] * q.scale;
  std::fill(state.out, state.out + group * d, 0.0f);
  std::fill(running_max, running_max + group, -INFINITY);
  std::fill(running_sum, running_sum + group, 0.0f);

  for (int64_t s = 0; s < num_spans; ++s) {
    const PageSpan& span = spans[s];
    const int64_t rows = span.rows;
    if (rows <= 0) continue;
    if (s + 1 < num_spans) {
      // The next span is usually a different, non-adjacent page: start its first lines early.
      _mm_prefetch(reinterpret_cast<const char*>(kv.keys(spans[s + 1].page) +
                                                 spans[s + 1].first_row * d),
                   _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(kv.values(spans[s + 1].page) +
                                                 spans[s + 1].first_row * d),
                   _MM_HINT_T0);
    }
    ConvertRows(kv.keys(span.page) + span.first_row * d, rows, d, k_rows);
    ConvertRows(kv.values(span.page) + span.first_row * d, rows, d, v_rows);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qs + g * d;
      float span_max = -INFINITY;
      for (int64_t r = 0; r < rows; ++r) {
        const float* k = k_rows + r * d;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 16 <= d; t += 16) {
          acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + t), _mm256_loadu_ps(k + t), acc0);
          acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + t + 8), _mm256_loadu_ps(k + t + 8), acc1);
        }
        if (t < d) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + t), _mm256_loadu_ps(k + t), acc0);
        scores[g][r] = HorizontalSum(_mm256_add_ps(acc0, acc1));
        span_max = std::max(span_max, scores[g][r]);
      }
      // Online softmax: rescale what was accumulated so far to the new maximum.
      const float new_max = std::max(running_max[g], span_max);
      const float correction = std::exp(running_max[g] - new_max);
      float sum = running_sum[g] * correction;
      for (int64_t r = 0; r < rows; ++r) {
        scores[g][r] = std::exp(scores[g][r] - new_max);
        sum += scores[g][r];
      }
      running_max[g] = new_max;
      running_sum[g] = sum;
      float* out = state.out + g * d;
      const __m256 corr = _mm256_set1_ps(correction);
      for (int64_t t = 0; t < d; t += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(out + t), corr);
        for (int64_t r = 0; r < rows; ++r) {
          acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[g][r]), _mm256_loadu_ps(v_rows + r * d + t),
                                acc);
        }
        _mm256_storeu_ps(out + t, acc);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* out = state.out + g * d;
    if (running_sum[g] == 0.0f) {
      state.lse[g] = -INFINITY;  // no rows: output stays 0
      continue;
    }
    const float inv = 1.0f / running_sum[g];
    for (int64_t t = 0; t < d; ++t) out[t] *= inv;
    state.lse[g] = running_max[g] + std::log(running_sum[g]);
  }
}

void PagedAttentionSplit(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                         const DecodeQuery& q, const AttentionState& state, int threads) {
  if (threads <= 0) threads = omp_get_max_threads();
  threads = static_cast<int>(std::min<int64_t>(threads, num_spans));
  if (threads <= 1) {
    PagedAttention(kv, spans, num_spans, q, state);
    return;
  }
  const int64_t gd = q.group * kv.head_dim;
  std::vector<float> outs(threads * gd), lses(threads * q.group);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = num_spans * t / threads, end = num_spans * (t + 1) / threads;
    PagedAttention(kv, spans + begin, end - begin, q,
                   {outs.data() + t * gd, lses.data() + t * q.group});
  }
  std::copy_n(outs.data(), gd, state.out);
  std::copy_n(lses.data(), q.group, state.lse);
  for (int t = 1; t < threads; ++t) {
    MergeAttentionStates(state.out, state.lse, outs.data() + t * gd, lses.data() + t * q.group,
                         q.group, kv.head_dim);
  }
}

void MergeAttentionStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                          int64_t group, int64_t head_dim) {
  for (int64_t g = 0; g < group; ++g) {
    const float la = lse_a[g], lb = lse_b[g];
    if (lb == -INFINITY) continue;
    float* oa = out_a + g * head_dim;
    const float* ob = out_b + g * head_dim;
    if (la == -INFINITY) {
      std::copy_n(ob, head_dim, oa);
      lse_a[g] = lb;
      continue;
    }
    const float m = std::max(la, lb);
    const float wa = std::exp(la - m), wb = std::exp(lb - m);
    const float inv = 1.0f / (wa + wb);
    for (int64_t t = 0; t < head_dim; ++t) oa[t] = (wa * oa[t] + wb * ob[t]) * inv;
    lse_a[g] = m + std::log(wa + wb);
  }
}

}  // namespace fluxion::kernels::cpu
