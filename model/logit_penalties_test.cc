#include "model/logit_penalties.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "model/sampler.h"

namespace fluxion::model {
namespace {

TEST(LogitPenaltiesTest, RepetitionThenFrequencyAndPresenceAsVllmAppliesThem) {
  TokenHistory h;
  h.SetPrompt(std::vector<int32_t>{1, 2, 2});
  h.Accept(2);
  h.Accept(3);
  h.Accept(3);
  PenaltyParams p;
  EXPECT_FALSE(h.Changes(p));
  p.repetition = 2.0;
  p.frequency = 0.5;
  p.presence = 0.25;
  ASSERT_TRUE(h.Changes(p));
  std::vector<float> row = {1.0f, 4.0f, -2.0f, 3.0f, 5.0f};
  h.Apply(p, absl::MakeSpan(row));
  EXPECT_FLOAT_EQ(row[0], 1.0f);                 // never seen
  EXPECT_FLOAT_EQ(row[1], 2.0f);                 // prompt: 4 / 2
  EXPECT_FLOAT_EQ(row[2], -4.0f - 0.5f - 0.25f);  // prompt and output once: -2 * 2, then 1 x f, p
  EXPECT_FLOAT_EQ(row[3], 1.5f - 1.0f - 0.25f);  // output twice: 3 / 2, then 2 x f, p
  EXPECT_FLOAT_EQ(row[4], 5.0f);
}

TEST(LogitPenaltiesTest, MinTokensRulesTheStopsOutUntilReached) {
  TokenHistory h;
  PenaltyParams p;
  p.min_tokens = 2;
  p.stop_token_ids = {0, 9};  // 9: outside the row, skipped
  std::vector<float> row = {5.0f, 1.0f};
  ASSERT_TRUE(h.Changes(p));
  h.Apply(p, absl::MakeSpan(row));
  EXPECT_TRUE(std::isinf(row[0]) && row[0] < 0);
  EXPECT_EQ(row[1], 1.0f);
  h.Accept(1);
  EXPECT_TRUE(h.Changes(p));
  h.Accept(1);
  EXPECT_FALSE(h.Changes(p));  // two output tokens: the stops are back
}

TEST(LogitPenaltiesTest, TheSamplerDrawsFromThePenalisedRowAndReportsTheRawLogprobs) {
  SamplingParams params;  // greedy
  params.logprobs = 1;
  params.penalties.min_tokens = 1;
  params.penalties.stop_token_ids = {0};
  Sampler s(params);
  const std::vector<float> row = {3.0f, 1.0f, 2.0f};
  EXPECT_EQ(s.CandidatesNeeded(3, 8), 0);  // the raw order no longer holds
  Candidates c;
  const std::vector<int32_t> ids = {0, 2, 1};
  const std::vector<float> values = {3.0f, 2.0f, 1.0f};
  c.ids = ids;
  c.logits = values;
  c.vocab = 3;
  c.normaliser = 1.5;
  EXPECT_FALSE(s.SampleCandidates(c).has_value());
  EXPECT_EQ(s.Sample(row), 2);  // 0 is held back
  ASSERT_TRUE(s.last_logprobs().has_value());
  EXPECT_EQ(s.last_logprobs()->top_ids, std::vector<int32_t>{0});  // the raw row's top
  s.Accept(2);
  EXPECT_EQ(s.CandidatesNeeded(3, 8), 1);
  EXPECT_EQ(s.Sample(row), 0);
  // Invalid values are refused by name.
  params.penalties.presence = 3;
  EXPECT_NE(ValidateSamplingParams(params).message().find("presence_penalty"), std::string::npos);
  params.penalties.presence = 0;
  params.penalties.repetition = 0;
  EXPECT_NE(ValidateSamplingParams(params).message().find("repetition_penalty"),
            std::string::npos);
}

TEST(LogitPenaltiesTest, SkipDrawAdvancesTheStreamAsADrawDoes) {
  SamplingParams params{1.0, 0, 1.0, 77};
  Sampler skipped(params), drawn(params);
  skipped.SkipDraw();
  (void)drawn.Sample(std::vector<float>{0.5f, 0.1f, -1.0f});
  const std::vector<float> row = {0.2f, 0.3f, 0.1f, 0.4f};
  for (int i = 0; i < 20; ++i) EXPECT_EQ(skipped.Sample(row), drawn.Sample(row));
}

}  // namespace
}  // namespace fluxion::model
