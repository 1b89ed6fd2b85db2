// Test helper: the problem generator and the per-pair comparison of the attention-backend
// conformance suite (kernels/attention_backend_test.cc), shared with the device variant of the
// suite (kernels/cuda/attention_backend_cuda_test.cc) so that every backend is held to the same
// problems. Host memory only; a device test copies the problem over.
#ifndef FLUXION_KERNELS_ATTENTION_BACKEND_TESTING_H_
#define FLUXION_KERNELS_ATTENTION_BACKEND_TESTING_H_

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "common/half.h"
#include "gtest/gtest.h"
#include "kernels/attention_backend.h"
#include "kernels/reference/compare.h"

namespace fluxion::kernels::backend_testing {

enum class Layout { kWhole, kSparse, kSomeEmpty, kAllEmpty, kLong };

inline std::string LayoutName(Layout l) {
  switch (l) {
    case Layout::kWhole:
      return "Whole";
    case Layout::kSparse:
      return "Sparse";
    case Layout::kSomeEmpty:
      return "SomeEmpty";
    case Layout::kAllEmpty:
      return "AllEmpty";
    case Layout::kLong:
      return "Long";
  }
  return "Unknown";
}

struct Problem {
  std::vector<uint8_t> arena;
  std::vector<float> q;
  std::vector<int64_t> indptr;
  std::vector<PageSpan> spans;
  PagedDecodeProblem p;
};

// Builds a batch of `batch` requests with contexts of different lengths; each (request, KV head)
// pair owns its own pages, placed at shuffled positions in one arena.
inline std::unique_ptr<Problem> MakeProblem(int64_t batch, int64_t hq, int64_t hkv, int64_t d,
                                            Layout layout, uint32_t seed) {
  auto pr = std::make_unique<Problem>();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t page_tokens = layout == Layout::kLong ? 64 : 16;
  std::vector<int64_t> contexts(batch);
  for (int64_t r = 0; r < batch; ++r) {
    contexts[r] = layout == Layout::kLong ? 1500 + 97 * r : 1 + (37 * r + 53) % 200;
  }
  std::vector<int64_t> pages_of(batch * hkv);
  int64_t total_pages = 0;
  for (int64_t pair = 0; pair < batch * hkv; ++pair) {
    pages_of[pair] = (contexts[pair / hkv] + page_tokens - 1) / page_tokens;
    total_pages += pages_of[pair];
  }
  const int64_t arena_pages = total_pages + 5;
  std::vector<int32_t> ids(arena_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  PagedKvView kv;
  kv.page_tokens = page_tokens;
  kv.head_dim = d;
  kv.page_bytes = 2 * page_tokens * d * sizeof(bf16) + 64;
  pr->arena.resize(arena_pages * kv.page_bytes);
  for (size_t i = 0; i < pr->arena.size() / sizeof(bf16); ++i) {
    reinterpret_cast<bf16*>(pr->arena.data())[i] = FloatToBf16(normal(rng));
  }
  kv.arena = pr->arena.data();
  pr->q.resize(batch * hq * d);
  for (float& x : pr->q) x = normal(rng) * 1.5f;

  std::bernoulli_distribution keep(0.4), single(0.2), empty_pair(0.4);
  pr->indptr.push_back(0);
  int64_t next_id = 0;
  for (int64_t pair = 0; pair < batch * hkv; ++pair) {
    const int64_t ctx = contexts[pair / hkv];
    const bool empty = layout == Layout::kAllEmpty ||
                       (layout == Layout::kSomeEmpty && (pair == 0 || empty_pair(rng)));
    for (int64_t i = 0; i < pages_of[pair]; ++i) {
      const int32_t page = ids[next_id++];
      const int32_t rows = static_cast<int32_t>(std::min(page_tokens, ctx - i * page_tokens));
      if (empty) continue;
      if (layout == Layout::kSparse || layout == Layout::kSomeEmpty) {
        if (!keep(rng) && i + 1 < pages_of[pair]) continue;  // the newest page always kept
        if (single(rng)) {
          pr->spans.push_back({page, static_cast<int32_t>(rng() % rows), 1});
          continue;
        }
        const int32_t first = static_cast<int32_t>(rng() % rows);
        pr->spans.push_back({page, first, rows - first});
        continue;
      }
      pr->spans.push_back({page, 0, rows});
    }
    pr->indptr.push_back(static_cast<int64_t>(pr->spans.size()));
  }
  PagedDecodeProblem& p = pr->p;
  p.q = pr->q.data();
  p.kv = kv;
  p.span_indptr = pr->indptr.data();
  p.spans = pr->spans.data();
  p.num_spans = static_cast<int64_t>(pr->spans.size());
  p.num_requests = batch;
  p.num_qo_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(d));
  return pr;
}

struct Tolerance {
  double out_rel_l2, lse_abs;
};

// The grid every backend runs: batch sizes, (query heads, KV heads), head dims, layouts.
inline std::vector<int64_t> ConformanceBatches() { return {1, 3, 8}; }
inline std::vector<std::pair<int64_t, int64_t>> ConformanceHeads() {
  return {{2, 2}, {4, 2}, {14, 2}, {8, 1}};
}
inline std::vector<int64_t> ConformanceHeadDims() { return {64, 128}; }
inline std::vector<Layout> ConformanceLayouts() {
  return {Layout::kWhole, Layout::kSparse, Layout::kSomeEmpty, Layout::kAllEmpty, Layout::kLong};
}
inline uint32_t ConformanceSeed(int64_t batch, int64_t hq, int64_t d) {
  return static_cast<uint32_t>(1000 + 7 * batch + hq + d);
}

// Per (request, KV head) pair of `pr`: empty pairs give exactly lse -inf and out 0; others are
// within `tol` of the reference outputs `want_*`.
inline void ExpectMatchesReference(const Problem& pr, const std::vector<float>& want_out,
                                   const std::vector<float>& want_lse,
                                   const std::vector<float>& got_out_all,
                                   const std::vector<float>& got_lse, Tolerance tol) {
  const PagedDecodeProblem& p = pr.p;
  const int64_t hq = p.num_qo_heads, hkv = p.num_kv_heads, d = p.head_dim;
  const int64_t group = hq / hkv;
  for (int64_t pair = 0; pair < p.num_pairs(); ++pair) {
    const int64_t r = pair / hkv, h = pair % hkv;
    const int64_t head0 = r * hq + h * group;
    const bool empty = pr.indptr[pair] == pr.indptr[pair + 1];
    const absl::Span<const float> got_out(got_out_all.data() + head0 * d, group * d);
    const absl::Span<const float> want(want_out.data() + head0 * d, group * d);
    if (empty) {
      for (int64_t g = 0; g < group; ++g) {
        EXPECT_EQ(got_lse[head0 + g], -INFINITY) << "request " << r << " kv head " << h;
      }
      for (float x : got_out) ASSERT_EQ(x, 0.0f) << "request " << r << " kv head " << h;
      continue;
    }
    EXPECT_LE(reference::RelativeL2Error(got_out, want), tol.out_rel_l2)
        << "request " << r << " kv head " << h;
    for (int64_t g = 0; g < group; ++g) {
      EXPECT_NEAR(got_lse[head0 + g], want_lse[head0 + g], tol.lse_abs)
          << "request " << r << " query head " << h * group + g;
    }
  }
}

}  // namespace fluxion::kernels::backend_testing

#endif  // FLUXION_KERNELS_ATTENTION_BACKEND_TESTING_H_
