// The selection kernels against scalar double-precision twins computed here, for every
// implementation: the public (dispatching) functions and each ISA's kernels directly; the ones
// this CPU or build lacks skip.
#include "kernels/cpu/selection.h"

#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/impl_testing.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/cpu/paged_attention_impl.h"

namespace fluxion::kernels::cpu {
namespace {

using impl_testing::Impl;
using impl_testing::ImplName;

// `pages` pages of `pt` tokens of random bf16 K/V rows (head_dim d) and the view over them.
struct RandomPages {
  RandomPages(int64_t pages, int64_t pt, int64_t d, std::mt19937& rng)
      : page_bytes(2 * pt * d * sizeof(bf16)), arena(pages * page_bytes) {
    std::normal_distribution<float> normal(0, 1);
    auto* all = reinterpret_cast<bf16*>(arena.data());
    for (size_t i = 0; i < arena.size() / 2; ++i) all[i] = FloatToBf16(normal(rng));
    kv = PagedKvView{arena.data(), page_bytes, pt, d};
  }
  size_t page_bytes;
  std::vector<uint8_t> arena;
  PagedKvView kv;
};

class SelectionTest : public ::testing::TestWithParam<Impl> {
 protected:
  void SetUp() override {
    if (GetParam() == Impl::kDispatched) return;
    const CpuIsa isa = GetParam() == Impl::kAvx2     ? CpuIsa::kAvx2
                       : GetParam() == Impl::kAvx512 ? CpuIsa::kAvx512
                                                     : CpuIsa::kAvx512Bf16;
    std::string why_not;
    kernels_ = internal::RunnableKernels(isa, &why_not);
    if (kernels_ == nullptr) GTEST_SKIP() << why_not;
  }

  // False when a directly called kernel does not take this head_dim (the dispatcher would send
  // it to AVX2).
  bool Takes(int64_t head_dim) const {
    return kernels_ == nullptr || head_dim % kernels_->head_dim_multiple == 0;
  }

  // The kernels under test: the public (dispatching) functions, or one ISA's table entries.
  void Scores(const PagedKvView& kv, const PageSpan* spans, int64_t num_spans, const float* q,
              int64_t group, bool all_heads, float* scores) const {
    if (kernels_ != nullptr) {
      kernels_->score_rows(kv, spans, num_spans, q, group, all_heads, scores);
    } else if (all_heads) {
      GroupScores(kv, spans, num_spans, q, group, scores);
    } else {
      MaxGroupScores(kv, spans, num_spans, q, group, scores);
    }
  }

  void Bounds(const float* mn, const float* mx, int64_t d, int64_t first_block, int64_t blocks,
              int64_t ppb, const float* q, int64_t group, float* out) const {
    const auto bounds = kernels_ != nullptr ? kernels_->quest_block_bounds : QuestBlockBounds;
    bounds(mn, mx, d, first_block, blocks, ppb, q, group, out);
  }

