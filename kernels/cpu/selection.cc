#include "kernels/cpu/selection.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/bf16_avx2.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/cpu/math_avx2.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cpu/paged_attention_impl.h"
#include "kernels/cpu/score_rows.h"

namespace fluxion::kernels::cpu {
namespace internal {

void ScoreRowsAvx2(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                   const float* q, int64_t group, bool all_heads, float* scores) {
  const int64_t d = kv.head_dim;
  const int64_t padded = (group + 3) / 4 * 4;
  alignas(32) float qd[kMaxGroup * kMaxHeadDim];
  for (int64_t g = 0; g < padded; ++g) {
    // Padding heads repeat head 0 so they never raise the maximum.
    DeinterleaveQuery(q + (g < group ? g : 0) * d, d, 1.0f, qd + g * d);
  }
  ScoreRowsWith(kv, spans, num_spans, qd, group, padded, all_heads,
                [d](const bf16* k, const float* q4) { return ScoreFourHeads(k, q4, d); }, scores);
}

void QuestBlockBoundsAvx2(const float* key_min, const float* key_max, int64_t d,
                          int64_t first_block, int64_t num_blocks, int64_t pages_per_block,
                          const float* q, int64_t group, float* out) {
  alignas(32) float lo[kMaxHeadDim], hi[kMaxHeadDim];
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t p0 = (first_block + b) * pages_per_block;
    const float* mn = key_min + p0 * d;
    const float* mx = key_max + p0 * d;
    if (pages_per_block > 1) {
      // Merge the block's page bounds first: one pass per extra page.
      for (int64_t j = 0; j < d; j += 8) {
        __m256 l = _mm256_loadu_ps(mn + j), h = _mm256_loadu_ps(mx + j);
        for (int64_t p = 1; p < pages_per_block; ++p) {
          l = _mm256_min_ps(l, _mm256_loadu_ps(mn + p * d + j));
          h = _mm256_max_ps(h, _mm256_loadu_ps(mx + p * d + j));
        }
        _mm256_store_ps(lo + j, l);
        _mm256_store_ps(hi + j, h);
      }
      mn = lo;
      mx = hi;
    }
    __m256 best = _mm256_set1_ps(-INFINITY);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < d; j += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + j);
        acc = _mm256_add_ps(acc, _mm256_max_ps(_mm256_mul_ps(qv, _mm256_loadu_ps(mn + j)),
                                               _mm256_mul_ps(qv, _mm256_loadu_ps(mx + j))));
      }
      best = _mm256_max_ps(best, _mm256_set1_ps(HorizontalSum8(acc)));
    }
    out[b] = HorizontalMax8(best);
  }
}

}  // namespace internal

// All dispatch through the table chosen once per process (cpu_features.h); head dims the ISA's
// kernels do not take go to AVX2.
namespace {

void ScoreRows(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans, const float* q,
               int64_t group, bool all_heads, float* scores) {
  const internal::CpuKernels& k = internal::ActiveKernels();
  const internal::ScoreRowsFn score =
      kv.head_dim % k.head_dim_multiple == 0 ? k.score_rows : internal::ScoreRowsAvx2;
  score(kv, spans, num_spans, q, group, all_heads, scores);
}

}  // namespace

void MaxGroupScores(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                    const float* q, int64_t group, float* scores) {
  ScoreRows(kv, spans, num_spans, q, group, /*all_heads=*/false, scores);
}

void GroupScores(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans, const float* q,
                 int64_t group, float* scores) {
  ScoreRows(kv, spans, num_spans, q, group, /*all_heads=*/true, scores);
}

namespace {

// Walks the spans in chunks of >= rows_per_task rows (the last may be shorter) and scores each
// chunk as one task; `per_row` is the number of scores a row writes.
void ScoreInTasks(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans, const float* q,
                  int64_t group, bool all_heads, float* scores, int64_t rows_per_task) {
  struct Chunk {
    int64_t first_span, first_row;
  };
  // The chunk list of this thread's call: reused, so a step allocates nothing here once warm.
  thread_local std::vector<Chunk> chunks;
  chunks.clear();
  int64_t rows = 0, in_chunk = rows_per_task;
  for (int64_t i = 0; i < num_spans; ++i) {
    if (in_chunk >= rows_per_task) {
      chunks.push_back({i, rows});
      in_chunk = 0;
    }
    rows += spans[i].rows;
    in_chunk += spans[i].rows;
  }
  chunks.push_back({num_spans, rows});  // the end
  const std::vector<Chunk>& c = chunks;
  const int64_t per_row = all_heads ? group : 1;
  RunAsTasks(static_cast<int64_t>(c.size()) - 1, [&](int64_t j) {
    ScoreRows(kv, spans + c[j].first_span, c[j + 1].first_span - c[j].first_span, q, group,
              all_heads, scores + c[j].first_row * per_row);
  });
}

}  // namespace

void GroupScoresInTasks(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                        const float* q, int64_t group, float* scores, int64_t rows_per_task) {
  ScoreInTasks(kv, spans, num_spans, q, group, /*all_heads=*/true, scores,
               std::max<int64_t>(rows_per_task, 1));
}

void MaxGroupScoresInTasks(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                           const float* q, int64_t group, float* scores, int64_t rows_per_task) {
  ScoreInTasks(kv, spans, num_spans, q, group, /*all_heads=*/false, scores,
               std::max<int64_t>(rows_per_task, 1));
}

void QuestBlockBounds(const float* key_min, const float* key_max, int64_t head_dim,
                      int64_t first_block, int64_t num_blocks, int64_t pages_per_block,
                      const float* q, int64_t group, float* out) {
  internal::ActiveKernels().quest_block_bounds(key_min, key_max, head_dim, first_block,
                                               num_blocks, pages_per_block, q, group, out);
}

}  // namespace fluxion::kernels::cpu
