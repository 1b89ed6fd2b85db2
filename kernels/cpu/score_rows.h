// The selection kernels' walk over key rows (selection.h), shared by the AVX2 and AVX-512 files,
// and the software prefetch that walk needs.
//
// Candidates a sparse policy rescores are islands of a page or less (4 KB of keys at head_dim
// 128, then the page's values) at unrelated addresses; the hardware stream prefetcher does not
// follow them, so every span starts with DRAM misses and the walk runs latency-bound. Asking for
// the span two ahead, one row per row scored (all lines at once measured no better), cut Fluxion's
// rescoring of 5131 rows in 324 spans at 128K from 0.245 to 0.14 ms on one devbox core
// (measured on the devbox, 2026-11-29). The attention kernels do not use it: they read a page's
// keys and values as one 8 KB run, which the hardware prefetcher streams (tried: no gain).
//
// Header-only, SSE-level code with internal linkage: each ISA's file instantiates it with its own
// four-head dot product and compile flags (bf16_avx512.h says why nothing may be shared across
// such files by external linkage).
#ifndef FLUXION_KERNELS_CPU_SCORE_ROWS_H_
#define FLUXION_KERNELS_CPU_SCORE_ROWS_H_

#include <pmmintrin.h>  // _mm_movehdup_ps (SSE3); _mm_prefetch

#include <cstdint>

#include "kernels/paged_attention.h"

namespace fluxion::kernels::cpu {
namespace {

class KeyPrefetcher {
 public:
  static constexpr int64_t kSpansAhead = 2;

  // For scoring spans[s]: prefetches the keys of spans[s + kSpansAhead] (nothing near the end).
  KeyPrefetcher(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans, int64_t s)
      : row_bytes_(kv.head_dim * static_cast<int64_t>(sizeof(bf16))) {
    if (s + kSpansAhead >= num_spans) return;
    const PageSpan& ahead = spans[s + kSpansAhead];
    rows_ = ahead.rows;
    keys_ = reinterpret_cast<const char*>(kv.keys(ahead.page) + ahead.first_row * kv.head_dim);
  }

  // Call once per row r of the span being scored.
  void Row(int64_t r) const {
    if (r >= rows_) return;
    for (int64_t off = 0; off < row_bytes_; off += 64) {
      _mm_prefetch(keys_ + r * row_bytes_ + off, _MM_HINT_T0);
    }
  }

 private:
  const int64_t row_bytes_;
  int64_t rows_ = 0;
  const char* keys_ = nullptr;
};

// MaxGroupScores (all_heads false: scores[row]) or GroupScores (true: scores[row][group]) over
// the rows of `spans`. qd: `padded` (a multiple of 4) query heads, deinterleaved as `score_four`
// expects; score_four(k, qd4) returns the dot products of key row k with the four heads at qd4.
template <typename ScoreFour>
inline void ScoreRowsWith(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans,
                          const float* qd, int64_t group, int64_t padded, bool all_heads,
                          ScoreFour score_four, float* scores) {
  const int64_t d = kv.head_dim;
  for (int64_t s = 0; s < num_spans; ++s) {
    const bf16* rows = kv.keys(spans[s].page) + spans[s].first_row * d;
    const KeyPrefetcher prefetch(kv, spans, num_spans, s);
    for (int64_t r = 0; r < spans[s].rows; ++r) {
      prefetch.Row(r);
      const bf16* k = rows + r * d;
      if (all_heads) {
        // Each block of four heads stored, the padding dropped.
        for (int64_t hb = 0; hb < padded; hb += 4) {
          alignas(16) float four[4];
          _mm_store_ps(four, score_four(k, qd + hb * d));
          for (int64_t j = 0; j < 4 && hb + j < group; ++j) scores[hb + j] = four[j];
        }
        scores += group;
        continue;
      }
      __m128 best = score_four(k, qd);
      for (int64_t hb = 4; hb < padded; hb += 4) {
        best = _mm_max_ps(best, score_four(k, qd + hb * d));
      }
      const __m128 m = _mm_max_ps(best, _mm_movehl_ps(best, best));
      *scores++ = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    }
  }
}

}  // namespace
}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_SCORE_ROWS_H_
