#include "model/logprobs.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace fluxion::model {
namespace {

TEST(LogprobsTest, RowLogprobsAreALogSoftmaxWithTheTopInTheSamplersOrder) {
  // probs 0.1, 0.2, 0.7 (shifted by 5 to check the max shift), with a tie added at -inf.
  const std::vector<float> x = {5.0f, 5.0f + std::log(2.0f), 5.0f + std::log(7.0f), -INFINITY};
  const TokenLogprobs l = LogprobsOfRow(x, 1, 3);
  EXPECT_EQ(l.token, 1);
  EXPECT_NEAR(l.logprob, std::log(0.2), 1e-6);
  ASSERT_EQ(l.top_ids, (std::vector<int32_t>{2, 1, 0}));
  EXPECT_NEAR(l.top_logprobs[0], std::log(0.7), 1e-6);
  EXPECT_NEAR(l.top_logprobs[2], std::log(0.1), 1e-6);
  EXPECT_NEAR(LogSumExp(x), 5.0 + std::log(10.0), 1e-6);
  // Ties go to the lower id; top 0 lists nothing; top beyond the row lists it all.
  const TokenLogprobs tie = LogprobsOfRow(std::vector<float>{1.0f, 2.0f, 2.0f}, 0, 2);
  EXPECT_EQ(tie.top_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_TRUE(LogprobsOfRow(x, 3, 0).top_ids.empty());
  EXPECT_EQ(LogprobsOfRow(x, 3, 9).top_ids.size(), 4u);
  EXPECT_TRUE(std::isinf(LogprobsOfRow(x, 3, 0).logprob));
}

TEST(LogprobsTest, TheRowsTopMatchesAFullSortOnRowsFullOfTies) {
  // Logits drawn from a handful of values, so most ranks are ties the one-pass selection must
  // order exactly as a stable sort of the whole row does.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> x(1 + rng() % 300);
    for (float& v : x) v = static_cast<float>(rng() % 6) - 2.0f;
    const int32_t top = static_cast<int32_t>(rng() % (kMaxTopLogprobs + 1));
    std::vector<int32_t> order(x.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] > x[b]; });
    order.resize(std::min<size_t>(top, x.size()));
    EXPECT_EQ(LogprobsOfRow(x, 0, top).top_ids, order) << "trial " << trial;
  }
}

TEST(LogprobsTest, CandidatesAndTheirNormaliserGiveTheRowsLogprobs) {
  const std::vector<float> x = {0.3f, -1.0f, 2.5f, 0.9f, 2.5f, -0.2f};
  const std::vector<int32_t> ids = {2, 4, 3, 0};  // the row's top 4 in the sampler's order
  std::vector<float> values;
  for (int32_t id : ids) values.push_back(x[id]);
  double normaliser = 0;
  for (float v : x) normaliser += std::exp(double{v} - 2.5);
  const std::optional<TokenLogprobs> c = LogprobsOfCandidates(ids, values, normaliser, 3, 3);
  ASSERT_TRUE(c.has_value());
  const TokenLogprobs r = LogprobsOfRow(x, 3, 3);
  EXPECT_NEAR(c->logprob, r.logprob, 1e-6);
  EXPECT_EQ(c->top_ids, r.top_ids);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(c->top_logprobs[i], r.top_logprobs[i], 1e-6);
  // What a list cannot answer: a token it lacks, a top beyond it, no normaliser.
  EXPECT_FALSE(LogprobsOfCandidates(ids, values, normaliser, 1, 3).has_value());
  EXPECT_FALSE(LogprobsOfCandidates(ids, values, normaliser, 3, 5).has_value());
  EXPECT_FALSE(LogprobsOfCandidates(ids, values, NAN, 3, 3).has_value());
  EXPECT_FALSE(LogprobsOfCandidates(ids, values, 0.0, 3, 3).has_value());
}

}  // namespace
}  // namespace fluxion::model
