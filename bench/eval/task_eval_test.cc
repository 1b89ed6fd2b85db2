// Scoring and policy plumbing of the harness; the end-to-end runs through a model are in
// tests/eval_quick_test.cc.
#include "bench/eval/task_eval.h"

#include <cmath>

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/byte_tokenizer.h"

namespace fluxion::eval {
namespace {

using ::fluxion::model::ByteTokenizer;
using ::testing::HasSubstr;

std::vector<int32_t> Ids(const std::string& text) { return ByteTokenizer::Encode(text, false); }

TEST(TaskEvalTest, AnswerIsTheContinuationUpToTheFirstNewline) {
  EXPECT_EQ(AnswerText(Ids("1234567\nWhat")), "1234567");
  EXPECT_EQ(AnswerText(Ids("\n1234567")), "");
}

TEST(TaskEvalTest, AnswerStopsAtEosToo) {
  std::vector<int32_t> ids = Ids("42");
  ids.push_back(ByteTokenizer::kEos);
  ids.push_back('9');
  EXPECT_EQ(AnswerText(ids), "42");
}

TEST(TaskEvalTest, AnswerWithoutTerminatorIsEverythingGeneratedSpecialsSpelledOut) {
  std::vector<int32_t> ids = Ids("12");
  ids.push_back(ByteTokenizer::kPad);
  EXPECT_EQ(AnswerText(ids), "12<pad>");
}

TEST(TaskEvalTest, DefaultBudgetIsAnswerLengthPlusSixteen) {
  EXPECT_EQ(DefaultMaxNewTokens("1234567"), 23);
  EXPECT_EQ(DefaultMaxNewTokens(std::string(256, 'a')), 272);
}

TEST(TaskEvalTest, WilsonIntervalMatchesTheClosedForm) {
  // Reference values from statsmodels' proportion_confint(method="wilson").
  Interval all = Wilson95(8, 8);
  EXPECT_NEAR(all.low, 0.6756, 1e-4);
  EXPECT_DOUBLE_EQ(all.high, 1.0);
  Interval half = Wilson95(5, 10);
  EXPECT_NEAR(half.low, 0.2366, 1e-4);
  EXPECT_NEAR(half.high, 0.7634, 1e-4);
  Interval none = Wilson95(0, 20);
  EXPECT_DOUBLE_EQ(none.low, 0.0);
  EXPECT_NEAR(none.high, 0.1611, 1e-4);
  Interval empty = Wilson95(0, 0);
  EXPECT_EQ(empty.low, 0.0);
  EXPECT_EQ(empty.high, 1.0);
}

TEST(TaskEvalTest, UnknownPoliciesAreRefusedNamingTheKnownOnesAndTheBaselines) {
  EXPECT_TRUE(ValidatePolicy("full").ok());
  EXPECT_TRUE(ValidatePolicy("quest@0.05").ok());
  EXPECT_TRUE(ValidatePolicy("fixed_32_0.05").ok());
  absl::Status s = ValidatePolicy("nope@0.05");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("known: full"));
  EXPECT_THAT(s.message(), HasSubstr("for comparison, not for serving: quest"));
  EXPECT_FALSE(ValidatePolicy("quest@x").ok());
}

TEST(TaskEvalTest, PairedDifferenceIntervalCentresOnTheDiscordantBalance) {
  // 200 samples, 6 lost and 2 gained: delta -0.02; var = (8/200 - 0.0004)/200.
  const Interval i = PairedDifference95(6, 2, 200);
  const double half = 1.959963984540054 * std::sqrt((8.0 / 200 - 0.0004) / 200);
  EXPECT_NEAR(i.low, -0.02 - half, 1e-12);
  EXPECT_NEAR(i.high, -0.02 + half, 1e-12);
  const Interval none = PairedDifference95(0, 0, 50);  // identical outcomes: a zero interval
  EXPECT_EQ(none.low, 0.0);
  EXPECT_EQ(none.high, 0.0);
}

TEST(TaskEvalTest, PolicyLabelsExpandSparsePoliciesPerBudget) {
  EXPECT_EQ(PolicyLabels({"full", "quest", "fixed_32_0.05"}, {0.02, 0.05}),
            (std::vector<std::string>{"full", "quest@0.02", "quest@0.05", "fixed_32_0.05"}));
}

TEST(TaskEvalTest, FullPolicyStartsFromAnIndependentCopyOfThePrefill) {
  const model::AttentionShape shape = {1, 2, 1, 4, 0.5f};
  model::DenseAttention prefilled(shape);
  std::vector<float> q(2 * 4, 0.1f), kv(4, 0.2f), out(2 * 4);
  ASSERT_TRUE(prefilled.Forward(0, 0, 1, q.data(), kv.data(), kv.data(), out.data()).ok());
  auto attention = MakePolicyAttention("full", prefilled, shape, nullptr);
  ASSERT_TRUE(attention.ok());
  // The copy continues at position 1; the original is untouched.
  ASSERT_TRUE((*attention)->Forward(0, 1, 1, q.data(), kv.data(), kv.data(), out.data()).ok());
  EXPECT_EQ(prefilled.length(0), 1);
  EXPECT_EQ(MakePolicyAttention("nope", prefilled, shape, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TaskEvalTest, TopTwoMarginIsTheGreedyChoicesLeadOverTheRunnerUp) {
  const std::vector<float> logits = {1.0f, 4.5f, -2.0f, 4.0f};
  EXPECT_FLOAT_EQ(TopTwoMargin(logits), 0.5f);
  EXPECT_FLOAT_EQ(TopTwoMargin(std::vector<float>{3.0f, 3.0f, 1.0f}), 0.0f);  // a tie
  EXPECT_FLOAT_EQ(TopTwoMargin(std::vector<float>{-1.0f, -3.0f}), 2.0f);
  EXPECT_FLOAT_EQ(TopTwoMargin(std::vector<float>{7.0f}), 0.0f);
}

TEST(TaskEvalTest, PagedFullIsTheFullSparsePolicyOverPages) {
  const model::AttentionShape shape = {1, 2, 1, 32, 0.5f};
  model::DenseAttention prefilled(shape);
  std::vector<float> q(2 * 32, 0.1f), kv(32, 0.2f), out(2 * 32);
  ASSERT_TRUE(prefilled.Forward(0, 0, 1, q.data(), kv.data(), kv.data(), out.data()).ok());
  auto arena = decode::KvArena::Create(decode::KvShape{1, 1, 32, 16}.page_bytes(), 8);
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto paged = MakePagedPolicyAttention("full", prefilled, shape, arena->get());
  ASSERT_TRUE(paged.ok()) << paged.status();
  EXPECT_EQ((*paged)->policy_config().name, "full");
  EXPECT_EQ((*paged)->kv().length(0), 1);  // the prefilled row, copied into a page
  EXPECT_THAT(FullPolicyAttention("cuda"), HasSubstr("not the fp32 dense path"));
  EXPECT_THAT(FullPolicyAttention("cpu"), HasSubstr("fp32"));
}

}  // namespace
}  // namespace fluxion::eval
