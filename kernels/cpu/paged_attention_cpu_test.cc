// Conformance of the CPU paged decode attention against the reference twin, over a grid of
// head_dim, GQA group, page size, page count and sparsity. Inputs are bf16 pages filled with
// random values (never zeros) in a real arena layout with gaps between the pages used.
// Tolerance: the K/V values are identical bf16 on both sides; the reference accumulates in double,
// the kernel in fp32 with a different order: relative L2 error <= 2e-6 on the output and absolute
// <= 1e-5 on the log-sum-exp (a wrong row, mask or rescale gives errors of order 1e-1).
#include "kernels/cpu/paged_attention_cpu.h"

#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/reference/reference_ops.h"

namespace fluxion::kernels {
namespace {

struct Case {
  int64_t head_dim, group, page_tokens, pages;
  double keep;  // fraction of pages attended (sparsity)
  bool partial_rows;  // spans cover only part of their pages
};

class PagedAttentionTest : public ::testing::TestWithParam<Case> {};

struct Fixture {
  std::vector<uint8_t> arena;
  PagedKvView kv;
  std::vector<PageSpan> spans;
  std::vector<float> q;
};

Fixture Make(const Case& c, uint32_t seed) {
  Fixture f;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t arena_pages = c.pages * 2 + 3;  // the request's pages are scattered in the arena
  f.kv.page_tokens = c.page_tokens;
  f.kv.head_dim = c.head_dim;
  f.kv.page_bytes = 2 * c.page_tokens * c.head_dim * sizeof(bf16) + 64;  // padded pages
  f.arena.resize(arena_pages * f.kv.page_bytes);
  f.kv.arena = f.arena.data();
  auto* base = f.arena.data();
  for (int64_t p = 0; p < arena_pages; ++p) {
    auto* page = reinterpret_cast<bf16*>(base + p * f.kv.page_bytes);
    for (int64_t i = 0; i < 2 * c.page_tokens * c.head_dim; ++i) {
      page[i] = FloatToBf16(normal(rng) * 1.5f);
    }
  }
  std::vector<int32_t> ids(arena_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (int64_t p = 0; p < c.pages; ++p) {
    if (std::uniform_real_distribution<double>(0, 1)(rng) >= c.keep) continue;
    PageSpan s{ids[p], 0, static_cast<int32_t>(c.page_tokens)};
    if (c.partial_rows) {
      s.first_row = static_cast<int32_t>(rng() % c.page_tokens);
      s.rows = 1 + static_cast<int32_t>(rng() % (c.page_tokens - s.first_row));
    }
    f.spans.push_back(s);
  }
  f.q.resize(c.group * c.head_dim);
  for (float& x : f.q) x = normal(rng);
  return f;
}

double RelErr(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

TEST_P(PagedAttentionTest, MatchesReferenceWithinTolerance) {
  const Case c = GetParam();
  ASSERT_TRUE(cpu::PagedAttentionSupported(c.head_dim, c.group, c.page_tokens));
  Fixture f = Make(c, 17);
  DecodeQuery q{f.q.data(), c.group, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  std::vector<float> out(c.group * c.head_dim, NAN), lse(c.group, NAN);
  std::vector<float> ref_out(out.size()), ref_lse(c.group);
  cpu::PagedAttention(f.kv, f.spans.data(), f.spans.size(), q, {out.data(), lse.data()});
  reference::PagedAttention(f.kv, f.spans.data(), f.spans.size(), q,
                            {ref_out.data(), ref_lse.data()});
  EXPECT_LT(RelErr(out, ref_out), 2e-6);
  for (int64_t g = 0; g < c.group; ++g) {
    if (f.spans.empty()) {
      EXPECT_EQ(lse[g], -INFINITY);
    } else {
      EXPECT_NEAR(lse[g], ref_lse[g], 1e-5);
    }
  }
}

TEST_P(PagedAttentionTest, MergingTwoHalvesEqualsAttendingTheWhole) {
  const Case c = GetParam();
  Fixture f = Make(c, 23);
  if (f.spans.size() < 2) GTEST_SKIP() << "needs two spans";
  DecodeQuery q{f.q.data(), c.group, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  const size_t half = f.spans.size() / 2;
  std::vector<float> whole(c.group * c.head_dim), whole_lse(c.group);
  std::vector<float> a(whole.size()), a_lse(c.group), b(whole.size()), b_lse(c.group);
  cpu::PagedAttention(f.kv, f.spans.data(), f.spans.size(), q, {whole.data(), whole_lse.data()});
  cpu::PagedAttention(f.kv, f.spans.data(), half, q, {a.data(), a_lse.data()});
  cpu::PagedAttention(f.kv, f.spans.data() + half, f.spans.size() - half, q,
                      {b.data(), b_lse.data()});
  std::vector<float> ref_a = a, ref_a_lse = a_lse;
  cpu::MergeAttentionStates(a.data(), a_lse.data(), b.data(), b_lse.data(), c.group, c.head_dim);
  reference::MergeAttentionStates(ref_a.data(), ref_a_lse.data(), b.data(), b_lse.data(), c.group,
                                  c.head_dim);
  EXPECT_LT(RelErr(a, whole), 2e-6);
  EXPECT_LT(RelErr(a, ref_a), 1e-6);
  for (int64_t g = 0; g < c.group; ++g) EXPECT_NEAR(a_lse[g], whole_lse[g], 1e-5);
}

TEST_P(PagedAttentionTest, SplitAcrossThreadsMatchesSingleThread) {
  const Case c = GetParam();
  Fixture f = Make(c, 29);
  DecodeQuery q{f.q.data(), c.group, 1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  std::vector<float> one(c.group * c.head_dim), one_lse(c.group);
  std::vector<float> split(one.size(), NAN), split_lse(c.group, NAN);
  cpu::PagedAttention(f.kv, f.spans.data(), f.spans.size(), q, {one.data(), one_lse.data()});
  cpu::PagedAttentionSplit(f.kv, f.spans.data(), f.spans.size(), q,
                           {split.data(), split_lse.data()}, 3);
  EXPECT_LT(RelErr(split, one), 2e-6);
  for (int64_t g = 0; g < c.group; ++g) {
    if (f.spans.empty()) {
      EXPECT_EQ(split_lse[g], -INFINITY);
    } else {
      EXPECT_NEAR(split_lse[g], one_lse[g], 1e-5);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, PagedAttentionTest,
    ::testing::Values(Case{128, 4, 16, 64, 1.0, false},    // Llama-8B head, GQA 4:1, dense
                      Case{128, 4, 16, 256, 0.05, false},  // 5% of pages
                      Case{128, 1, 16, 40, 0.5, true},     // MHA, partial spans (token top-k)
                      Case{64, 7, 16, 33, 0.3, false},     // Qwen2.5-0.5B (14:2) head layout
                      Case{64, 8, 32, 20, 1.0, true},      // 32-token pages
                      Case{96, 2, 64, 9, 1.0, false},      // 64-token pages, head_dim 96
                      Case{256, 16, 16, 5, 1.0, false},    // largest head and group
                      Case{32, 4, 16, 3, 0.0, false}),     // nothing selected: empty state
    [](const ::testing::TestParamInfo<Case>& info) {
      const Case& c = info.param;
      return "d" + std::to_string(c.head_dim) + "_g" + std::to_string(c.group) + "_p" +
             std::to_string(c.page_tokens) + "x" + std::to_string(c.pages) + "_keep" +
             std::to_string(static_cast<int>(c.keep * 100)) + (c.partial_rows ? "_partial" : "");
    });

TEST(MergeAttentionStatesTest, TwoEmptyStatesMergeToEmpty) {
  std::vector<float> a(8, 0.0f), b(8, 0.0f), la(1, -INFINITY), lb(1, -INFINITY);
  cpu::MergeAttentionStates(a.data(), la.data(), b.data(), lb.data(), 1, 8);
  EXPECT_EQ(la[0], -INFINITY);
  for (float x : a) EXPECT_EQ(x, 0.0f);
}

TEST(PagedAttentionSupportTest, RejectsShapesTheKernelCannotHold) {
  EXPECT_FALSE(cpu::PagedAttentionSupported(120, 4, 16));  // not a multiple of 16
  EXPECT_FALSE(cpu::PagedAttentionSupported(512, 4, 16));
  EXPECT_FALSE(cpu::PagedAttentionSupported(128, 32, 16));
  EXPECT_FALSE(cpu::PagedAttentionSupported(128, 4, 128));
  EXPECT_TRUE(cpu::PagedAttentionSupported(128, 4, 16));
}

}  // namespace
}  // namespace fluxion::kernels
