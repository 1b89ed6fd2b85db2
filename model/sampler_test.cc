#include "model/sampler.h"

#include <cmath>
#include <map>

#include "gtest/gtest.h"

namespace fluxion::model {
namespace {

TEST(SamplerTest, GreedyPicksArgmaxAndLowestIdOnTies) {
  Sampler s(SamplingParams{});
  EXPECT_EQ(s.Sample(std::vector<float>{0.1f, 3.0f, -1.0f, 2.9f}), 1);
  EXPECT_EQ(s.Sample(std::vector<float>{5.0f, 1.0f, 5.0f}), 0);
}

TEST(SamplerTest, SameSeedGivesSameStream) {
  std::vector<float> logits = {1.0f, 1.2f, 0.8f, 1.1f, 0.9f};
  SamplingParams p{1.0, 0, 1.0, 42};
  Sampler a(p), b(p);
  std::vector<int32_t> sa, sb;
  for (int i = 0; i < 50; ++i) {
    sa.push_back(a.Sample(logits));
    sb.push_back(b.Sample(logits));
  }
  EXPECT_EQ(sa, sb);
  Sampler c(SamplingParams{1.0, 0, 1.0, 43});
  std::vector<int32_t> sc;
  for (int i = 0; i < 50; ++i) sc.push_back(c.Sample(logits));
  EXPECT_NE(sa, sc);
}

TEST(SamplerTest, TemperatureSamplingFollowsSoftmax) {
  std::vector<float> logits = {0.0f, std::log(2.0f), std::log(7.0f)};  // probs 0.1, 0.2, 0.7
  Sampler s(SamplingParams{1.0, 0, 1.0, 7});
  std::map<int32_t, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[s.Sample(logits)];
  EXPECT_NEAR(counts[0] / double(n), 0.1, 0.015);
  EXPECT_NEAR(counts[1] / double(n), 0.2, 0.015);
  EXPECT_NEAR(counts[2] / double(n), 0.7, 0.015);
}

TEST(SamplerTest, TopKAndTopPExcludeTheTail) {
  std::vector<float> logits = {0.0f, std::log(2.0f), std::log(7.0f)};
  Sampler top_k(SamplingParams{1.0, 2, 1.0, 1});
  Sampler top_p(SamplingParams{1.0, 0, 0.75, 1});  // 0.7 < 0.75 <= 0.9: keeps ids 2 and 1
  for (int i = 0; i < 2000; ++i) {
    EXPECT_NE(top_k.Sample(logits), 0);
    EXPECT_NE(top_p.Sample(logits), 0);
  }
  Sampler nucleus_of_one(SamplingParams{1.0, 0, 0.5, 1});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(nucleus_of_one.Sample(logits), 2);
}

TEST(SamplerTest, InvalidParametersAreRejectedByName) {
  EXPECT_NE(ValidateSamplingParams({-1.0, 0, 1.0, 0}).message().find("temperature"),
            std::string::npos);
  EXPECT_NE(ValidateSamplingParams({1.0, -2, 1.0, 0}).message().find("top_k"), std::string::npos);
  EXPECT_NE(ValidateSamplingParams({1.0, 0, 0.0, 0}).message().find("top_p"), std::string::npos);
  EXPECT_NE(ValidateSamplingParams({1.0, 0, 1.5, 0}).message().find("top_p"), std::string::npos);
  EXPECT_TRUE(ValidateSamplingParams({0.7, 40, 0.9, 3}).ok());
}

}  // namespace
}  // namespace fluxion::model
