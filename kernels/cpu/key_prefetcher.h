// Software prefetch for the selection kernels' walk over key rows (selection.h).
//
// Candidates a sparse policy rescores are islands of a page or less (4 KB of keys at head_dim
// 128, then the page's values) at unrelated addresses; the hardware stream prefetcher does not
// follow them, so every span starts with DRAM misses and the walk runs latency-bound. Asking for
// the span two ahead, one row per row scored (all lines at once measured no better), cut Fluxion's
// rescoring of 5131 rows in 324 spans at 128K from 0.245 to 0.14 ms on one devbox core
// (bench/results/README.md, session 5). The attention kernels do not use it: they read a page's
// keys and values as one 8 KB run, which the hardware prefetcher streams (tried: no gain).
//
// Header-only and instruction-set neutral (_mm_prefetch is SSE), for the AVX2 and AVX-512 files.
#ifndef FLUXION_KERNELS_CPU_KEY_PREFETCHER_H_
#define FLUXION_KERNELS_CPU_KEY_PREFETCHER_H_

#include <xmmintrin.h>

#include <cstdint>

#include "kernels/paged_attention.h"

namespace fluxion::kernels::cpu {

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

}  // namespace fluxion::kernels::cpu

#endif  // FLUXION_KERNELS_CPU_KEY_PREFETCHER_H_
