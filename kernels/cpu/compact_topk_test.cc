#include "kernels/cpu/compact_topk.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "gtest/gtest.h"

namespace fluxion::kernels::cpu {
namespace {

TEST(CompactTopKTest, RowsQuantizeToTheirLargestMagnitudeWithHalfEvenRounding) {
  // absmax 127: the inverse is 1, so the values round as they are (half to even).
  const float row[] = {127.0f, -127.0f, 2.5f, 3.5f, -2.5f, 0.4f, 0.0f, 126.6f};
  int8_t out[8];
  EXPECT_EQ(CompactQueryRow(row, 8, out), 1.0f);
  const int8_t want[] = {127, -127, 2, 4, -2, 0, 0, 127};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], want[i]) << i;
}

TEST(CompactTopKTest, AnAllZeroRowHasScaleZeroAndScoresZero) {
  const float zeros[4] = {};
  int8_t out[4];
  EXPECT_EQ(CompactQueryRow(zeros, 4, out), 0.0f);
  for (int8_t v : out) EXPECT_EQ(v, 0);
  CompactQuery q;
  const float query[4] = {-1.0f, 2.0f, -3.0f, 4.0f};
  CompactQueryGroup(query, 1, 4, &q);
  const float score = CompactGroupScore(q, out, 0.0f);
  EXPECT_EQ(score, 0.0f);
  EXPECT_FALSE(std::signbit(score));  // +0: equal scores share one bit pattern
}

TEST(CompactTopKTest, KeyRowsFromFloatRoundToBf16First) {
  // 1 + 2^-9 is not a bf16 value: it rounds to 1, so both rows compact to the same values.
  const float a[2] = {1.0f + 1.0f / 512, -0.5f};
  const bf16 b[2] = {FloatToBf16(1.0f), FloatToBf16(-0.5f)};
  int8_t qa[2], qb[2];
  EXPECT_EQ(CompactKeyRowFromFloat(a, 2, qa), CompactKeyRow(b, 2, qb));
  EXPECT_EQ(qa[0], qb[0]);
  EXPECT_EQ(qa[1], qb[1]);
  EXPECT_EQ(qa[0], 127);
  EXPECT_EQ(qa[1], -64);  // -63.5 rounds to even
}

TEST(CompactTopKTest, GroupScoreIsTheBestHeadsScaledIntegerDot) {
  const int64_t d = 3;
  const float q[2 * d] = {1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 2.0f};
  CompactQuery cq;
  CompactQueryGroup(q, 2, d, &cq);
  const int8_t key[d] = {10, 0, 20};
  // Head 0: 127 * 10 * (1/127) * s; head 1: 127 * 20 * (2/127) * s.
  const float s = 0.5f;
  EXPECT_EQ(CompactGroupScore(cq, key, s),
            CompactScore(127 * 20, 2.0f / 127.0f, s));
}

TEST(CompactTopKTest, PicksAreTheLargestAscendingWithTiesToTheLowerPosition) {
  const float scores[] = {1.0f, 5.0f, 3.0f, 5.0f, 3.0f, 3.0f, -1.0f};
  std::vector<int32_t> picks;
  CompactTopKPositions(scores, 7, 3, 100, &picks);
  EXPECT_EQ(picks, (std::vector<int32_t>{101, 102, 103}));
  CompactTopKPositions(scores, 7, 4, 0, &picks);
  EXPECT_EQ(picks, (std::vector<int32_t>{1, 2, 3, 4}));
  CompactTopKPositions(scores, 7, 0, 0, &picks);
  EXPECT_TRUE(picks.empty());
  CompactTopKPositions(scores, 7, 99, 0, &picks);
  EXPECT_EQ(picks.size(), 7u);
}

// The property selection depends on: on keys with a few strong rows among noise, the compact
// scores' top-k holds nearly all of the exact scores' top-k.
TEST(CompactTopKTest, CompactTopKRecallsTheExactTopK) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n = 4096, d = 128, group = 4, k = 64;
  std::vector<float> q(group * d);
  for (float& x : q) x = normal(rng);
  std::vector<bf16> keys(n * d);
  for (int64_t t = 0; t < n; ++t) {
    const bool strong = t % 97 == 0;  // 43 rows aligned with query head t % group
    for (int64_t i = 0; i < d; ++i) {
      const float x = normal(rng) + (strong ? 0.6f * q[(t % group) * d + i] : 0.0f);
      keys[t * d + i] = FloatToBf16(x);
    }
  }
  CompactQuery cq;
  CompactQueryGroup(q.data(), group, d, &cq);
  std::vector<float> exact(n), compact(n);
  std::vector<int8_t> row(d);
  for (int64_t t = 0; t < n; ++t) {
    float best = -INFINITY;
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0;
      for (int64_t i = 0; i < d; ++i) dot += q[g * d + i] * Bf16ToFloat(keys[t * d + i]);
      best = std::max(best, dot);
    }
    exact[t] = best;
    const float scale = CompactKeyRow(keys.data() + t * d, d, row.data());
    compact[t] = CompactGroupScore(cq, row.data(), scale);
  }
  std::vector<int32_t> want, got;
  CompactTopKPositions(exact.data(), n, k, 0, &want);
  CompactTopKPositions(compact.data(), n, k, 0, &got);
  std::vector<int32_t> common;
  std::set_intersection(want.begin(), want.end(), got.begin(), got.end(),
                        std::back_inserter(common));
  EXPECT_GE(common.size(), static_cast<size_t>(k * 9 / 10));
}

}  // namespace
}  // namespace fluxion::kernels::cpu
