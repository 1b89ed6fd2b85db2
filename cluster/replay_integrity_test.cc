#include "cluster/replay_integrity.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fluxion::cluster {
namespace {

using ::testing::HasSubstr;

// Requests 0..n-1; request i sends prompt `prompt_of[i]` (its source_index) with 16 prompt tokens
// and `output` tokens asked for.
Schedule Repeated(const std::vector<int64_t>& prompt_of, int64_t output = 4) {
  Schedule s;
  for (size_t i = 0; i < prompt_of.size(); ++i) {
    s.requests.push_back({static_cast<double>(i), 16, output, {}, prompt_of[i]});
  }
  return s;
}

RequestRecord Answer(int64_t index, std::vector<uint32_t> ids, int status = 0) {
  RequestRecord r;
  r.index = index;
  r.request_id = "replay-" + std::to_string(index);
  r.output_ids = std::move(ids);
  r.output_tokens = static_cast<int64_t>(r.output_ids.size());
  r.status_code = status;
  return r;
}

TEST(ReplayIntegrityTest, EqualAnswersToEachPromptPass) {
  Schedule s = Repeated({0, 1, 0, 1, 0});
  std::vector<RequestRecord> records = {Answer(4, {1, 2, 3, 4}), Answer(0, {1, 2, 3, 4}),
                                        Answer(1, {9, 9, 9, 9}), Answer(2, {1, 2, 3, 4}),
                                        Answer(3, {9, 9, 9, 9})};
  AnswerCheck c = CheckRepeatedAnswers(s, records, 256);
  EXPECT_EQ(c.prompts, 2);
  EXPECT_EQ(c.answers_compared, 3);
  EXPECT_EQ(c.mismatched, 0);
  EXPECT_TRUE(c.examples.empty());
}

TEST(ReplayIntegrityTest, AnAnswerThatDiffersIsCountedAndNamedAgainstTheFirstAnswer) {
  Schedule s = Repeated({0, 0, 0});
  std::vector<RequestRecord> records = {Answer(0, {1, 2, 3, 4}), Answer(1, {1, 2, 7, 4}),
                                        Answer(2, {1, 2, 3})};
  AnswerCheck c = CheckRepeatedAnswers(s, records, 256);
  EXPECT_EQ(c.answers_compared, 2);
  EXPECT_EQ(c.mismatched, 2);
  ASSERT_EQ(c.examples.size(), 2u);
  EXPECT_EQ(c.examples[0], "replay-1 differs from replay-0 (same prompt) at token 2 of 4: 7 vs 3");
  EXPECT_EQ(c.examples[1], "replay-2 differs from replay-0 (same prompt) at token 3 of 4: 3 tokens vs 4");
  EXPECT_THAT(FormatAnswerCheck(c), HasSubstr("2 compared over 1 prompts, 2 differed"));
  EXPECT_EQ(AnswerCheckToJson(c)["mismatched"], 2);
}

TEST(ReplayIntegrityTest, FailedCancelledAndUnrecordedAnswersAreNotCompared) {
  Schedule s = Repeated({0, 0, 0, 0});
  RequestRecord cancelled = Answer(2, {5});
  cancelled.status_code = 1;
  cancelled.cancelled_by_client = true;
  std::vector<RequestRecord> records = {Answer(0, {7}, /*status=*/14), Answer(1, {1, 2, 3, 4}),
                                        cancelled, Answer(3, {})};
  AnswerCheck c = CheckRepeatedAnswers(s, records, 256);
  EXPECT_EQ(c.answers_compared, 0);
  EXPECT_EQ(c.mismatched, 0);
}

TEST(ReplayIntegrityTest, DifferentPromptsOrLengthsAreNeverCompared) {
  Schedule s = Repeated({0, 1});
  s.requests.push_back({2.0, 16, 8, {}, 0});  // prompt 0, but 8 tokens asked for
  std::vector<RequestRecord> records = {Answer(0, {1, 2, 3, 4}), Answer(1, {5, 6, 7, 8}),
                                        Answer(2, {1, 2, 3, 4, 5, 6, 7, 8})};
  AnswerCheck c = CheckRepeatedAnswers(s, records, 256);
  EXPECT_EQ(c.prompts, 0);
  EXPECT_EQ(c.answers_compared, 0);
}

TEST(ReplayIntegrityTest, RecordsOutsideTheScheduleAreIgnored) {
  Schedule s = Repeated({0});
  std::vector<RequestRecord> records = {Answer(0, {1}), Answer(7, {2}), Answer(-1, {3})};
  EXPECT_EQ(CheckRepeatedAnswers(s, records, 256).answers_compared, 0);
}

}  // namespace
}  // namespace fluxion::cluster
