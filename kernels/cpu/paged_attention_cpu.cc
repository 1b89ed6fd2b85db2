#include "kernels/cpu/paged_attention_cpu.h"

#include "kernels/cpu/bf16_avx2.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/math_avx2.h"
#include "kernels/cpu/merge_state.h"
#include "kernels/cpu/paged_attention_impl.h"
#include "kernels/cpu/span_rows.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace fluxion::kernels::cpu {
namespace {

constexpr int64_t kHeadBlock = 4;  // query heads sharing one pass over a K/V row

}  // namespace

namespace internal {

void PagedAttentionAvx2(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                        const DecodeQuery& q, const AttentionState& state) {
  const int64_t d = kv.head_dim, group = q.group, chunks = d / kChunk;
  // Heads are padded to a multiple of kHeadBlock with zero queries so the inner loops have a
  // fixed width; padded heads' results are never read.
  const int64_t padded = (group + kHeadBlock - 1) / kHeadBlock * kHeadBlock;
  alignas(32) float qd[kMaxGroup * kMaxHeadDim];   // scaled, deinterleaved queries
  alignas(32) float acc[kMaxGroup * kMaxHeadDim];  // deinterleaved output accumulators
  alignas(32) float scores[kMaxGroup][kMaxSpanRows];
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) DeinterleaveQuery(q.q + g * d, d, q.scale, qd + g * d);
  std::fill(qd + group * d, qd + padded * d, 0.0f);
  std::fill(acc, acc + padded * d, 0.0f);
  std::fill(running_max, running_max + padded, -INFINITY);
  std::fill(running_sum, running_sum + padded, 0.0f);

  SpanRows span_rows(kv, spans, num_spans);
  RowBatch batch;
  while (span_rows.Next(&batch)) {
    const int64_t rows = batch.rows;

    // Scores: each K row is loaded and converted once per block of four heads.
    for (int64_t hb = 0; hb < padded; hb += kHeadBlock) {
      const float* q0 = qd + hb * d;
      for (int64_t r = 0; r < rows; ++r) {
        const bf16* k = batch.k[r];
        alignas(16) float four[4];
        _mm_store_ps(four, ScoreFourHeads(k, q0, d));
        for (int64_t j = 0; j < kHeadBlock; ++j) scores[hb + j][r] = four[j];
      }
    }

    // Online softmax: new running maximum, rescale factor for what was accumulated, weights.
    float correction[kMaxGroup];
    for (int64_t g = 0; g < padded; ++g) {
      float span_max = -INFINITY;
      for (int64_t r = 0; r < rows; ++r) span_max = std::max(span_max, scores[g][r]);
      const float new_max = std::max(running_max[g], span_max);
      correction[g] = std::exp(running_max[g] - new_max);
      running_sum[g] = running_sum[g] * correction[g] +
                       ExpShiftedInPlace(scores[g], rows, new_max);
      running_max[g] = new_max;
    }

    // Weighted V rows: four heads' accumulators for one 16-wide chunk stay in registers across
    // all rows of the span; each V chunk is loaded and converted once per head block.
    for (int64_t hb = 0; hb < padded; hb += kHeadBlock) {
      const __m256 c0 = _mm256_set1_ps(correction[hb]), c1 = _mm256_set1_ps(correction[hb + 1]),
                   c2 = _mm256_set1_ps(correction[hb + 2]), c3 = _mm256_set1_ps(correction[hb + 3]);
      for (int64_t c = 0; c < chunks; ++c) {
        float* a = acc + hb * d + c * kChunk;
        __m256 e0 = _mm256_mul_ps(_mm256_load_ps(a), c0);
        __m256 o0 = _mm256_mul_ps(_mm256_load_ps(a + 8), c0);
        __m256 e1 = _mm256_mul_ps(_mm256_load_ps(a + d), c1);
        __m256 o1 = _mm256_mul_ps(_mm256_load_ps(a + d + 8), c1);
        __m256 e2 = _mm256_mul_ps(_mm256_load_ps(a + 2 * d), c2);
        __m256 o2 = _mm256_mul_ps(_mm256_load_ps(a + 2 * d + 8), c2);
        __m256 e3 = _mm256_mul_ps(_mm256_load_ps(a + 3 * d), c3);
        __m256 o3 = _mm256_mul_ps(_mm256_load_ps(a + 3 * d + 8), c3);
        for (int64_t r = 0; r < rows; ++r) {
          const Bf16Pair vv = LoadBf16x16(batch.v[r] + c * kChunk);
          __m256 p = _mm256_broadcast_ss(&scores[hb][r]);
          e0 = _mm256_fmadd_ps(p, vv.even, e0);
          o0 = _mm256_fmadd_ps(p, vv.odd, o0);
          p = _mm256_broadcast_ss(&scores[hb + 1][r]);
          e1 = _mm256_fmadd_ps(p, vv.even, e1);
          o1 = _mm256_fmadd_ps(p, vv.odd, o1);
          p = _mm256_broadcast_ss(&scores[hb + 2][r]);
          e2 = _mm256_fmadd_ps(p, vv.even, e2);
          o2 = _mm256_fmadd_ps(p, vv.odd, o2);
          p = _mm256_broadcast_ss(&scores[hb + 3][r]);
          e3 = _mm256_fmadd_ps(p, vv.even, e3);
          o3 = _mm256_fmadd_ps(p, vv.odd, o3);
        }
        _mm256_store_ps(a, e0);
        _mm256_store_ps(a + 8, o0);
        _mm256_store_ps(a + d, e1);
        _mm256_store_ps(a + d + 8, o1);
        _mm256_store_ps(a + 2 * d, e2);
        _mm256_store_ps(a + 2 * d + 8, o2);
        _mm256_store_ps(a + 3 * d, e3);
        _mm256_store_ps(a + 3 * d + 8, o3);
      }
    }
  }

