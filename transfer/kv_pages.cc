#include "transfer/kv_pages.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/half.h"

namespace fluxion::transfer {

absl::StatusOr<std::vector<uint64_t>> ExpandPageRuns(absl::Span<const PageIdRun> runs,
                                                     uint64_t expected, uint64_t arena_pages) {
  std::vector<uint64_t> ids;
  uint64_t total = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    const PageIdRun& r = runs[i];
    if (r.count == 0) return absl::InvalidArgumentError(absl::StrCat("page extent ", i, " is empty"));
    if (r.first >= arena_pages || r.count > arena_pages - r.first) {
      return absl::InvalidArgumentError(
          absl::StrCat("page extent ", i, " [", r.first, ", +", r.count, ") lies outside the ",
                       arena_pages, "-page arena"));
    }
    total += r.count;
    if (total > expected) break;
  }
  if (total != expected) {
    return absl::InvalidArgumentError(absl::StrCat("the page extents hold ", total,
                                                   " pages or more; the prompt needs exactly ",
                                                   expected));
  }
  ids.reserve(expected);
  for (const PageIdRun& r : runs) {
    for (uint64_t p = 0; p < r.count; ++p) ids.push_back(r.first + p);
  }
  return ids;
}

void PackLayerRows(const KvPageGeometry& g, int64_t tokens, int64_t first, int64_t end,
                   const float* k, const float* v, int64_t row_stride, uint8_t* dst) {
  const int64_t pt = g.page_tokens, d = g.head_dim, pages = g.pages_per_head(tokens);
  const size_t page_bytes = g.content_bytes();
  for (int64_t h = 0; h < g.num_kv_heads; ++h) {
    for (int64_t t = first; t < end; ++t) {
      const int64_t page = t / pt, slot = t % pt;
      bf16* kp = reinterpret_cast<bf16*>(dst + (h * pages + page) * page_bytes) + slot * d;
      bf16* vp = kp + pt * d;
      const float* ks = k + (t - first) * row_stride + h * d;
      const float* vs = v + (t - first) * row_stride + h * d;
      for (int64_t i = 0; i < d; ++i) {
        kp[i] = FloatToBf16(ks[i]);
        vp[i] = FloatToBf16(vs[i]);
      }
    }
  }
}

void PackLayerPages(const KvPageGeometry& g, int64_t tokens, const float* k, const float* v,
                    int64_t row_stride, uint8_t* dst) {
  std::memset(dst, 0, g.content_bytes() * g.pages_per_layer(tokens));
  PackLayerRows(g, tokens, 0, tokens, k, v, row_stride, dst);
}

void PackPageRange(const KvPageGeometry& g, int64_t tokens, int64_t first_page, int64_t end_page,
                   const float* k, const float* v, int64_t row_stride, uint8_t* dst) {
  const int64_t pt = g.page_tokens, d = g.head_dim, count = end_page - first_page;
  const size_t page_bytes = g.content_bytes();
  for (int64_t h = 0; h < g.num_kv_heads; ++h) {
    for (int64_t i = 0; i < count; ++i) {
      bf16* kp = reinterpret_cast<bf16*>(dst + (h * count + i) * page_bytes);
      bf16* vp = kp + pt * d;
      const int64_t t0 = (first_page + i) * pt;
      const int64_t rows = std::min(pt, tokens - t0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* ks = k + (t0 + r) * row_stride + h * d;
        const float* vs = v + (t0 + r) * row_stride + h * d;
        for (int64_t e = 0; e < d; ++e) {
          kp[r * d + e] = FloatToBf16(ks[e]);
          vp[r * d + e] = FloatToBf16(vs[e]);
        }
      }
      if (rows < pt) {
        std::memset(kp + rows * d, 0, static_cast<size_t>((pt - rows) * d) * sizeof(bf16));
        std::memset(vp + rows * d, 0, static_cast<size_t>((pt - rows) * d) * sizeof(bf16));
      }
    }
  }
}

}  // namespace fluxion::transfer