  const internal::CpuKernels* kernels_ = nullptr;  // null: the public functions
};

// MaxGroupScores (the group's maximum per row) and GroupScores (every head's score per row).
TEST_P(SelectionTest, GroupScoresAndTheirMaximumMatchScalarDotProducts) {
  // 80 is a multiple of 16 but not of 32: only AVX2 (and the dispatcher, through it) take it.
  for (int64_t d : {64, 96, 80}) {
    if (!Takes(d)) continue;
    for (int64_t group : {1, 3, 4, 7}) {
      std::mt19937 rng(group);
      std::normal_distribution<float> normal(0, 1);
      const RandomPages pages(/*pages=*/6, /*pt=*/16, d, rng);
      const PagedKvView& kv = pages.kv;
      std::vector<PageSpan> spans = {{4, 0, 16}, {1, 3, 9}, {5, 15, 1}};
      std::vector<float> q(group * d);
      for (float& x : q) x = normal(rng);
      std::vector<float> got(26), each(26 * group);
      Scores(kv, spans.data(), spans.size(), q.data(), group, /*all_heads=*/false, got.data());
      Scores(kv, spans.data(), spans.size(), q.data(), group, /*all_heads=*/true, each.data());
      size_t i = 0;
      for (const PageSpan& s : spans) {
        for (int r = s.first_row; r < s.first_row + s.rows; ++r, ++i) {
          double best = -INFINITY;
          for (int64_t g = 0; g < group; ++g) {
            double dot = 0;
            for (int64_t j = 0; j < d; ++j) {
              dot += q[g * d + j] * Bf16ToFloat(kv.keys(s.page)[r * d + j]);
            }
            best = std::max(best, dot);
            EXPECT_NEAR(each[i * group + g], dot, 1e-4 * std::max(1.0, std::abs(dot)))
                << "d " << d << " group " << group << " head " << g;
          }
          EXPECT_NEAR(got[i], best, 1e-4 * std::max(1.0, std::abs(best)))
              << "d " << d << " group " << group;
        }
      }
    }
  }
}

// The task-split scorers (a head-step's rescoring shared with the step's idle threads) equal the
// one-walk ones bit for bit, with chunks smaller than, equal to and larger than the spans, inside
// a parallel region (where the chunks become tasks) and outside it.
TEST(SelectionTasksTest, ScoresInTasksEqualOneWalkBitForBit) {
  const int64_t d = 128, group = 4, pt = 16, pages = 40;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0, 1);
  const RandomPages random_pages(pages, pt, d, rng);
  const PagedKvView& kv = random_pages.kv;
  std::vector<PageSpan> spans;
  int64_t rows = 0;
  for (int32_t p = 0; p < pages; ++p) {  // spans of 1..16 rows, pages out of order
    const int32_t first = p % 5, n = 1 + (p * 7) % (16 - first);
    spans.push_back({static_cast<int32_t>((p * 17) % pages), first, n});
    rows += n;
  }
  std::vector<float> q(group * d);
  for (float& x : q) x = normal(rng);
  std::vector<float> each(rows * group), best(rows);
  GroupScores(kv, spans.data(), spans.size(), q.data(), group, each.data());
  MaxGroupScores(kv, spans.data(), spans.size(), q.data(), group, best.data());
  for (int64_t per_task : {1, 7, 16, 50, 10000}) {
    for (bool in_parallel : {false, true}) {
      std::vector<float> each_t(rows * group, NAN), best_t(rows, NAN);
      auto run = [&] {
        GroupScoresInTasks(kv, spans.data(), spans.size(), q.data(), group, each_t.data(),
                           per_task);
        MaxGroupScoresInTasks(kv, spans.data(), spans.size(), q.data(), group, best_t.data(),
                              per_task);
      };
      if (in_parallel) {
        CpuPool(2).ParallelFor(2, [&](int64_t i) {
          if (i == 0) run();
        });
      } else {
        run();
      }
      EXPECT_EQ(0, std::memcmp(each.data(), each_t.data(), each.size() * sizeof(float)))
          << per_task << " rows a task, in a parallel region: " << in_parallel;
      EXPECT_EQ(0, std::memcmp(best.data(), best_t.data(), best.size() * sizeof(float)))
          << per_task << " rows a task, in a parallel region: " << in_parallel;
    }
  }
}

TEST_P(SelectionTest, QuestBoundsMatchScalarAndBoundEveryKeyInTheBlock) {
  // 40 leaves a part-width last step for the 16-wide (AVX-512) loop.
  for (int64_t d : {32, 40}) {
    const int64_t pages = 8, group = 3;
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0, 1);
    std::vector<float> keys(pages * 16 * d), mn(pages * d, INFINITY), mx(pages * d, -INFINITY);
    for (float& x : keys) x = normal(rng);
    for (int64_t p = 0; p < pages; ++p)
      for (int64_t t = 0; t < 16; ++t)
        for (int64_t j = 0; j < d; ++j) {
          mn[p * d + j] = std::min(mn[p * d + j], keys[(p * 16 + t) * d + j]);
          mx[p * d + j] = std::max(mx[p * d + j], keys[(p * 16 + t) * d + j]);
        }
    std::vector<float> q(group * d);
    for (float& x : q) x = normal(rng);
    for (int64_t ppb : {1, 2}) {
      const int64_t blocks = pages / ppb - 1;
      std::vector<float> got(blocks);
      Bounds(mn.data(), mx.data(), d, 1, blocks, ppb, q.data(), group, got.data());
      for (int64_t b = 0; b < blocks; ++b) {
        double bound = -INFINITY, best_dot = -INFINITY;
        for (int64_t g = 0; g < group; ++g) {
          double s = 0;
          for (int64_t j = 0; j < d; ++j) {
            double lo = INFINITY, hi = -INFINITY;
            for (int64_t p = (1 + b) * ppb; p < (2 + b) * ppb; ++p) {
              lo = std::min<double>(lo, mn[p * d + j]);
              hi = std::max<double>(hi, mx[p * d + j]);
            }
            s += std::max(q[g * d + j] * lo, q[g * d + j] * hi);
          }
          bound = std::max(bound, s);
          for (int64_t t = (1 + b) * ppb * 16; t < (2 + b) * ppb * 16; ++t) {
            double dot = 0;
            for (int64_t j = 0; j < d; ++j) dot += q[g * d + j] * keys[t * d + j];
            best_dot = std::max(best_dot, dot);
          }
        }
        EXPECT_NEAR(got[b], bound, 1e-4 * std::abs(bound)) << "d " << d;
        EXPECT_GE(got[b] + 1e-3, best_dot);  // an upper bound on every key's score
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Impls, SelectionTest,
                         ::testing::Values(Impl::kDispatched, Impl::kAvx2, Impl::kAvx512,
                                           Impl::kAvx512Bf16),
                         [](const ::testing::TestParamInfo<Impl>& info) {
                           return ImplName(info.param);
                         });

}  // namespace
}  // namespace fluxion::kernels::cpu