  for (int64_t g = 0; g < group; ++g) {
    float* out = state.out + g * d;
    if (running_sum[g] == 0.0f) {
      std::fill(out, out + d, 0.0f);  // no rows: empty state
      state.lse[g] = -INFINITY;
      continue;
    }
    const __m256 inv = _mm256_set1_ps(1.0f / running_sum[g]);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* a = acc + g * d + c * kChunk;
      const __m256 e = _mm256_mul_ps(_mm256_load_ps(a), inv);
      const __m256 o = _mm256_mul_ps(_mm256_load_ps(a + 8), inv);
      const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
      _mm256_storeu_ps(out + c * kChunk, _mm256_permute2f128_ps(lo, hi, 0x20));
      _mm256_storeu_ps(out + c * kChunk + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
    state.lse[g] = running_max[g] + std::log(running_sum[g]);
  }
}

void PagedAttentionSplitWith(PagedAttentionFn attend, const PagedKvView& kv,
                             const PageSpan* spans, int64_t num_spans, const DecodeQuery& q,
                             const AttentionState& state, int threads) {
  if (threads <= 0) threads = omp_get_max_threads();
  threads = static_cast<int>(std::min<int64_t>(threads, num_spans));
  if (threads <= 1) {
    attend(kv, spans, num_spans, q, state);
    return;
  }
  const int64_t gd = q.group * kv.head_dim;
  std::vector<float> outs(threads * gd), lses(threads * q.group);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = num_spans * t / threads, end = num_spans * (t + 1) / threads;
    attend(kv, spans + begin, end - begin, q, {outs.data() + t * gd, lses.data() + t * q.group});
  }
  std::copy_n(outs.data(), gd, state.out);
  std::copy_n(lses.data(), q.group, state.lse);
  for (int t = 1; t < threads; ++t) {
    MergeAttentionStates(state.out, state.lse, outs.data() + t * gd, lses.data() + t * q.group,
                         q.group, kv.head_dim);
  }
}

