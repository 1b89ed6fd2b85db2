// Internal to kernels/cpu: the K/V rows of a span list in batches of up to kRowBatch rows,
// whatever the spans' lengths. The attention kernels run one online-softmax update (a rescale of
// every accumulator) per batch, so a plan of one-row spans (token-level policies: LFPS, exact
// top-k) costs what a plan of whole pages costs; per span it made LFPS's attention 3-5x slower
// than a block policy's over as many rows (measured at 8B shapes on the H200 host).
//
// Thread-compatible: one per kernel call.
#ifndef FLUXION_KERNELS_CPU_SPAN_ROWS_H_
#define FLUXION_KERNELS_CPU_SPAN_ROWS_H_

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/paged_attention.h"

namespace fluxion::kernels::cpu::internal {

// Rows per batch (one online-softmax update): a 16-token page's worth. Batches of 32 and 64 rows
// measured slower over whole pages (full attention, one core: the V loop walks the batch chunk
// by chunk, touching a line of every row at a time, and more rows than a page's outrun what the
// L1 and its prefetchers keep streaming), while 16 already turns one-row spans into 16x fewer
// updates.
inline constexpr int64_t kRowBatch = 16;
static_assert(kRowBatch <= kMaxSpanRows, "the kernels' score scratch holds kMaxSpanRows rows");

struct RowBatch {
  const bf16* k[kMaxSpanRows];
  const bf16* v[kMaxSpanRows];
  int64_t rows = 0;
};

class SpanRows {
 public:
  SpanRows(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans)
      : kv_(kv), spans_(spans), num_spans_(num_spans) {
    Gather(&ahead_);
    Prefetch(ahead_);
  }

  // The next batch of rows in span order (a span may be cut between two batches); false when
  // none are left. The batch after it is gathered now and every cache line of its K and V rows
  // prefetched, so its loads are in flight while the caller computes on this one: scattered
  // one-row spans (token-level policies) otherwise stall on each row's lines in turn, and even
  // whole pages lose the hardware prefetcher at every jump to a non-adjacent page.
  bool Next(RowBatch* b) {
    if (ahead_.rows == 0) return false;
    b->rows = ahead_.rows;
    std::copy_n(ahead_.k, ahead_.rows, b->k);
    std::copy_n(ahead_.v, ahead_.rows, b->v);
    Gather(&ahead_);
    Prefetch(ahead_);
    return true;
  }

 private:
  void Gather(RowBatch* b) {
    const int64_t d = kv_.head_dim;
    b->rows = 0;
    while (b->rows < kRowBatch && span_ < num_spans_) {
      const PageSpan& s = spans_[span_];
      const int64_t take = std::min<int64_t>(s.rows - row_, kRowBatch - b->rows);
      if (take <= 0) {
        ++span_;
        row_ = 0;
        continue;
      }
      const bf16* k = kv_.keys(s.page) + (s.first_row + row_) * d;
      const bf16* v = kv_.values(s.page) + (s.first_row + row_) * d;
      for (int64_t r = 0; r < take; ++r) {
        b->k[b->rows + r] = k + r * d;
        b->v[b->rows + r] = v + r * d;
      }
      b->rows += take;
      row_ += take;
      if (row_ >= s.rows) {
        ++span_;
        row_ = 0;
      }
    }
  }

  // Every line of every row. Measured on one devbox core at 128K (`fluxion bench attention`, its
  // att GB/s column): exact top-k's rows 1.5-2.2x faster than prefetching one line a span piece;
  // whole pages (full, fixed_32) 0-10% slower, the hardware's stream prefetcher already fetching
  // them. Leaving batches that are one run of adjacent rows to that prefetcher (first lines only)
  // made exact top-k 2x slower still: its one-page runs are scattered, and a stream is not
  // trained in time for 16 rows.
  void Prefetch(const RowBatch& b) const {
    const int64_t row_bytes = kv_.head_dim * static_cast<int64_t>(sizeof(bf16));
    for (int64_t r = 0; r < b.rows; ++r) {
      const char* k = reinterpret_cast<const char*>(b.k[r]);
      const char* v = reinterpret_cast<const char*>(b.v[r]);
      for (int64_t off = 0; off < row_bytes; off += kCacheLine) {
        _mm_prefetch(k + off, _MM_HINT_T0);
        _mm_prefetch(v + off, _MM_HINT_T0);
      }
    }
  }

  static constexpr int64_t kCacheLine = 64;
  const PagedKvView& kv_;
  const PageSpan* spans_;
  int64_t num_spans_;
  int64_t span_ = 0, row_ = 0;
  RowBatch ahead_;  // the batch Next returns next, its lines already requested
};

}  // namespace fluxion::kernels::cpu::internal

#endif  // FLUXION_KERNELS_CPU_SPAN_ROWS_H_