namespace {

constexpr CpuKernels kAvx2Kernels = {CpuIsa::kAvx2, kChunk, false, PagedAttentionAvx2,
                                     ScoreRowsAvx2, QuestBlockBoundsAvx2};
#ifdef FLUXION_HAVE_AVX512_KERNELS
// Selection has no bf16 variant: its scores rank rows, and the fp32 kernel is exact to fp32.
constexpr CpuKernels kAvx512Kernels = {CpuIsa::kAvx512, 32, false, PagedAttentionAvx512,
                                       ScoreRowsAvx512, QuestBlockBoundsAvx512};
constexpr CpuKernels kAvx512Bf16Kernels = {CpuIsa::kAvx512Bf16, 32, true,
                                           PagedAttentionAvx512Bf16, ScoreRowsAvx512,
                                           QuestBlockBoundsAvx512};
#endif

}  // namespace

const CpuKernels* RunnableKernels(CpuIsa isa, std::string* why_not) {
  const CpuKernels* kernels = nullptr;
  switch (isa) {
    case CpuIsa::kAvx2:
      kernels = &kAvx2Kernels;
      break;
#ifdef FLUXION_HAVE_AVX512_KERNELS
    case CpuIsa::kAvx512:
      kernels = &kAvx512Kernels;
      break;
    case CpuIsa::kAvx512Bf16:
      kernels = &kAvx512Bf16Kernels;
      break;
#else
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx512Bf16:
      break;
#endif
  }
  if (kernels == nullptr) {
    if (why_not != nullptr) {
      *why_not =
          std::string(CpuIsaName(isa)) + " kernels not compiled (FLUXION_ENABLE_AVX512=OFF)";
    }
    return nullptr;
  }
  if (!CpuCanRun(isa, DetectCpuFeatures())) {
    if (why_not != nullptr) {
      *why_not = isa == CpuIsa::kAvx512Bf16 ? "no AVX-512-BF16" : "no AVX-512";
    }
    return nullptr;
  }
  return kernels;
}

const CpuKernels& ActiveKernels() {
  // ActiveCpuIsa() only ever names an ISA this build has and this CPU runs, so this is non-null;
  // the AVX2 table is the backstop should that ever be broken.
  static const CpuKernels* const kernels = [] {
    const CpuKernels* k = RunnableKernels(ActiveCpuIsa(), nullptr);
    return k != nullptr ? k : &kAvx2Kernels;
  }();
  return *kernels;
}

}  // namespace internal

bool PagedAttentionSupported(int64_t head_dim, int64_t group, int64_t page_tokens) {
  return head_dim > 0 && head_dim % kChunk == 0 && head_dim <= kMaxHeadDim && group >= 1 &&
         group <= kMaxGroup && page_tokens >= 1 && page_tokens <= kMaxSpanRows;
}

void PagedAttention(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                    const DecodeQuery& q, const AttentionState& state) {
  const internal::CpuKernels& k = internal::ActiveKernels();
  const internal::PagedAttentionFn attend = kv.head_dim % k.head_dim_multiple == 0
                                                ? k.paged_attention
                                                : internal::PagedAttentionAvx2;
  attend(kv, spans, num_spans, q, state);
}

void PagedAttentionSplit(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                         const DecodeQuery& q, const AttentionState& state, int threads) {
  internal::PagedAttentionSplitWith(PagedAttention, kv, spans, num_spans, q, state, threads);
}

void PagedAttentionBatch(const PagedAttentionTask* tasks, int64_t num_tasks, int threads) {
  if (threads <= 0) threads = omp_get_max_threads();
  threads = static_cast<int>(std::min<int64_t>(threads, num_tasks));
#pragma omp parallel for num_threads(std::max(threads, 1)) schedule(dynamic, 1) if (threads > 1)
  for (int64_t i = 0; i < num_tasks; ++i) {
    const PagedAttentionTask& t = tasks[i];
    PagedAttention(t.kv, t.spans, t.num_spans, t.q, t.state);
  }
}

void MergeAttentionStates(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                          int64_t group, int64_t head_dim) {
  MergeStates(out_a, lse_a, out_b, lse_b, group, head_dim);
}

}  // namespace fluxion::kernels::cpu
